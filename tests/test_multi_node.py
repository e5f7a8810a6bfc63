"""Two simulated nodes on this machine: ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend
c10d`` started twice, each launcher its own node of one rendezvous, running ``-m hookloop train``.
What a job script relies on: a stop signal to one node stops every rank after the same step with a
complete checkpoint and 75 in ``exit_status.json``, the next launch of both nodes resumes at that
step, and a node whose workers are killed ends the other node's workers with 77 (recorded even when
the lost node held rank 0) within the health check's bound instead of a hang. Files that workers
of several nodes write side by side in a shared directory do not collide when two of them have the
same pid (separate pid namespaces, as in containers, hand out the same small pids on every node)."""

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
    from hookloop.engine.checkpoint_format.directory import complete_checkpoints

    return [step for step, _ in complete_checkpoints(root / "run" / "checkpoints")[0]]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_sigterm_on_one_node_stops_both_with_75_and_the_next_launch_resumes(tmp_path, target):
    """SIGTERM to node 1's torchrun (what Slurm sends before the time limit) or to one worker of
    node 1: all 4 ranks stop after the same step with a final checkpoint; both launchers exit 1 (a
    worker exited non-zero) and exit_status.json says 75; a second launch of both nodes resumes at
    that step and finishes."""
    started = time.time()
    endless = ("step_scheduler.max_steps=100000", "step_scheduler.ckpt_every_steps=1000")
    with _launch(tmp_path, "first", *endless) as nodes:
        _await_steps(nodes, tmp_path / "run" / "metrics.jsonl", 3)
        if target == "launcher":
            os.kill(nodes.procs[1].pid, signal.SIGTERM)
        else:
            os.kill(nodes.workers(1)[0], signal.SIGTERM)
        codes = nodes.wait(HARD_TIMEOUT_S)
        report = nodes.output()
        both_logs = nodes.err(0) + nodes.err(1)
        workers_seen = _worker_codes(nodes.err(0))
        if target == "worker":
            workers_seen += _worker_codes(nodes.err(1))
    assert codes == [1, 1], report
    # the start-up summary and the stop are logged by rank 0 only, wherever it runs
    assert both_logs.count("[hookloop] run directory:") == 1, report
    assert both_logs.count("stopping after step") == 1, report
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
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in metrics]
    assert logged[-3:] == [step, step + 1, step + 2], logged  # no step trained twice or skipped


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("lost", ["rank 0", "no rank 0"])
def test_a_node_whose_workers_are_killed_ends_the_other_nodes_workers_with_77(tmp_path, lost):
    """SIGKILL both workers of one node: the launcher of that node exits 1, the other node's workers
    end with 77 within seconds (the gloo connection breaks; the health check bounds a silent loss),
    and exit_status.json records 77 even when the lost node held rank 0, the usual writer."""
    started = time.time()
    extra = ["step_scheduler.max_steps=100000", "step_scheduler.ckpt_every_steps=1000", "health.enabled=true",
             "health.every_steps=1", "health.timeout_s=5", "distributed.hang_timeout_s=30"]  # fmt: skip
    with _launch(tmp_path, "run", *extra) as nodes:
        metrics = tmp_path / "run" / "metrics.jsonl"
        _await_steps(nodes, metrics, 3)
        deadline = time.monotonic() + HARD_TIMEOUT_S
        while not (tmp_path / "run" / "checkpoints").is_dir() or not _complete(tmp_path):
            assert time.monotonic() < deadline, f"no complete checkpoint\n{nodes.output()}"
            time.sleep(0.2)  # the start's save is durable (on a loaded machine it can trail step 3)
        _await_steps(nodes, metrics, len(metrics.read_text().splitlines()) + 2)  # and known as such
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
    assert status["checkpoint"] is not None
    assert int(Path(status["checkpoint"]).name[5:]) in _complete(tmp_path)


