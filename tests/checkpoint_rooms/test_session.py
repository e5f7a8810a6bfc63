"""The session: a session id per run (no process group with one process), the two background
threads working on one intra-op thread and made again after they are stopped, at training's priority
(their lock-free helpers at the lowest), local agreement with one rank, and the hold on the directory
that makes another live run's leftovers untouchable."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from hookloop.engine.checkpoint_format.durable_files import ChecksummingFileSystem
from hookloop.engine.intra_op import BACKGROUND_NICE
from hookloop.engine.run_lock import LOCK_FILE, RunDirInUse
from hookloop.handlers.checkpoint.session import CheckpointSession


def test_open_chooses_a_session_id_without_a_process_group_and_close_forgets_it():
    s = CheckpointSession()
    assert not s.is_open and s.id == ""
    s.open()
    assert s.is_open and s.group is None and len(s.id) == 8 and int(s.id, 16) >= 0
    first = s.id
    s.close()
    assert not s.is_open
    s.open()
    assert s.id != first  # a new run names its partial directories anew
    s.close()


def test_the_threads_use_one_intra_op_thread_and_come_back_after_close(sess):
    torch.set_num_threads(2)  # the autouse fixture restores it
    io, write = sess.io_thread(), sess.write_thread()
    assert io is not write and sess.io_thread() is io  # made once
    assert io.submit(torch.get_num_threads).result() == 1
    assert write.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2  # the caller's own count is left alone
    sess.close_threads()
    with pytest.raises(RuntimeError):
        io.submit(print)
    assert sess.io_thread() is not io  # made again on use


def test_one_rank_agrees_with_itself(sess):
    assert sess.agree_failed(True) is True and sess.agree_failed(False) is False
    assert sess.agree_max([3, 0, 7]) == [3, 0, 7]


def test_holding_a_directory_refuses_another_holder_until_released(tmp_path):
    directory = str(tmp_path / "ckpt")
    first, second = CheckpointSession(), CheckpointSession()
    owner, other = object(), object()
    first.hold(owner, directory)
    assert (tmp_path / "ckpt" / LOCK_FILE).exists()
    with pytest.raises(RunDirInUse, match=r"ckpt is in use by this process"):
        second.hold(other, directory)
    first.release(owner, directory, started=True)
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
    second.hold(other, directory)  # free again
    second.release(other, directory, started=False)
    assert (tmp_path / "ckpt").is_dir()  # the first run's: it stays
    fresh = str(tmp_path / "fresh")
    first.hold(owner, fresh)
    first.release(owner, fresh, started=False)
    assert not (tmp_path / "fresh").exists()  # a start that never began leaves no directory


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="threads have nice values of their own on Linux"
)
def test_the_writer_keeps_trainings_priority_and_its_lock_free_helpers_take_the_lowest(sess):
    """The writer runs Python: lowered, it would hold the interpreter lock while it waits for a
    core. Its checksum and writeback helpers work without the lock: they yield the cores."""

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    own, lowest = nice(), max(nice(), BACKGROUND_NICE)
    assert sess.write_thread().submit(nice).result() == own
    assert sess.io_thread().submit(nice).result() == own
    fs = ChecksummingFileSystem()
    try:  # made by the writer thread, as in a save
        helpers = sess.write_thread().submit(
            lambda: [fs.helper(k).submit(nice).result() for k in ("checksum", "writeback")]
        )
        assert helpers.result() == [lowest, lowest]
    finally:
        fs.close()
    assert nice() == own  # the caller's own is left alone
