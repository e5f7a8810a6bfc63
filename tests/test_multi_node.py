"""Two simulated nodes on this machine: ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend
c10d`` started twice, each launcher its own node of one rendezvous, running ``-m hookloop train``.
What a job script relies on: a stop signal to one node stops every rank after the same step with a
complete checkpoint and 75 in ``exit_status.json``, the next launch of both nodes resumes at that
step, and a node whose workers are killed ends the other node's workers with 77 (recorded even when
the lost node held rank 0) within the health check's bound instead of a hang."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.dist_utils import TorchrunNodes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HARD_TIMEOUT_S = 150  # a whole launch: rendezvous, start-up of 4 workers on 2 cores, training


def _args(root: Path, *extra: str) -> list[str]:
    """A tiny model on the example config; 4 ranks of 8 samples make a global batch of 32."""
    return [
        "train", "examples/configs/gpt_tiny.yaml", f"train.run_dir={root / 'run'}",
        f"data.cache_dir={root / 'data'}", "model.d_model=32", "model.n_layers=1", "train.seq_len=32",
        "step_scheduler.global_batch_size=32", "lr.warmup_steps=0", "lr.decay_steps=100000",
        "step_scheduler.val_every_steps=1000", "logging.log_interval=1", "logging.console=false",
        *extra,
    ]  # fmt: skip


def _launch(root: Path, name: str, *extra: str) -> TorchrunNodes:
    return TorchrunNodes("hookloop", 2, 2, _args(root, *extra), log_dir=root / name, module=True)


def _await_steps(nodes: TorchrunNodes, metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        if time.monotonic() > deadline or any(p.poll() is not None for p in nodes.procs):
            raise AssertionError(f"no training on both nodes\n{nodes.output()}")
        time.sleep(0.2)


def _worker_codes(err: str) -> list[int]:
    """The exit codes torchrun's failure report gives for this node's workers."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", err)]


def _status(root: Path) -> dict:
    return json.loads((root / "run" / "exit_status.json").read_text())


def _written_since(status: dict, started: float) -> bool:
    """Whether exit_status.json was written at or after ``started`` (its time is to the second)."""
    return datetime.datetime.fromisoformat(status["time"]).timestamp() >= int(started)


def _complete(root: Path) -> list[int]:
    from hookloop.engine.checkpoint_io import complete_checkpoints

    return [step for step, _ in complete_checkpoints(root / "run" / "checkpoints")[0]]


@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_sigterm_on_one_node_stops_both_with_75_and_the_next_launch_resumes(tmp_path, target):
    """SIGTERM to node 1's torchrun (what Slurm sends before the time limit) or to one worker of
    node 1: all 4 ranks stop after the same step with a final checkpoint; both launchers exit 1 (a
    worker exited non-zero) and exit_status.json says 75; a second launch of both nodes resumes at
    that step and finishes."""
    started = time.time()
    with _launch(tmp_path, "first", "step_scheduler.max_steps=100000", "step_scheduler.ckpt_every_steps=1000") as nodes:
        _await_steps(nodes, tmp_path / "run" / "metrics.jsonl", 3)
        if target == "launcher":
            os.kill(nodes.procs[1].pid, signal.SIGTERM)
        else:
            os.kill(nodes.workers(1)[0], signal.SIGTERM)
        codes = nodes.wait(HARD_TIMEOUT_S)
        report = nodes.output()
        workers_seen = _worker_codes(nodes.err(0)) + (_worker_codes(nodes.err(1)) if target == "worker" else [])
    assert codes == [1, 1], report
    # torchrun reports its workers' codes unless it was signalled itself: 2 or 4 workers, all 75
    assert workers_seen and set(workers_seen) == {75}, report
    status = _status(tmp_path)
    assert status["code"] == 75 and status["meaning"] == "STOPPED", status
    assert "SIGTERM" in status["reason"] and _written_since(status, started), status
    step = status["step"]
    assert step >= 3 and Path(status["checkpoint"]).name == f"step_{step:08d}", status
    assert _complete(tmp_path)[0] == step  # the final checkpoint is the newest complete one
    assert len(list(Path(status["checkpoint"]).glob("rank_*.json"))) == 4  # every rank's state

    with _launch(tmp_path, "second", f"step_scheduler.max_steps={step + 2}") as nodes:
        codes = nodes.wait(HARD_TIMEOUT_S)
        report = nodes.output()
    assert codes == [0, 0], report
    assert f"resuming from {status['checkpoint']} (step {step})" in report, report
    resumed = _status(tmp_path)
    assert resumed["code"] == 0 and resumed["step"] == step + 2, resumed
    logged = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-3:] == [step, step + 1, step + 2], logged  # no step trained twice or skipped


@pytest.mark.parametrize("lost", ["rank 0", "no rank 0"])
def test_a_node_whose_workers_are_killed_ends_the_other_nodes_workers_with_77(tmp_path, lost):
    """SIGKILL both workers of one node: the launcher of that node exits 1, the other node's workers
    end with 77 within seconds (the gloo connection breaks; the health check bounds a silent loss),
    and exit_status.json records 77 even when the lost node held rank 0, the usual writer."""
    started = time.time()
    extra = ["step_scheduler.max_steps=100000", "step_scheduler.ckpt_every_steps=1000", "health.enabled=true",
             "health.every_steps=1", "health.timeout_s=5", "distributed.hang_timeout_s=30"]  # fmt: skip
    with _launch(tmp_path, "run", *extra) as nodes:
        _await_steps(nodes, tmp_path / "run" / "metrics.jsonl", 3)
        holds_rank0 = 0 if 0 in nodes.ranks(0) else 1
        lost = holds_rank0 if lost == "rank 0" else 1 - holds_rank0
        killed = time.monotonic()
        for pid in nodes.workers(lost):
            os.kill(pid, signal.SIGKILL)
        survivor = nodes.procs[1 - lost]
        survivor.wait(timeout=HARD_TIMEOUT_S)
        seconds = time.monotonic() - killed
        codes = nodes.wait(HARD_TIMEOUT_S)
        report = nodes.output()
        survivors = _worker_codes(nodes.err(1 - lost))
    assert codes == [1, 1], report
    assert survivors and set(survivors) == {77}, report
    assert seconds < 60, seconds  # the bound: health.timeout_s and the watchdog, not a 10-minute hang
    status = _status(tmp_path)
    assert status["code"] == 77 and status["meaning"] == "HEALTH_CHECK_FAILED", status
    assert _written_since(status, started), (status, started)  # by this run, not left from before
    # a requeued job resumes from the checkpoint the record names: a complete one
    assert status["checkpoint"] is not None and int(Path(status["checkpoint"]).name[5:]) in _complete(tmp_path)
