"""Publishing an async save off the training thread (docs/checkpoint.md, "Publishing on the writer
thread"): a SIGKILL at the worst moment of it never leaves ``latest`` at an incomplete checkpoint,
a hold that comes after the files are written keeps the save unpublished, and every rank publishes
the same saves at the same steps."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time

import pytest
import torch

from hookloop.engine import Events, Trainer
from hookloop.engine.checkpoint_format.directory import (
    complete_checkpoints,
    is_complete,
    read_latest,
    step_dir_name,
)
from hookloop.engine.checkpoint_format.manifest import file_checksum, read_manifest
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import REPO, run_distributed, run_process
from tests.forked import start_forked
from tests.scripts import ckpt_train


def assert_intact(path: str) -> None:
    """``path`` is a complete checkpoint whose every file matches its manifest."""
    assert is_complete(path), path
    manifest = read_manifest(path)
    assert manifest, path
    for name, entry in manifest.items():
        size, crc = file_checksum(os.path.join(path, name))
        assert (size, crc) == (entry["size"], entry["checksum"]), (path, name)


@pytest.mark.parametrize("where", ["marker", "rename"])
def test_sigkill_while_the_writer_thread_publishes_never_moves_latest_to_an_incomplete_checkpoint(
    tmp_path, where
):
    """The save of step 10 stops for good while the writer thread publishes it (its marker written;
    or renamed to step_N, ``latest`` not moved yet); training goes on meanwhile (publishing is off
    its thread), then the process is killed. ``latest`` names an intact checkpoint, and the rerun
    resumes from the newest complete one and ends equal to the uninterrupted run."""
    # saves at 5 and 10 only; the script waits at each save's step until its files are durable (a
    # loaded machine may starve the writer), so step 11's end releases step 10's to the writer thread
    steps, saves = 120, (5, 10)  # the writer thread, at nice 19, may start publishing many steps later
    reference, ref_checkpointer = ckpt_train.build(str(tmp_path / "reference"), save_steps=saves)
    reference.run(ckpt_train.loader(), max_steps=steps)
    ref_checkpointer.close()
    expected = ckpt_train.final_state(reference)

    directory, out = tmp_path / "ckpt", tmp_path / "final.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tests/scripts/ckpt_train.py"), str(directory), str(steps), str(out)]
    cmd += ["--save-steps", ",".join(map(str, saves))]
    proc = start_forked([*cmd, "--stall-publish", f"10:{where}"], cwd=REPO, env=env, stream=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    publishing, last_step, went_on = None, 0, False
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and not went_on:
            try:
                word, _, rest = lines.get(timeout=1).partition(" ")
            except queue.Empty:
                assert proc.poll() is None, "the run ended before its publishing stalled"
                continue
            if word == "STEP":
                last_step = int(rest)
            elif word == "PUBLISHING":
                publishing = (rest.split(), last_step)
            elif word == "STEP_START" and publishing is not None:
                went_on = int(rest) >= publishing[1] + 2  # a whole step ran after the stall began
        assert publishing is not None, "publishing step 10 never started"
        step, stalled_at, thread = publishing[0]
        assert (step, stalled_at) == ("10", where)
        assert thread.startswith("hookloop-checkpoint-write"), thread  # not the training thread
        assert went_on, "training did not go on while the save was being published"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    latest = read_latest(directory)
    assert latest == step_dir_name(5)  # never moved to the save being published
    assert_intact(str(directory / latest))
    for _, path in complete_checkpoints(directory)[0]:
        assert_intact(path)
    assert (directory / step_dir_name(10)).exists() == (where == "rename")

    result = run_process(cmd, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("RESUMED ")]
    newest = 10 if where == "rename" else 5  # renamed: complete, and verified on load
    assert resumed == [str(directory / step_dir_name(newest))]
    got = torch.load(out, weights_only=True)
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []


def _trainer(seed: int = 0) -> Trainer:
    model = tiny_gpt(seed)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


def test_a_hold_after_the_files_are_written_keeps_the_save_unpublished(tmp_path, monkeypatch):
    """The save of step 2 is released (every write durable, nothing held) and the writer thread has
    written its marker; a judge then holds saves before it is renamed: it stays unpublished while
    the hold lasts, training goes on, and it is published once the judge releases."""
    from hookloop.handlers.checkpoint import store

    at_marker, go = threading.Event(), threading.Event()
    original = store.write_json_atomic

    def marker_then_wait(path, obj):
        original(path, obj)
        if step_dir_name(2) in str(path) and threading.current_thread() is not threading.main_thread():
            at_marker.set()
            assert go.wait(60), "the test never let publishing go on"

    monkeypatch.setattr(store, "write_json_atomic", marker_then_wait)
    trainer = _trainer()
    checkpointer = AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    policy = trainer.save_policy
    seen, saved = [], []
    trainer.add_event_handler(Events.CHECKPOINT_SAVED, lambda _e, step=None, path=None: saved.append(step))

    @trainer.on(Events.STEP_START)
    def _saves(engine):  # step 2's save alone is in flight until the last step's
        if engine.state.step == 2:
            engine.control.request_save("test")
        if engine.state.step == 3:  # durable before this step's agreement: released at its end
            checkpointer._writer.inflight.done.result(timeout=120)

    @trainer.on(Events.STEP_END, priority=-100)
    def _judge(engine):
        step = engine.state.step
        if not seen and checkpointer._writer.released:  # released at this step's end
            assert at_marker.wait(30)  # the writer thread wrote the marker and waits before the rename
            policy.hold_saves("judge")
            go.set()
            seen.append(("held", step))
        elif len(seen) == 1 and step >= seen[0][1] + 3:  # the deferred publishing is long over
            done = [s for s, _ in complete_checkpoints(tmp_path)[0]]
            seen.append(("still held", step, read_latest(tmp_path), checkpointer.saving, done, list(saved)))
            policy.release_saves("judge")

    trainer.run(token_batches(16), max_steps=12)
    checkpointer.close()
    assert seen[0] == ("held", 3), seen
    assert seen[1][1:] == (seen[0][1] + 3, None, True, [], []), seen  # nothing of step 2 visible
    assert saved == [2, 12] and read_latest(tmp_path) == step_dir_name(12)  # published once released
    assert_intact(str(tmp_path / step_dir_name(2)))


def _publish_worker(rank: int, world: int, directory: str) -> dict:
    """Saves at steps 2, 6 and 12; rank 1 writes its state file late. The step after a save waits
    until this rank's files are durable (its agreement lets its end release the save to the writer
    threads), the next one (steps 4, 14) until they published it. Both ranks hold saves at steps 8-9
    as a judge would (the same steps on every rank), while step 6's save may still be publishing.
    What each rank saw published, and at which of its steps."""
    import hookloop.handlers.checkpoint.writer as writer_module
    from hookloop.engine.parallel import init_distributed, wrap_data_parallel

    init_distributed()
    if rank == 1:
        original = writer_module.write_rank_file

        def late(*args):
            time.sleep(0.3)
            return original(*args)

        writer_module.write_rank_file = late
    torch.manual_seed(0)
    model = wrap_data_parallel(tiny_gpt(0), "ddp")
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)
    checkpointer = AsyncCheckpointer(directory, mode="async", keep_last=5).attach(trainer)
    published = []
    trainer.add_event_handler(
        Events.CHECKPOINT_SAVED,
        lambda e, step=None, path=None: published.append((step, e.state.iteration, path)),
    )

    @trainer.on(Events.STEP_START)
    def _cadence(engine):
        step = engine.state.step
        if step in (2, 6, 12):
            engine.control.request_save("test")
        if step in (3, 7, 13):  # durable here: this step's agreement says so, its end releases it
            checkpointer._writer.inflight.done.result(timeout=120)
        if step in (4, 14):  # published by the writer threads: this step's end announces it
            checkpointer._writer._publishing.result(timeout=120)
        if step == 8:  # step 6's save is being published, or is already
            engine.save_policy.hold_saves("judge")
        if step == 10:
            engine.save_policy.release_saves("judge")

    trainer.run(token_batches(8, seed=10 + rank), max_steps=16)
    checkpointer.close()
    return {"published": published, "latest": read_latest(directory)}


def test_every_rank_publishes_the_same_saves_at_the_same_steps(tmp_path):
    """Published on the writer threads, each save is announced (CHECKPOINT_SAVED) at the same step
    on every rank, a hold included; rank 0 alone moves ``latest``, to intact checkpoints only."""
    results = run_distributed(_publish_worker, 2, str(tmp_path), timeout=180)
    assert results[0]["published"] == results[1]["published"], results
    published = [(step, at) for step, at, _ in results[0]["published"]]
    assert [step for step, _ in published] == [2, 6, 12, 16]  # the hold lost nothing
    assert published[0][1] == 4 and published[2][1] == 14, published  # not by the next save's drain
    assert results[0]["latest"] == results[1]["latest"] == step_dir_name(16)
    for _, path in complete_checkpoints(tmp_path)[0]:
        assert_intact(path)
