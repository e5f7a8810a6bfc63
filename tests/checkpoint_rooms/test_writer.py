"""The writer: a save's life (started into a partial directory, staged, durable, published through
the store) in each mode, the staging-wait contract, and every way a save fails: the previous
checkpoint and ``latest`` stay, and nothing half-written is ever published."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hookloop.engine.checkpoint_format.directory import (
    complete_checkpoints,
    is_complete,
    read_json,
    read_latest,
    step_dir_name,
)
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.manifest import read_marker
from hookloop.engine.checkpoint_format.safe_read import SafeReader, verify_checkpoint
from hookloop.handlers.checkpoint import save as save_room
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process
from tests.checkpoint_rooms import fakes

MODES = ("sync", "async_copy", "async")


def steps(directory) -> list[int]:
    return [s for s, _ in complete_checkpoints(directory)[0]]


@pytest.mark.parametrize("mode", MODES)
def test_a_save_is_published_only_once_durable_in_every_mode(tmp_path, sess, mode):
    model, optimizer = fakes.model_and_optimizer()
    waits = fakes.LongWaits()
    w = fakes.writer(tmp_path, mode, sess, long_wait=waits)
    w.start(3, model, optimizer, fakes.rank_state_json(3), {"val_loss": 0.5})
    partial = w.inflight.partial
    assert os.path.basename(partial) == f"{step_dir_name(3)}.partial-{fakes.SESSION_ID}"
    assert not is_complete(partial) and read_latest(tmp_path) is None  # nothing published yet
    if mode == "sync":
        assert not w.pending  # durable when the call returns
    save = w.finish(wait=True)
    assert w.inflight is None and not w.pending
    assert save.final == str(tmp_path / step_dir_name(3)) and read_latest(tmp_path) == step_dir_name(3)
    assert not os.path.exists(partial)
    marker = read_marker(save.final)
    assert marker["mode"] == mode and marker["metrics"] == {"val_loss": 0.5} and marker["finite"] is True
    files = set(marker["manifest"]["files"])
    assert {".metadata", "rank_00000.json"} <= files and any(f.endswith(".distcp") for f in files)
    assert verify_checkpoint(save.final) == ([], True)
    assert read_json(os.path.join(save.final, "rank_00000.json")) == fakes.rank_state_json(3)
    assert save.index_size == os.path.getsize(os.path.join(save.final, ".metadata")) > 0
    assert waits.entered >= 1  # the waits lifted the watchdog


@pytest.mark.parametrize("mode", MODES)
def test_the_checkpoint_holds_the_state_at_the_save(tmp_path, sess, mode):
    """Parameters, optimizer state and buffers as they were when the save started, also when a
    forward (which changes BatchNorm statistics) runs while the save is in flight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    expected = fakes.parameters(model)
    w = fakes.writer(tmp_path, mode, sess)
    gate = None
    if mode == "async":
        gate = w.stager = fakes.GatedStager()
    w.start(1, model, optimizer, fakes.rank_state_json(1), {})
    model(torch.randn(8, 4) * 10)  # the next step's forward: new running statistics
    if gate is not None:
        assert w.staging
        gate.gate.set()
    w.wait_staged()  # the staging-wait contract: after this the optimizer may change parameters
    optimizer.step()
    save = w.finish(wait=True)
    loaded = {f"model.{k}": torch.zeros_like(v) for k, v in expected.items()}
    with quiet_single_process():
        dcp.load(loaded, storage_reader=SafeReader(save.final), no_dist=True)
    differ = [k for k, v in expected.items() if not torch.equal(loaded[f"model.{k}"], v)]
    assert differ == []


