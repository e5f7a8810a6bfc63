"""The run directory's lock in one process: who counts as a live holder, and what a refusal leaves.

A holder on another host is planted as its lock file would be (no kernel lock is held then, as
when the file system does not share ``flock`` across nodes): only its heartbeat, the file's
modification time, tells a live node from a dead one."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from hookloop.engine.run_lock import LOCK_FILE, STALE_AFTER_S, Holder, RunDirInUse, RunDirLock, read_holder


def plant(directory: Path, age_s: float = 0.0, **fields) -> bytes:
    """A lock file naming a holder on another host whose last heartbeat was ``age_s`` ago."""
    holder = replace(Holder.of_this_process(), host="node-elsewhere", pid=4242, **fields)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    path.write_text(json.dumps(asdict(holder)))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path.read_bytes()


def test_a_live_holder_on_another_host_refuses_the_start_and_keeps_its_file(tmp_path):
    raw = plant(tmp_path, age_s=5)
    lock = RunDirLock(tmp_path)
    with pytest.raises(RunDirInUse) as refused:
        lock.acquire()
    message = str(refused.value)
    assert message.startswith("train.run_dir: ") and "host node-elsewhere, pid 4242, started " in message
    assert (tmp_path / LOCK_FILE).read_bytes() == raw and not lock.held
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # no probe left behind


def test_a_dead_nodes_lock_is_taken_over_once_its_heartbeat_is_stale(tmp_path):
    plant(tmp_path, age_s=STALE_AFTER_S + 5)
    with RunDirLock(tmp_path) as lock:
        assert lock.held and read_holder(tmp_path) == lock.holder
        assert lock.holder.host == socket.gethostname() and lock.holder.pid == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()  # released: the file goes


def test_an_earlier_attempt_of_the_same_torchrun_launch_is_dead(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-17")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    plant(tmp_path, age_s=1, launch="job-17", attempt=0)  # fresh, but torchrun stopped it
    with RunDirLock(tmp_path) as lock:
        assert lock.held and lock.holder.attempt == 1
    plant(tmp_path, age_s=1, launch="job-18", attempt=0)  # another launch: alive
    with pytest.raises(RunDirInUse):
        RunDirLock(tmp_path).acquire()


def test_a_dead_process_on_this_host_never_blocks(tmp_path):
    plant(tmp_path, age_s=1)
    raw = json.loads((tmp_path / LOCK_FILE).read_text())
    (tmp_path / LOCK_FILE).write_text(json.dumps({**raw, "host": socket.gethostname(), "pid": 2**22 + 7}))
    with RunDirLock(tmp_path) as lock:
        assert lock.held


def test_one_process_holds_a_directory_once_and_a_refusal_creates_nothing(tmp_path):
    run_dir = tmp_path / "runs" / "new" / "deeper"
    with RunDirLock(run_dir):
        with pytest.raises(RunDirInUse, match=r"^checkpoint\.directory: .*deeper is in use by this process"):
            RunDirLock(run_dir, field="checkpoint.directory").acquire()
    assert not (run_dir / LOCK_FILE).exists()
    lock = RunDirLock(tmp_path / "fresh" / "run")
    lock.acquire()
    lock.release(remove_created=True)  # a start that never began leaves no directory behind
    assert not (tmp_path / "fresh").exists()
