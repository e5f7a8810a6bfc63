"""The host copy of an async save, written while it is made: from the second save on, each tensor
is written once copied, what is written is the state when the save started (not what training
made of it once staged), the NaN/Inf check sees the copy, and a failed copy fails the save only
once its write has stopped."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hookloop.engine.checkpoint_format.manifest import RecordingWriter, file_checksum
from hookloop.handlers.checkpoint import host_copy
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process
from hookloop.handlers.checkpoint.host_copy import HostCopy


def _clone_stage(state):
    return {k: ({n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in state.items()}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(3, generator=g)},
        "step": seed,
    }


def _save(copy: HostCopy, state: dict, path, checked=()) -> tuple[Future, RecordingWriter]:
    staged: Future = Future()
    writer = RecordingWriter(path, checked=checked)
    copy.save(state, staged, _clone_stage, {"checkpoint_id": path, "storage_writer": writer, "no_dist": True})
    return staged, writer


def _load(path) -> dict:
    out = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(3)}, "step": 0}
    with quiet_single_process():
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def test_the_second_save_writes_while_it_copies_into_the_first_saves_buffers(tmp_path, monkeypatch):
    copy = HostCopy()
    planners = []
    original = host_copy._save
    monkeypatch.setattr(host_copy, "_save", lambda h, p, k: (planners.append(p), original(h, p, k)))
    try:
        first = _state(1)
        staged, _ = _save(copy, first, tmp_path / "a")
        assert staged.result(timeout=0) is None and planners == []  # copied first, then written
        buffers = dict(copy._buffers)
        second = _state(2)
        staged, writer = _save(copy, second, tmp_path / "b", checked={"model.w", "model.b"})
        assert staged.done() and len(planners) == 1  # overlapped, into the same buffers
        assert all(copy._buffers[path] is buffer for path, buffer in buffers.items())
    finally:
        copy.close()
    loaded = _load(tmp_path / "b")
    assert torch.equal(loaded["model"]["w"], second["model"]["w"]) and loaded["step"] == 2
    assert writer.finite is True
    for name, entry in writer.entries.items():
        assert (entry["size"], entry["checksum"]) == file_checksum(tmp_path / "b" / name)


def test_what_is_written_is_the_state_at_the_save_not_what_training_made_of_it(tmp_path, monkeypatch):
    copy = HostCopy()
    try:
        _save(copy, _state(1), tmp_path / "a")
        state = _state(2)
        expected = state["model"]["w"].clone()
        release = threading.Event()
        original = host_copy._WaitingPlanner.resolve_data

        def slow_write(self, item):  # the write lags behind the copy and training
            release.wait(timeout=30)
            return original(self, item)

        monkeypatch.setattr(host_copy._WaitingPlanner, "resolve_data", slow_write)
        staged: Future = Future()
        staged.add_done_callback(lambda _f: (state["model"]["w"].fill_(float("nan")), release.set()))
        writer = RecordingWriter(tmp_path / "b", checked={"model.w"})
        kwargs = {"checkpoint_id": tmp_path / "b", "storage_writer": writer, "no_dist": True}
        copy.save(state, staged, _clone_stage, kwargs)
    finally:
        copy.close()
    assert torch.equal(_load(tmp_path / "b")["model"]["w"], expected)
    assert writer.finite is True  # the check read the copy, not the state training changed


def test_a_nan_in_the_second_save_is_found(tmp_path):
    copy = HostCopy()
    try:
        _save(copy, _state(1), tmp_path / "a")
        state = _state(2)
        state["model"]["w"][7, 7] = float("inf")
        _, writer = _save(copy, state, tmp_path / "b", checked={"model.w"})
    finally:
        copy.close()
    assert writer.finite is False


class _NoMemory(torch.Tensor):
    """A host buffer whose copy fails, as one running out of memory would."""

    def copy_(self, *args, **kwargs):
        raise MemoryError("no host memory for the copy")


def test_a_failed_copy_fails_the_save_once_its_write_stopped(tmp_path, monkeypatch):
    copy = HostCopy()
    ends = []
    original = host_copy._save
    monkeypatch.setattr(host_copy, "_save", lambda h, p, k: (original(h, p, k), ends.append("written")))
    try:
        _save(copy, _state(1), tmp_path / "a")
        copy._buffers[("model", "w")] = copy._buffers[("model", "w")].as_subclass(_NoMemory)
        staged: Future = Future()
        writer = RecordingWriter(tmp_path / "b")
        kwargs = {"checkpoint_id": tmp_path / "b", "storage_writer": writer, "no_dist": True}
        with pytest.raises(MemoryError):
            copy.save(_state(2), staged, _clone_stage, kwargs)
        assert isinstance(staged.exception(timeout=0), MemoryError)
        assert ends == ["written"]  # the write ended before the save failed
        assert copy._buffers == {}  # the next save copies first again
    finally:
        copy.close()


def test_a_state_with_a_tensor_that_is_not_plain_is_staged_first(tmp_path):
    class Marked(torch.Tensor):
        pass

    copy = HostCopy()
    stages = []

    def stage(state):
        stages.append(1)
        model = {n: t.as_subclass(torch.Tensor).clone() for n, t in state["model"].items()}
        return {**state, "model": model}

    try:
        for i in range(2):
            state = _state(i)
            state["model"]["b"] = state["model"]["b"].as_subclass(Marked)
            staged: Future = Future()
            writer = RecordingWriter(tmp_path / str(i))
            copy.save(
                state,
                staged,
                stage,
                {"checkpoint_id": tmp_path / str(i), "storage_writer": writer, "no_dist": True},
            )
    finally:
        copy.close()
    assert stages == [1, 1]
