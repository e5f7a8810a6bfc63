"""What the room tests give a room in place of the rest of the checkpointer: a session without a
process group (one rank), a store and a writer on a directory under ``tmp_path``, a waiting
context that records its use, a tiny model with its optimizer, a gated stager that holds a save
in staging until the test lets it go, and a spy on the writes that says which went to the disk directly."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from hookloop.engine import Trainer
from hookloop.handlers.checkpoint.reader import CheckpointReader
from hookloop.handlers.checkpoint.session import CheckpointSession
from hookloop.handlers.checkpoint.store import CheckpointStore
from hookloop.handlers.checkpoint.writer import CheckpointWriter
from hookloop.handlers.sections.checkpoint import AsyncMode

SESSION_ID = "0000abcd"  # this run's session in every room test; a crashed run's is another id


class LongWaits:
    """The ``long_wait`` a room is given: counts how often it lifted the watchdog, and whether a
    wait is going on now."""

    def __init__(self) -> None:
        self.entered = 0
        self.active = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.entered += 1
        self.active = True
        try:
            yield
        finally:
            self.active = False


def session(session_id: str = SESSION_ID) -> CheckpointSession:
    """A session of one rank: no process group (``torch.distributed`` is not initialized), a known id."""
    s = CheckpointSession()
    s.id = session_id
    return s


def store(
    directory: str | os.PathLike,
    sess: CheckpointSession | None = None,
    *,
    known_good: int | None = None,
    **settings: Any,
) -> CheckpointStore:
    """A store on ``directory`` (keep_last=3, no keep_best, val_loss/min, an 8 MiB index bound)."""
    options: dict[str, Any] = dict(
        keep_last=3, keep_best=0, metric="val_loss", metric_mode="min", index_limit=8 << 20
    )
    options.update(settings)
    return CheckpointStore(
        os.fspath(directory),
        sess or session(),
        wait_timeout_s=30.0,
        long_wait=LongWaits(),
        known_good=lambda: known_good,
        **options,
    )


def writer(
    directory: str | os.PathLike,
    mode: str = "sync",
    sess: CheckpointSession | None = None,
    st: CheckpointStore | None = None,
    *,
    wait_timeout_s: float = 30.0,
    long_wait: LongWaits | None = None,
) -> CheckpointWriter:
    sess = sess or session()
    return CheckpointWriter(
        os.fspath(directory),
        AsyncMode.parse(mode),
        sess,
        st or store(directory, sess),
        wait_timeout_s=wait_timeout_s,
        long_wait=long_wait or LongWaits(),
    )


def reader(
    st: CheckpointStore, sess: CheckpointSession | None = None, index_limit: int = 8 << 20
) -> CheckpointReader:
    return CheckpointReader(st, sess or session(), index_limit=index_limit, long_wait=LongWaits())


def model_and_optimizer(seed: int = 0, width: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A two-layer model and an AdamW that has taken one step (so it has state to save)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def bare_trainer(seed: int = 0, width: int = 4) -> Trainer:
    """A trainer that never runs: the state, counters and handlers a room reads and restores."""
    model, optimizer = model_and_optimizer(seed, width)
    return Trainer(model, optimizer, torch.nn.functional.mse_loss)


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_json_file(checkpoint: str, name: str) -> Any:
    with open(os.path.join(checkpoint, name), encoding="utf-8") as f:
        return json.load(f)


def write_json_file(checkpoint: str, name: str, value: Any) -> None:
    """Rewrite a file of a checkpoint in place, as someone with write access to it could."""
    with open(os.path.join(checkpoint, name), "w", encoding="utf-8") as f:
        json.dump(value, f)


def rank_state_json(step: int) -> dict[str, Any]:
    """A small state JSON for a save (the writer stores what it is given)."""
    return {"step": step, "note": "rank state"}


def save(
    directory: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    st: CheckpointStore | None = None,
    metrics: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """A complete checkpoint of ``step`` written and published in ``mode="sync"`` (real DCP files)."""
    w = writer(directory, "sync", st=st)
    w.start(step, model, optimizer, extra if extra is not None else rank_state_json(step), metrics or {})
    return w.finish(wait=False).final


class GatedStager:
    """DCP's stager held at a gate: staging waits until ``gate`` is set (the test decides when)."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.gate = threading.Event()
        self.entered = threading.Event()
        self._inner = DefaultStager(StagingOptions(False, False, False, False))

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        return self._inner.stage(state_dict)

    def close(self) -> None:
        self._inner.close()


class FailingStager:
    """A stager whose copy fails, as one running out of host memory would; once ``gate`` is set,
    when one is given."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.gate is not None and not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        raise MemoryError("no host memory for the copy")

    def close(self) -> None:
        pass


def spy_writes(monkeypatch: Any) -> list[tuple[int, bool, int]]:
    """Record each ``os.write`` while the test runs as (bytes written, whether ``O_DIRECT`` was set,
    the file position it wrote at); the writes happen as they would."""
    writes: list[tuple[int, bool, int]] = []
    real = os.write

    def spying(fd, data):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        try:
            position = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:  # a pipe (only a file's writes are the stream's)
            position = -1
        n = real(fd, data)
        writes.append((n, direct, position))
        return n

    monkeypatch.setattr(os, "write", spying)
    return writes
