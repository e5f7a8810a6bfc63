"""An async save written from the live state: untouched, it copies nothing and is staged once
written; frozen at the staging wait, what the writer has not reached is copied (into buffers kept
for the next save), the wait ends only once the tensor being written is done, and what is on disk
is the state at the save, not what training made of it afterwards; the NaN/Inf check reads every
tensor before it can change; a failed copy fails the save without hanging anything; a state with a
tensor that is not a plain CPU tensor is staged first."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hookloop.engine.checkpoint_format import durable_files
from hookloop.engine.checkpoint_format.manifest import RecordingWriter, file_checksum
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process
from hookloop.handlers.checkpoint.host_copy import HostCopy

CHECKED = {"model.w", "model.v", "model.b"}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(512, 1024, generator=g),  # 2 MB: written in one large write
            "v": torch.randn(512, 1024, generator=g),
            "b": torch.randn(3, generator=g),
        },
        "step": seed,
    }


def _start(copy: HostCopy, state: dict, path) -> tuple[Future, Future, RecordingWriter]:
    """Start a live save on a writer thread of its own: (staged, done, writer)."""
    staged: Future = Future()
    live = copy.begin(state, staged)
    assert live is not None
    writer = RecordingWriter(path, checked=CHECKED)
    pool = ThreadPoolExecutor(1)
    done = pool.submit(copy.save, live, {"checkpoint_id": path, "storage_writer": writer, "no_dist": True})
    pool.shutdown(wait=False)
    return staged, done, writer


def _load(path) -> dict:
    model = {"w": torch.zeros(512, 1024), "v": torch.zeros(512, 1024), "b": torch.zeros(3)}
    out = {"model": model, "step": 0}
    with quiet_single_process():
        dcp.load(out, storage_reader=SafeReader(path), no_dist=True)
    return out


def _hold_large_writes(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The writer stops in its first large write (a live tensor) until ``go``; ``inside`` once there."""
    inside, go = threading.Event(), threading.Event()
    original = durable_files._ChecksummingFile._write_large

    def held(stream, view):
        if not go.is_set():
            inside.set()
            assert go.wait(timeout=30)
        original(stream, view)

    monkeypatch.setattr(durable_files._ChecksummingFile, "_write_large", held)
    return inside, go


def test_a_save_nobody_freezes_copies_nothing_and_is_staged_once_written(tmp_path):
    copy = HostCopy()
    state = _state(1)
    staged, done, writer = _start(copy, state, tmp_path / "a")
    done.result(timeout=60)
    assert staged.result(timeout=0) is None
    assert copy._buffers == {}  # no host memory taken
    loaded = _load(tmp_path / "a")
    assert all(torch.equal(loaded["model"][k], state["model"][k]) for k in "wvb") and loaded["step"] == 1
    assert writer.finite is True
    for name, entry in writer.entries.items():
        assert (entry["size"], entry["checksum"]) == file_checksum(tmp_path / "a" / name)


def test_a_freeze_mid_write_keeps_the_state_of_the_save_and_waits_for_the_live_tensor(tmp_path, monkeypatch):
    inside, go = _hold_large_writes(monkeypatch)
    copy = HostCopy()
    state = _state(2)
    expected = {k: t.clone() for k, t in state["model"].items()}
    staged, done, writer = _start(copy, state, tmp_path / "b")
    assert inside.wait(timeout=30)  # the writer is in the middle of a live tensor
    timer = threading.Timer(0.3, go.set)
    timer.start()
    copy.freeze(timeout=30)  # copies the rest, returns once the live tensor is written
    assert go.is_set() and staged.result(timeout=0) is None
    assert len(copy._buffers) >= 1  # the other large tensor (at least) was copied
    for tensor in state["model"].values():  # what training does at the optimizer step
        tensor.fill_(float("nan"))
    done.result(timeout=60)
    loaded = _load(tmp_path / "b")
    assert all(torch.equal(loaded["model"][k], expected[k]) for k in "wvb")
    assert writer.finite is True  # every tensor was checked before training changed it

    buffers = dict(copy._buffers)  # the next save copies into the same buffers
    go.clear()
    inside.clear()
    state = _state(3)
    staged, done, _ = _start(copy, state, tmp_path / "c")
    assert inside.wait(timeout=30)
    threading.Timer(0.3, go.set).start()
    copy.freeze(timeout=30)
    done.result(timeout=60)
    assert any(copy._buffers[path] is buffer for path, buffer in buffers.items())
    copy.close()


def test_a_nan_is_found_in_a_live_tensor_and_in_a_copied_one(tmp_path, monkeypatch):
    copy = HostCopy()
    state = _state(4)
    state["model"]["b"][1] = float("inf")
    _, done, writer = _start(copy, state, tmp_path / "d")
    done.result(timeout=60)
    assert writer.finite is False

    inside, go = _hold_large_writes(monkeypatch)
    state = _state(5)
    state["model"]["w"][3, 3] = float("nan")
    state["model"]["v"][3, 3] = float("nan")  # whichever the writer takes live, the other is copied
    _, done, writer = _start(copy, state, tmp_path / "e")
    assert inside.wait(timeout=30)
    threading.Timer(0.3, go.set).start()
    copy.freeze(timeout=30)
    done.result(timeout=60)
    assert len(copy._buffers) >= 1 and writer.finite is False
    copy.close()


def test_a_failed_copy_fails_the_save_and_the_wait_without_hanging(tmp_path, monkeypatch):
    inside, go = _hold_large_writes(monkeypatch)
    copy = HostCopy()
    staged, done, _ = _start(copy, _state(6), tmp_path / "f")
    assert inside.wait(timeout=30)

    def no_memory(*_args, **_kwargs):
        raise MemoryError("no host memory for the copy")

    monkeypatch.setattr(torch, "empty_like", no_memory)
    go.set()
    with pytest.raises(MemoryError):
        copy.freeze(timeout=30)
    assert isinstance(staged.exception(timeout=0), MemoryError)
    with pytest.raises(CheckpointException) as failed:  # the writer stops at the failed tensor
        done.result(timeout=60)
    assert "the host copy of the state failed" in str(failed.value)
    copy.close()


def test_a_state_with_a_tensor_that_is_not_plain_is_not_written_live():
    copy = HostCopy()
    state = _state(7)
    state["model"]["b"] = torch.zeros(3, device="meta")
    assert copy.begin(state, Future()) is None
    copy.freeze(timeout=1)  # nothing in flight: nothing to do


def test_tensors_another_rank_writes_are_never_copied():
    copy = HostCopy()
    state = _state(8)
    staged: Future = Future()
    assert copy.begin(state, staged) is not None
    live = copy._live
    live.only({id(state["model"]["w"])})  # DCP planned only "w" for this rank (the rest deduplicated)
    copy.freeze(timeout=1)  # the optimizer step comes before the writer started
    assert list(copy._buffers) == [("model", "w")] and staged.result(timeout=0) is None
    copy.close()
