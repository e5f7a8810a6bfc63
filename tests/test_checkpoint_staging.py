"""The default checkpoint mode ("async") copies the state to host memory in the background: these
tests hold that copy in flight on purpose (a gated stager) and try to break the promises around it.

While a save's staging is in flight: (a) the next optimizer step must wait, so the checkpoint holds
the state of its own step bitwise, also when the forward of the next step changed the model's
buffers; (b) a rollback must wait too, so the restored weights never leak into the save; (c) the
run's end and a failure drain the save; (d) a kill -9 leaves no published torn checkpoint and the
next run resumes from the previous one. Single process and two gloo ranks (DDP).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from hookloop.engine import ConfigError, Events, Trainer
from hookloop.engine.checkpoint_format.directory import (
    complete_checkpoints,
    parse_step,
    read_latest,
    step_dir_name,
)
from hookloop.engine.checkpoint_format.manifest import RecordingWriter
from hookloop.engine.checkpoint_format.safe_read import verify_checkpoint
from hookloop.handlers import Places, Priority
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointConfig
from tests.cadence import save_every
from tests.dist_utils import REPO, free_port, rank_env, run_distributed
from tests.forked import ForkedProcess, start_forked
from tests.scripts import ckpt_train
from tests.scripts.ckpt_train import GatedStager

pytestmark = pytest.mark.usefixtures("deterministic")

OPEN_AFTER_S = 0.3  # the gate opens this long after the moment under test: the wait must cover it
SCENARIOS = ("optimizer_step", "rollback", "end", "fail")


def test_the_default_mode_stages_in_the_background_and_old_names_still_load(tmp_path):
    assert CheckpointConfig().mode == "async"
    assert AsyncCheckpointer(tmp_path).mode == "async"
    assert AsyncCheckpointer(tmp_path, mode="async_staged").mode == "async"  # the old name
    CheckpointConfig(mode="async_staged").validate()
    CheckpointConfig(mode="async_copy").validate()
    with pytest.raises(ConfigError, match=r"checkpoint\.mode.*'async', 'async_copy', 'sync'"):
        CheckpointConfig(mode="staged").validate()


# ------------------------------------------------------------------------------ races
def build(world: int, directory: str, **kwargs: Any) -> tuple[Trainer, AsyncCheckpointer]:
    """A model with BatchNorm (its forward changes buffers) trained with AdamW; DDP on 2 ranks."""
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    if world > 1:
        from hookloop.engine.parallel import wrap_data_parallel

        model = wrap_data_parallel(model, "ddp")
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.nn.functional.mse_loss)
    every = kwargs.pop("every_steps", None)
    if every is not None:
        save_every(trainer, every)
    return trainer, AsyncCheckpointer(directory, **kwargs).attach(trainer)


def data() -> list:
    """The same batches on every rank: DCP writes a replicated tensor from one rank only, so the
    BatchNorm statistics (which DDP keeps per rank between its broadcasts) must agree across ranks
    for each rank's own record of them to be comparable with the checkpoint."""
    g = torch.Generator().manual_seed(100)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(16)]


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: parameters, buffers, optimizer state."""
    model_sd, optim_sd = get_state_dict(
        trainer.model, trainer.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    out = {f"m.{k}": v.detach().clone() for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    out.update({f"o.{k}": v.detach().clone() for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def checkpoint_content(world: int, path: str, reader_dir: str) -> dict[str, torch.Tensor]:
    """What the checkpoint at ``path`` restores into a freshly built trainer."""
    trainer, checkpointer = build(world, reader_dir, resume=path)
    torch.manual_seed(9)  # other weights than the run that wrote it
    trainer.run(data(), max_steps=parse_step(os.path.basename(path)))  # nothing left to train
    checkpointer.close()
    assert checkpointer.resumed_from == path
    return state_of(trainer)


def race(rank: int, world: int, directory: str, scenario: str) -> dict[str, Any]:
    """Hold the save of step 3 (``scenario``: "end"/"fail", step 4) in staging, do the thing under
    test, open the gate only later; report what the checkpointer and the checkpoints hold."""
    if world > 1:
        from hookloop.engine.parallel import init_distributed

        init_distributed()
    trainer, checkpointer = build(world, directory, every_steps=2, keep_last=10)
    stager = checkpointer._writer.stager = GatedStager()
    at = 4 if scenario in ("end", "fail") else 3
    out: dict[str, Any] = {"mode": checkpointer.mode}
    saved: dict[str, torch.Tensor] = {}

    @trainer.on(Events.STEP_START)
    def _hold(engine: Trainer) -> None:  # asked before the step's agreement: this step's save stalls
        if engine.state.step == at and "staging_at_save" not in out:
            # The gate holds this step's save only: the copy of an earlier save (step 2's, slow on a
            # loaded machine) finishes first, or it would wait behind the gate with everything else.
            deadline = time.monotonic() + 120
            while checkpointer.staging and time.monotonic() < deadline:
                time.sleep(0.01)
            engine.control.request_save()
            deadline = time.monotonic() + 60
            while checkpointer.staging and time.monotonic() < deadline:  # the previous save's copy
                time.sleep(0.001)  # must not meet the closed gate
            stager.gate.clear()

    @trainer.on(Events.STEP_END, priority=Places.CHECKPOINT - 1)
    def _after_save(engine: Trainer) -> None:
        if engine.state.step != at or "staging_at_save" in out:
            return
        out["staging_at_save"] = checkpointer.staging
        saved.update(state_of(engine))
        if scenario == "optimizer_step":
            return
        threading.Timer(OPEN_AFTER_S, stager.gate.set).start()
        if scenario == "rollback":
            out["restored"] = checkpointer.restore_latest(at_or_before=2)
            out["staging_after_rollback"] = checkpointer.staging
            out["after_rollback"] = state_of(engine)
        elif scenario == "fail":
            raise RuntimeError("a handler failed right after a save started")

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP, priority=Priority.DEFAULT)
    def _next_step(engine: Trainer) -> None:  # the staging wait comes after this, last
        if scenario == "optimizer_step" and engine.state.step == at + 1:
            out["staging_before_next_step"] = checkpointer.staging
            running_mean = next(k for k in saved if k.endswith("running_mean"))
            current = state_of(engine)
            out["forward_changed_buffers"] = not torch.equal(current[running_mean], saved[running_mean])
            threading.Timer(OPEN_AFTER_S, stager.gate.set).start()

    try:
        trainer.run(data(), max_steps=4 if scenario in ("end", "fail") else 5)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    out["saving_after_run"] = checkpointer.saving
    out["latest"] = read_latest(directory)
    out["complete"] = [s for s, _ in complete_checkpoints(directory)[0]]
    out["partial"] = sorted(n for n in os.listdir(directory) if ".partial-" in n)
    if scenario != "fail":
        checkpointer.close()
    path = os.path.join(directory, step_dir_name(at))
    if at in out["complete"]:
        out["saved_vs_checkpoint"] = differences(saved, checkpoint_content(world, path, directory + "-r"))
    if scenario == "rollback":
        step_2 = checkpoint_content(world, os.path.join(directory, step_dir_name(2)), directory + "-r2")
        out["rollback_vs_step_2"] = differences(out.pop("after_rollback"), step_2)
    return out


def check(out: dict[str, Any], scenario: str, world: int) -> None:
    at = 4 if scenario in ("end", "fail") else 3
    assert out["mode"] == "async"
    assert out["staging_at_save"] is True  # the save call returned before the copy was made
    if scenario == "optimizer_step":
        assert out["staging_before_next_step"] is True  # forward/backward ran during the copy
        assert out["forward_changed_buffers"] is True  # BatchNorm statistics moved in that forward
        assert out["complete"] == [5, 4, 3, 2]
    if scenario == "rollback":
        assert out["restored"] == 2 and out["staging_after_rollback"] is False
        assert out["rollback_vs_step_2"] == []
        assert out["complete"] == [5, 4, 3, 2]
    if scenario == "end":
        assert out["error"] is None and out["saving_after_run"] is False
        assert out["latest"] == step_dir_name(4) and out["complete"] == [4, 2]
    if scenario == "fail":
        assert "a handler failed" in out["error"]
        if world == 1:  # no peer to agree with: the drained save is published
            assert out["latest"] == step_dir_name(4) and out["complete"] == [4, 2]
        else:  # no collective on the failure path: it stays a partial directory, never loaded
            assert out["latest"] == step_dir_name(2) and out["complete"] == [2]
            assert [n.split(".")[0] for n in out["partial"]] == [step_dir_name(4)]
            return
    # the checkpoint holds bitwise the state of the step it was saved at
    assert out["saved_vs_checkpoint"] == [], f"step {at}'s checkpoint differs: {out['saved_vs_checkpoint']}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_staging_in_flight_single_process(tmp_path, scenario):
    check(race(0, 1, str(tmp_path / "ckpt"), scenario), scenario, 1)


def _two_rank_races(rank: int, world: int, root: str) -> dict[str, Any]:
    return {scenario: race(rank, world, os.path.join(root, scenario), scenario) for scenario in SCENARIOS}


def test_staging_in_flight_two_ranks(tmp_path):
    results = run_distributed(_two_rank_races, 2, str(tmp_path))
    for rank, result in enumerate(results):
        for scenario in SCENARIOS:
            try:
                check(result[scenario], scenario, 2)
            except AssertionError as e:
                raise AssertionError(f"rank {rank}, {scenario}: {e}") from e


# ------------------------------------------------------------------------------ kill -9
def _start(directory, steps: int, out, extra: list[str], world: int) -> list[ForkedProcess]:
    """``world`` processes of tests/scripts/ckpt_train.py (DDP over gloo when 2; forks,
    ``tests/forked.py``), stdout read as it comes, stderr to files."""
    port = free_port()
    script = [sys.executable, str(REPO / "tests/scripts/ckpt_train.py"), str(directory), str(steps), str(out)]
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        if world > 1:
            env.update(rank_env(rank, world, port))
        cmd = script + extra + (["--ddp"] if world > 1 else [])
        stderr = Path(f"{out}.stderr.{rank}")
        procs.append(start_forked(cmd, cwd=REPO, env=env, stream=True, stderr=stderr))
    return procs


def _stderr(out, rank: int) -> str:
    with open(f"{out}.stderr.{rank}") as f:
        return f.read()[-2000:]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.parametrize("world", [1, 2])
def test_kill_9_while_staging_publishes_nothing_and_resume_takes_the_previous_checkpoint(tmp_path, world):
    steps, stall = 8, 4
    directory, out = tmp_path / "ckpt", tmp_path / "final.pt"
    procs = _start(directory, steps, out, ["--stall-staging-at", str(stall)], world)
    timer = threading.Timer(240, _kill, (procs,))  # a hard bound on the whole stalled run
    timer.start()
    try:
        for rank, proc in enumerate(procs):  # every rank reaches the step that must wait for the copy
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.strip() == f"STAGING {stall}":
                    break
            else:
                raise AssertionError(f"no STAGING {stall}: {''.join(lines)}\n{_stderr(out, rank)}")
        time.sleep(0.2)
    finally:
        timer.cancel()
        _kill(procs)
    assert all(proc.returncode == -signal.SIGKILL for proc in procs)
    names = sorted(os.listdir(directory))
    assert [s for s, _ in complete_checkpoints(directory)[0]] == [2]  # step 4 never became one
    assert read_latest(directory) == step_dir_name(2)
    assert any(n.startswith(f"{step_dir_name(stall)}.partial-") for n in names), names

    procs = _start(directory, steps, out, [], world)
    try:
        results = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        _kill(procs)
    for rank, (proc, stdout) in enumerate(zip(procs, results)):
        assert proc.returncode == 0, _stderr(out, rank)
        assert f"RESUMED {directory / step_dir_name(2)}" in stdout
    assert read_latest(directory) == step_dir_name(steps)
    problems, verified = verify_checkpoint(str(directory / step_dir_name(steps)))
    assert verified and problems == []
    if world == 1:  # the resumed run ends bitwise where an uninterrupted one does
        reference, ref_checkpointer = ckpt_train.build(str(tmp_path / "reference"))
        reference.run(ckpt_train.loader(), max_steps=steps)
        ref_checkpointer.close()
        expected = ckpt_train.final_state(reference)
        got = torch.load(out, weights_only=True)
        assert got.keys() == expected.keys()
        assert [k for k in got if not torch.equal(got[k], expected[k])] == []


# ------------------------------------------------------------------------------ intra-op threads
def _native_only_threads() -> set[int]:
    """This process's OS threads that are not Python threads (OpenMP workers, among others), read
    twice 0.5 s apart: a Python thread that has just ended (joined, gone from
    ``threading.enumerate()``) stays in ``/proc`` for a moment, longer on a loaded machine, and is
    not one of them; an OpenMP worker lives as long as the thread that leads its team."""

    def now() -> set[int]:
        python = {t.native_id for t in threading.enumerate()}
        return {int(tid) for tid in os.listdir("/proc/self/task")} - python

    first = now()
    time.sleep(0.5)
    return first & now()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists OS threads through /proc")
@pytest.mark.parametrize("mode", ["async", "async_copy"])
def test_background_saves_start_no_openmp_team_and_leave_the_training_threads_alone(tmp_path, mode):
    """Training with torch's default of several intra-op threads: a checkpoint thread that ran a
    parallel torch op with that count led an OpenMP team of its own for the rest of the run, and
    GNU OpenMP, counting more threads than cores, then put the training team's worker to sleep and
    woke it at every parallel region: every later step was up to 2.5x slower. The checkpointer's
    threads must work on one intra-op thread, and the training thread keeps its count."""
    torch.set_num_threads(2)  # the autouse fixture restores it
    torch.ones(1 << 20).add_(1)  # the training thread's own team exists before the baseline
    before = {int(tid) for tid in os.listdir("/proc/self/task")}  # every thread, Python's too
    torch.manual_seed(0)
    width = 256  # 65536-element weights: copying them is a parallel op
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), torch.nn.functional.mse_loss)
    checkpointer = AsyncCheckpointer(tmp_path, mode=mode, resume=None).attach(trainer)
    save_every(trainer, 2)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, width, generator=g), torch.randn(4, width, generator=g)) for _ in range(4)]
    trainer.run(batches, max_steps=4)
    assert checkpointer.last_checkpoint is not None and checkpointer.last_checkpoint.endswith("4")
    started = _native_only_threads() - before
    assert not started, f"saving started {len(started)} native thread(s) (an OpenMP team) beside training"
    assert torch.get_num_threads() == 2, "the training thread's intra-op thread count changed"
    checkpointer.close()


def test_a_dcp_writer_on_another_thread_uses_one_intra_op_thread_and_on_its_own_thread_none_changes(
    tmp_path,
):
    """DCP's async_save writes on a thread of its own, which copies views of larger storages."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(2)
    seen: dict[str, int] = {}

    def save(name: str, writer: RecordingWriter) -> None:
        dcp.save({"w": torch.randn(300, 300)}, storage_writer=writer, no_dist=True)
        seen[name] = torch.get_num_threads()

    elsewhere = RecordingWriter(tmp_path / "a")
    thread = threading.Thread(target=save, args=("thread", elsewhere))
    thread.start()
    thread.join(timeout=60)
    save("owner", RecordingWriter(tmp_path / "b"))
    assert seen == {"thread": 1, "owner": 2}
