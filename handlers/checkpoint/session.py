"""What the checkpoint wing shares for the length of a run: the gloo process group its saves and
loads talk on (so they never collide with training's collectives), the session id that names this
run's partial directories, the two threads that do the work training need not wait for, and the hold
on the checkpoint directory (one run writes it at a time)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hookloop.engine import intra_op, parallel
from hookloop.engine.intra_op import use_one_intra_op_thread
from hookloop.engine.run_lock import hold_for, release_for

__all__ = ["CheckpointSession"]


class CheckpointSession:
    """The checkpoint process group (None without ``torch.distributed``), the session id (``""``
    until :meth:`open`), and the writer and file threads, made on first use."""

    def __init__(self) -> None:
        self.group: Any = None
        self.id = ""
        self._io: ThreadPoolExecutor | None = None
        self._write: ThreadPoolExecutor | None = None
        self._lock: Any = None  # the directory's own lock, when no lock this process holds covers it

    @property
    def is_open(self) -> bool:
        return bool(self.id)

    def open(self) -> None:
        """Once per run (collective): the gloo group and a session id rank 0 chose."""
        session = uuid.uuid4().int & 0x7FFFFFFF
        if dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
            t = torch.tensor([session], dtype=torch.int64)
            dist.broadcast(t, src=0, group=self.group)
            session = int(t[0])
        self.id = f"{session:08x}"

    def io_thread(self) -> ThreadPoolExecutor:
        """The thread for the file work training need not wait for (rank state files, pruning)."""
        return self._thread("_io", "io")

    def write_thread(self) -> ThreadPoolExecutor:
        """The thread that stages and writes ``mode="async"`` saves (one save in flight at a time)."""
        return self._thread("_write", "write")

    def _thread(self, attr: str, name: str) -> ThreadPoolExecutor:
        """One worker thread, made on first use. It runs its torch ops on one intra-op thread: a
        team of its own would slow every later training step (see :mod:`hookloop.engine.intra_op`)."""
        if getattr(self, attr) is None:
            intra_op.prepare()  # here, so that the thread starts as fast as it did before
            executor = ThreadPoolExecutor(
                1, thread_name_prefix=f"hookloop-checkpoint-{name}", initializer=use_one_intra_op_thread
            )
            setattr(self, attr, executor)
        return getattr(self, attr)

    def agree_failed(self, failed: bool) -> bool:
        """Whether any rank failed (one small all-reduce on the checkpoint group; local with one
        rank)."""
        return bool(self.agree_max([int(failed)])[0])

    def agree_max(self, values: list[int]) -> list[int]:
        """Each of ``values``' largest over the ranks (one small all-reduce on the checkpoint group,
        which training's collectives never use: callable from the writer thread; local with one
        rank)."""
        if parallel.world_size() == 1:
            return list(values)
        device = "cpu" if self.group is not None else parallel.collective_device()  # not open: training's
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def hold(self, owner: object, directory: str) -> None:
        """Hold ``directory`` for ``owner`` (a collective): under the run directory's lock (hookloop
        train) or one of its own (docs/requeue.md, "One run per run directory")."""
        lock = hold_for(owner, directory, field="checkpoint.directory")
        self._lock = self._lock or lock

    def release(self, owner: object, directory: str, *, started: bool) -> None:
        """Give up the directory's own lock, or ``owner``'s claim on the run directory's (a later
        run() takes it again); a start that never began (``started`` false) also removes the
        directory its own lock created, if it stayed empty."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(remove_created=not started)
        release_for(owner, directory)

    def close_threads(self) -> None:
        """Stop the threads once their work is done (they are made again on use)."""
        for executor in (self._write, self._io):
            if executor is not None:
                executor.shutdown(wait=True)
        self._write = self._io = None

    def close(self) -> None:
        """Stop the threads and release the group; a later :meth:`open` starts over."""
        self.close_threads()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
        self.id = ""
