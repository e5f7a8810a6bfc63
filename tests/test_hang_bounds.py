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

SCRIPT = REPO / "tests" / "scripts" / "hang_peer.py"
HARD_TIMEOUT_S = 120

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> list[int]:
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(p.exists() and p.read_text() for p in paths):
            return [int(p.read_text()) for p in paths]
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended before training: {[p.communicate() for p in procs]}")
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in locals().get("pids", []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert seconds < 60, seconds
    _assert_hang_evidence(tmp_path, BY_WATCHDOG_OR_PROBE)