def test_async_staging_is_waited_for_and_the_wait_lifts_the_watchdog(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    waits = fakes.LongWaits()
    w = fakes.writer(tmp_path, "async", sess, long_wait=waits)
    stager = w.stager = fakes.GatedStager()
    w.start(2, model, optimizer, fakes.rank_state_json(2), {})  # returns at once: the copy waits
    assert stager.entered.wait(10)
    assert w.staging and w.pending
    seen = {}

    def open_gate() -> None:
        seen["during"] = (waits.active, w.staging)
        stager.gate.set()

    threading.Timer(0.2, open_gate).start()
    start = time.monotonic()
    w.wait_staged()
    assert time.monotonic() - start >= 0.15  # it waited for the gate
    assert seen["during"] == (True, True) and not w.staging
    w.finish(wait=True)
    assert steps(tmp_path) == [2]
    assert w.stager is stager  # reused by the next save
    w.close()
    assert w.stager is None


def test_a_state_json_that_comes_later_is_part_of_the_save(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    w = fakes.writer(tmp_path, "async_copy", sess)
    w.start(5, model, optimizer, None, {})  # the state once the step's handlers ran
    assert w.state_due and w.pending  # not done before the state is written
    w.write_state(fakes.rank_state_json(5))
    assert not w.state_due
    save = w.finish(wait=True)
    assert "rank_00000.json" in read_marker(save.final)["manifest"]["files"]


def test_a_save_whose_state_never_came_fails_and_publishes_nothing(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    fakes.save(tmp_path, 1, model, optimizer)
    w = fakes.writer(tmp_path, "async", sess)
    w.start(2, model, optimizer, None, {})
    w.write_state(None)  # the step failed before its state was captured
    with pytest.raises(CheckpointError, match=r"step 2 .*failed: the step ended before its state"):
        w.finish(wait=True)
    assert read_latest(tmp_path) == step_dir_name(1) and steps(tmp_path) == [1]


def test_a_finite_verdict_goes_into_the_marker(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    w = fakes.writer(tmp_path, "sync", sess)
    w.start(1, model, optimizer, fakes.rank_state_json(1), {})
    save = w.finish(wait=False)
    assert save.finite is False and read_marker(save.final)["finite"] is False


@pytest.mark.parametrize("mode", MODES)
def test_a_save_that_cannot_make_its_directory_fails_naming_it(tmp_path, sess, mode):
    model, optimizer = fakes.model_and_optimizer()
    fakes.save(tmp_path, 1, model, optimizer)
    blocked = tmp_path / f"{step_dir_name(2)}.partial-{fakes.SESSION_ID}"
    blocked.write_text("in the way")
    w = fakes.writer(tmp_path, mode, sess)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint for step 2 .*previous checkpoint"):
        w.start(2, model, optimizer, fakes.rank_state_json(2), {})
    assert w.inflight is None and not w.pending
    assert read_latest(tmp_path) == step_dir_name(1) and steps(tmp_path) == [1]


def test_a_failing_copy_to_host_memory_fails_the_wait_and_the_save(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    fakes.save(tmp_path, 1, model, optimizer)
    w = fakes.writer(tmp_path, "async", sess)
    gate = threading.Event()
    w.stager = fakes.FailingStager(gate)
    w.start(2, model, optimizer, fakes.rank_state_json(2), {})
    threading.Timer(0.1, gate.set).start()  # fails while the optimizer step waits for it
    with pytest.raises(CheckpointError, match="checkpoint staging failed: no host memory"):
        w.wait_staged()
    assert not w.staging
    w.wait_staged()  # nothing in staging any more: the step goes on, the save's owner reports it
    with pytest.raises(CheckpointError, match=r"writing the checkpoint of step 2 .* failed: no host memory"):
        w.finish(wait=True)
    assert read_latest(tmp_path) == step_dir_name(1) and steps(tmp_path) == [1]


def test_a_write_that_is_not_durable_in_time_is_an_error_naming_the_setting(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    w = fakes.writer(tmp_path, "async", sess, wait_timeout_s=0.2)
    stager = w.stager = fakes.GatedStager()
    w.start(1, model, optimizer, fakes.rank_state_json(1), {})
    try:
        with pytest.raises(CheckpointError, match=r"not durable within 0s \(wait_timeout_s\)"):
            w.finish(wait=True)
    finally:
        stager.gate.set()
    sess.close_threads()  # the write finishes; nothing publishes it
    assert read_latest(tmp_path) is None and steps(tmp_path) == []


def test_a_rank_state_larger_than_a_resume_reads_fails_the_save(tmp_path, sess, monkeypatch):
    monkeypatch.setattr(save_room, "MAX_BYTES", 100)
    model, optimizer = fakes.model_and_optimizer()
    w = fakes.writer(tmp_path, "sync", sess)
    with pytest.raises(CheckpointError, match=r"the state of rank 0 takes \d+ bytes, more than the 100"):
        w.start(1, model, optimizer, {"handlers": "x" * 200}, {})


def test_a_publish_the_file_system_refuses_fails_the_save(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    w = fakes.writer(tmp_path, "sync", sess)
    w.start(1, model, optimizer, fakes.rank_state_json(1), {})
    shutil.rmtree(w.inflight.partial)  # the directory vanished under the save
    with pytest.raises(CheckpointError, match=r"publishing the checkpoint of step 1 .* failed"):
        w.finish(wait=False)
    assert read_latest(tmp_path) is None


def test_waiting_locally_publishes_a_single_ranks_durable_save_and_drops_a_failed_one(tmp_path, sess, caplog):
    model, optimizer = fakes.model_and_optimizer()
    w = fakes.writer(tmp_path, "async", sess)
    w.start(1, model, optimizer, fakes.rank_state_json(1), {})
    assert w.wait_local() is True  # no peer to agree with: the owner may publish it
    w.finish(wait=False)
    assert steps(tmp_path) == [1]
    w.stager = fakes.FailingStager()
    w.start(2, model, optimizer, fakes.rank_state_json(2), {})
    with caplog.at_level(logging.ERROR, logger="hookloop.handlers.checkpoint"):
        assert w.wait_local() is False
    assert w.inflight is None and "checkpoint of step 2 failed" in caplog.text
    assert steps(tmp_path) == [1]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("mode", MODES)
def test_a_save_beside_training_writes_large_tensors_past_the_page_cache_a_sync_save_through_it(
    tmp_path, sess, mode, monkeypatch
):
    """The async modes' writer would otherwise take training's CPU to copy the bytes into the page
    cache; a sync save, which training waits for anyway, keeps them cached for a rollback to read."""
    writes = fakes.spy_writes(monkeypatch)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights, 12 with AdamW's moments
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    expected = fakes.parameters(model)
    w = fakes.writer(tmp_path, mode, sess)
    w.start(1, model, optimizer, fakes.rank_state_json(1), {})
    save = w.finish(wait=True)
    assert verify_checkpoint(save.final) == ([], True)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with quiet_single_process():
        dcp.load(loaded, checkpoint_id=save.final, storage_reader=SafeReader(save.final), no_dist=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
    direct = sum(n for n, d, _ in writes if d)
    if mode == "sync":
        assert direct == 0
    else:
        assert direct >= 3 * ((4 << 20) - 8192)  # weights and both moments, but their edge pages
