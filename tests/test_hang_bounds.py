"""A stopped or killed peer ends the run within a bound, with exit code 77, a stack dump and
``exit_status.json``: never a hang until the process group's 10-minute timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import REPO, free_port, kill_ranks, start_ranks
from tests.forked import reap

SCRIPT = REPO / "tests" / "scripts" / "hang_peer.py"
HARD_TIMEOUT_S = 120

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> list[int]:
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(p.exists() and p.read_text() for p in paths):
            return [int(p.read_text()) for p in paths]
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended before training: {[reap(p) for p in procs]}")
        time.sleep(0.2)
    raise AssertionError("ranks did not reach step 20")


def _strike(run_dir: Path, mode: str, sig: signal.Signals) -> tuple[int, float, str]:
    """Start 2 ranks directly, stop/kill rank 1 after step 20; return rank 0's code, seconds from
    the strike to its exit, and its stderr."""
    procs = start_ranks([sys.executable, str(SCRIPT), str(run_dir), mode], 2)
    try:
        _wait_for([run_dir / "pid-rank0", run_dir / "pid-rank1"], procs)
        struck = time.monotonic()
        os.kill(procs[1].pid, sig)
        _, err = procs[0].communicate(timeout=HARD_TIMEOUT_S)
        return procs[0].returncode, time.monotonic() - struck, err
    finally:
        kill_ranks(procs)


# Which bound ends the survivor depends on where the peer stopped: inside a step's collective (the
# watchdog: "no progress") or in the health probe ("health check ... failed"). Both dump stacks.
BY_WATCHDOG = ("no progress",)
BY_WATCHDOG_OR_PROBE = ("no progress", "health check")


def _assert_hang_evidence(run_dir: Path, reasons: tuple[str, ...]) -> None:
    dumps = list(run_dir.glob("hang-rank0-*.txt"))
    assert dumps, f"no stack dump in {sorted(p.name for p in run_dir.iterdir())}"
    text = dumps[0].read_text()
    assert any(r in text for r in reasons) and "Thread" in text and "File" in text, text[:500]
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 77 and any(r in status["reason"] for r in reasons), status


def test_health_check_timeout_bounds_a_hang_inside_a_step(tmp_path):
    code, seconds, err = _strike(tmp_path, "health", signal.SIGSTOP)
    assert code == 77, err[-3000:]
    assert seconds < 30, seconds
    _assert_hang_evidence(tmp_path, BY_WATCHDOG_OR_PROBE)


def test_the_watchdog_alone_bounds_a_hang(tmp_path):
    code, seconds, err = _strike(tmp_path, "watchdog", signal.SIGSTOP)
    assert code == 77, err[-3000:]
    assert seconds < 30, seconds
    _assert_hang_evidence(tmp_path, BY_WATCHDOG)


def test_a_killed_peer_ends_the_survivor_with_77_within_seconds(tmp_path):
    code, seconds, err = _strike(tmp_path, "watchdog", signal.SIGKILL)
    assert code == 77, err[-3000:]
    assert seconds < 15, seconds
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert status["code"] == 77


def test_under_torchrun_a_stopped_peer_is_bounded_and_exit_status_says_77(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        str(SCRIPT), str(tmp_path), "health",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = _wait_for([tmp_path / "pid-rank0", tmp_path / "pid-rank1"], [proc])
        struck = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        _, err = proc.communicate(timeout=HARD_TIMEOUT_S)
        seconds = time.monotonic() - struck
    finally:
        if proc.poll() is None:
            reap(proc)  # torchrun and its workers, the stopped one too (it holds the output pipes)
        for pid in locals().get("pids", []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert seconds < 60, seconds
    _assert_hang_evidence(tmp_path, BY_WATCHDOG_OR_PROBE)


# ------------------------------------------------------------------- slow is not hung
# A 2 s HealthCheck bound and storage made slow (a sleep inside the write or verify path) on rank 0
# only, so rank 1 waits in the collectives around rank 0's long local waits for longer than the
# bound: every run must finish (or stop with 75) all the same, while a peer that really stops
# still ends the survivor with 77.
SLOW = REPO / "tests" / "scripts" / "slow_storage.py"


def _slow_ranks(run_dir: Path, steps: int, env: dict) -> list[subprocess.Popen]:
    return start_ranks([sys.executable, str(SLOW), str(run_dir), str(steps)], 2, env=env)


def _finish(procs: list[subprocess.Popen]) -> tuple[list[int], list[str]]:
    try:
        errs = [p.communicate(timeout=HARD_TIMEOUT_S)[1] for p in procs]
        return [p.returncode for p in procs], errs
    finally:
        kill_ranks(procs)


def _await_file(path: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            kill_ranks(procs)
            raise AssertionError(f"{path.name} never appeared: {[reap(p) for p in procs]}")
        time.sleep(0.05)


def _complete_steps(run_dir: Path) -> list[int]:
    from hookloop.engine.checkpoint_format.directory import complete_checkpoints

    return [step for step, _ in complete_checkpoints(run_dir / "checkpoints")[0]]


def test_a_save_due_while_the_last_write_is_still_on_slow_storage_is_not_a_hang(tmp_path):
    codes, errs = _finish(_slow_ranks(tmp_path, 6, {"SLOW_WRITE_S": "5", "SLOW_RANKS": "0"}))
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert _complete_steps(tmp_path) == [6, 4, 2]
    assert not list(tmp_path.glob("hang-rank*.txt"))


def test_resume_with_slow_verification_is_not_a_hang(tmp_path):
    codes, errs = _finish(_slow_ranks(tmp_path, 4, {}))
    assert codes == [0, 0], errs[0][-3000:]
    codes, errs = _finish(_slow_ranks(tmp_path, 6, {"SLOW_VERIFY_S": "5", "SLOW_RANKS": "0"}))
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_00000004'} (step 4)" in errs[0]
    assert _complete_steps(tmp_path)[0] == 6
    assert not list(tmp_path.glob("hang-rank*.txt"))


def test_ctrl_c_behind_a_slow_write_saves_the_final_step_and_exits_75(tmp_path):
    procs = _slow_ranks(tmp_path, 200, {"SLOW_WRITE_S": "4", "SLOW_RANKS": "0"})
    _await_file(tmp_path / "finish-wait-rank0", procs)  # a save is due, the last one still on disk
    for p in procs:
        os.kill(p.pid, signal.SIGINT)
    codes, errs = _finish(procs)
    assert codes == [75, 75], errs[0][-3000:] + errs[1][-3000:]
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert status["code"] == 75
    steps = _complete_steps(tmp_path)
    assert steps[0] == status["step"] and 2 in steps, steps  # the final save, and the slow ones
    assert status["checkpoint"] == str(tmp_path / "checkpoints" / f"step_{status['step']:08d}")


def test_a_peer_stopped_while_a_rank_waits_for_its_slow_write_still_ends_it_with_77(tmp_path):
    procs = _slow_ranks(tmp_path, 200, {"SLOW_WRITE_S": "6", "SLOW_RANKS": "0"})
    _await_file(tmp_path / "finish-wait-rank0", procs)  # rank 0 waits locally, rank 1 in a collective
    struck = time.monotonic()
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        _, err = procs[0].communicate(timeout=HARD_TIMEOUT_S)
        seconds = time.monotonic() - struck
    finally:
        kill_ranks(procs)
    assert procs[0].returncode == 77, err[-3000:]
    assert seconds < 6 + 20, seconds  # its own wait, then about one bound
    _assert_hang_evidence(tmp_path, BY_WATCHDOG)