# ---------------------------------------------------------- the same pid on two nodes, one shared dir
def _same_pid_at_once(monkeypatch, work, rounds: int = 300) -> list[BaseException]:
    """Run ``work()`` ``rounds`` times in each of two threads at once, both seeing the same pid: two
    workers on two nodes writing into one shared directory. Returns what they raised."""
    import threading

    monkeypatch.setattr(os, "getpid", lambda: 4242)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def loop() -> None:
        start.wait()
        for _ in range(rounds):
            try:
                work()
            except BaseException as e:  # noqa: BLE001 -- reported by the test
                errors.append(e)
                return

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def test_startup_checks_of_two_nodes_with_the_same_pid_do_not_collide(tmp_path, monkeypatch):
    """Every rank checks the run and data directories before the process group exists; two of them
    with one pid on two nodes must not refuse a good shared directory (exit 2 for nothing)."""
    from hookloop.engine.files import check_writable_dir

    (tmp_path / "run").mkdir()
    errors = _same_pid_at_once(
        monkeypatch,
        lambda: (check_writable_dir("train.run_dir", str(tmp_path / "run")),
                 check_writable_dir("data.cache_dir", str(tmp_path / "cache"))),
    )  # fmt: skip
    assert not errors, errors[0]
    assert not (tmp_path / "cache").exists()  # checked, not created
    assert os.listdir(tmp_path / "run") == []  # no probe left behind


def test_exit_status_written_by_two_nodes_with_the_same_pid_stays_whole(tmp_path, monkeypatch):
    """On a lost node the first worker of every other node records 77: the writes race, and each
    must still leave one whole file."""
    from hookloop.engine.exit_status import read_exit_status, write_exit_status

    errors = _same_pid_at_once(
        monkeypatch, lambda: write_exit_status(tmp_path, code=77, reason="peer lost", step=3), rounds=200
    )
    assert not errors, errors[0]
    assert read_exit_status(tmp_path)["code"] == 77
    assert [p.name for p in tmp_path.iterdir()] == ["exit_status.json"]


def test_a_corpus_tokenized_by_two_nodes_with_the_same_pid_into_one_cache_is_whole(tmp_path, monkeypatch):
    """Every rank that finds a built-in corpus missing from ``data.cache_dir`` tokenizes it; a cache
    shared by two nodes gets two writers at once."""
    from hookloop.engine.data.prepare import prepare_tokens

    text = "a shared cache on two nodes " * 2000
    out = tmp_path / "docs.u8"

    def prepare() -> None:
        prepare_tokens([text], out)
        assert out.stat().st_size == len(text)

    errors = _same_pid_at_once(monkeypatch, prepare, rounds=100)
    assert not errors, errors[0]
    assert out.read_bytes() == text.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.u8", "docs.u8.json"]


# ---------------------------------------------------------------- who records a lost peer's 77
@pytest.mark.parametrize(
    ("local_rank", "rank0_recorded", "expected"),
    [
        ("0", False, 77),  # the first worker of a node: rank 0 may be on the node that was lost
        ("0", True, 1),  # rank 0 recorded the run's end (the crash that took it down): left alone
        ("1", False, None),  # other workers of the node: one record per node is enough
    ],
)
def test_who_records_a_lost_peer_on_a_rank_other_than_0(
    tmp_path, monkeypatch, local_rank, rank0_recorded, expected
):
    """Rank 2 of a run (the first worker of the second node when LOCAL_RANK is 0) loses a peer at
    step 3: what exit_status.json then holds."""
    import torch

    from hookloop import Events, Trainer
    from hookloop.engine import parallel
    from hookloop.engine.errors import PeerFailure
    from hookloop.engine.exit_status import read_exit_status, write_exit_status

    monkeypatch.setattr(parallel, "rank", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    write_exit_status(tmp_path, code=75, reason="the previous job's stop", step=0)  # older than the run
    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                      run_dir=tmp_path, hang_timeout_s=None)  # fmt: skip

    @trainer.on(Events.STEP_START(once=3))
    def lose_a_peer(engine) -> None:
        if rank0_recorded:
            write_exit_status(tmp_path, code=1, reason="RuntimeError: rank 0 crashed", step=3)
        raise PeerFailure("a collective failed because a peer is gone")

    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(8)]
    with pytest.raises(PeerFailure):
        trainer.run(data, max_steps=6)
    status = read_exit_status(tmp_path)
    if expected is None:
        assert status["code"] == 75 and status["step"] == 0  # untouched
    else:
        assert status["code"] == expected and status["step"] == 3, status
