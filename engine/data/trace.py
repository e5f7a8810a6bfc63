"""The samples each optimizer step trained on, one JSON line per step and data-parallel rank.

:class:`SampleTrace` writes ``samples-rank<R>.jsonl`` into the run directory (``R`` is the
data-parallel rank), one line per optimizer step this rank trained::

    {"step": 12, "ids": ["docs:1234", "code:77", ...]}

An id is ``"<dataset name>:<index within that dataset>"``, in the order the rank consumed the
samples (microbatch by microbatch). The union of every rank's ``ids`` for a step is that step's
global batch.

In a fault-tolerant run (:mod:`engine.fault_tolerance`) each replica group writes its ranks' files
into its own directory, and each line also says whether the step was committed across the groups
and which groups took part: ``{"step": 12, "ids": [...], "committed": true, "groups": [0, 1]}``. A
step that was not committed is never trained again (its samples are dropped: its gradient may still
have reached a group that committed it); the samples of a group absent from a step's ``groups`` were
never drawn, and are dropped too.

Resume rule: once the run has started (RUN_STARTED: a checkpoint was restored and every rank
agreed to go on; a refused start touches no trace file) every trace file in the run
directory is cut to the lines of steps ``<=`` the step the run starts from, and a rollback cuts this
rank's file to the step restored. Lines of steps that trained after the last checkpoint of a killed
run are therefore gone before the resumed run trains those steps again, so each file holds each step
at most once and the files together describe exactly the run's surviving history, also when the
number of ranks changed (rank 0 cuts the files of ranks the new run no longer has).

Damage: a line that is not a whole step's JSON (torn by a kill mid-write, or garbage) at the end of
a file is cut the same way, with a warning naming the file and the line's number (the cut of
:mod:`engine.record_file`: a start costs the lines cut, not the trace's length).
:func:`read_sample_traces` skips, with the same warning, a damaged line anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookloop.engine.data.loader import MixtureLoader
from hookloop.engine.data.mixture import MixtureDataset
from hookloop.engine.data.sampler import MixtureSampler
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority
from hookloop.engine.files import open_no_link
from hookloop.engine.record_file import cut_to_step, step_row, warn_damaged

__all__ = ["SampleTrace", "read_sample_traces"]

logger = logging.getLogger(__name__)

_FILE = re.compile(r"^samples-rank(\d+)\.jsonl$")


def _row(line: bytes) -> dict[str, Any] | None:
    """The step row a whole line holds (``{"step": int, "ids": [...]}``), else None."""
    row = step_row(line)
    return row if row is not None and isinstance(row.get("ids"), list) else None


def read_sample_traces(run_dir: str | os.PathLike) -> dict[int, dict[int, list[str]]]:
    """``{rank: {step: ids}}`` from every trace file in ``run_dir``. A step twice in one file is an
    error (the resume rule guarantees it never is); a damaged line is skipped with a warning."""
    out: dict[int, dict[int, list[str]]] = {}
    for path in sorted(Path(run_dir).iterdir()):
        match = _FILE.match(path.name)
        if not match:
            continue
        steps: dict[int, list[str]] = {}
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                row = _row(line)
                if row is None:
                    if line.strip():
                        warn_damaged(path, number, "skipped")
                    continue
                if row["step"] in steps:
                    raise ValueError(f"{path} holds step {row['step']} twice")
                steps[row["step"]] = row["ids"]
        out[int(match.group(1))] = steps
    return out


def _cut(path: Path, last_step: int) -> None:
    """Cut ``path`` back to its lines of steps ``<= last_step`` (:func:`cut_to_step`)."""
    cut_to_step(path, last_step, row=_row)


class SampleTrace:
    """Write the ids of the samples each step consumed on this rank (see the module docs).

    Args:
        run_dir: where ``samples-rank<rank>.jsonl`` goes.
        data: the training loader: a :class:`MixtureLoader` (exact with worker processes: only
            returned batches count), or a ``DataLoader`` with ``num_workers=0`` whose sampler is a
            :class:`MixtureSampler`.
        rank, world_size: this process's data-parallel rank and the number of data-parallel ranks.
        write: False on processes that share a data-parallel rank's data without owning its file
            (every process of a replica but its first tensor- and pipeline-parallel rank): they
            cut nothing and write nothing, so each file has one writer.
    """

    asks_after_agreement = False  # writes files, never asks for a stop: no extra collective

    def __init__(
        self, run_dir: str | os.PathLike, data: Any, *, rank: int = 0, world_size: int = 1, write: bool = True
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank, self.world_size, self.write = int(rank), int(world_size), bool(write)
        self.path = self.run_dir / f"samples-rank{rank}.jsonl"
        self._take, self.mixture = self._source(data)
        self._pending: list[list[int]] = []  # the step's indices, by batch
        self.trainer: Any = None

    @staticmethod
    def _source(data: Any) -> tuple[Callable[[], list[list[int]]], MixtureDataset]:
        if isinstance(data, MixtureLoader):
            data.log_batches()
            return data.take_returned, data.mixture_sampler.mixture
        sampler = getattr(getattr(data, "batch_sampler", None), "sampler", None)
        if isinstance(sampler, MixtureSampler) and getattr(data, "num_workers", None) == 0:
            sampler.log_indices()
            return lambda: [sampler.take_logged()], sampler.mixture
        raise ConfigError(
            "data.trace_samples",
            f"needs a MixtureLoader or a DataLoader with num_workers=0 over a MixtureSampler, got "
            f"{type(data).__name__}; use MixtureLoader (exact with workers too)",
        )

    def ids(self, indices: list[int]) -> list[str]:
        """``"<name>:<index>"`` of each global mixture index."""
        names, locate = self.mixture.names, self.mixture.locate
        out = []
        for index in indices:
            source, local = locate(index)
            out.append(f"{names[source]}:{local}")
        return out

    def step_ids(self) -> list[list[str]]:
        """The ids of each microbatch of the current step on this rank (from STEP_START to STEP_END):
        what a handler that judges the step's samples reads."""
        batches = [b for b in self._pending if b]
        n = len(self.trainer.state.batch or ())
        if len(batches) != n and n:  # a plain DataLoader's indices come as one list: split evenly
            flat = [i for b in batches for i in b]
            size = len(flat) // n
            batches = [flat[k * size : (k + 1) * size] for k in range(n)]
        return [self.ids(b) for b in batches]

    def attach(self, trainer: Any) -> SampleTrace:
        self.trainer = trainer
        trainer.register_handler(self)  # found by trainer.get_handler(SampleTrace); holds no state
        # Where a handler that moves the mixture's phase runs too: after the restore (RESTORE), at the
        # start of OBSERVE on TRAIN_START and a little later on each step, late on ROLLBACK.
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=Priority.OBSERVE)
        trainer.add_event_handler(Events.RUN_STARTED, self._on_run_started, priority=Priority.OBSERVE)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=Priority.OBSERVE - 100)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=Priority.OBSERVE - 100)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback, priority=Priority.DEFAULT - 900)
        return self

    def _on_train_start(self) -> None:
        self._take()  # nothing trained on yet: anything logged belongs to no step
        self._pending = []

    def _on_run_started(self) -> None:
        if not self.write:
            return
        step = self.trainer.state.step
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _cut(self.path, step)
        if self.rank == 0:  # the files of ranks this run no longer has
            for path in self.run_dir.glob("samples-rank*.jsonl"):
                match = _FILE.match(path.name)
                if match and int(match.group(1)) >= self.world_size:
                    _cut(path, step)

    def _on_step_start(self) -> None:
        # The step's microbatches are fetched: everything returned since the last step is this step's.
        self._pending = self._take()

    def _on_step_end(self) -> None:
        ids, self._pending = self.ids([i for b in self._pending for i in b]), []
        if self.write:
            row = {"step": int(self.trainer.state.step), "ids": ids}
            live = getattr(self.trainer.agreement.transport, "live", None)
            if live is not None:  # replica groups: whether the step counted, and who took part
                row.update(committed=bool(self.trainer.agreement.transport.committed), groups=list(live))
            with os.fdopen(open_no_link(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
                f.write(json.dumps(row) + "\n")

    def _on_rollback(self) -> None:
        self._pending = []
        if self.write:
            _cut(self.path, self.trainer.state.step)

    def __repr__(self) -> str:
        return f"SampleTrace({self.path})"
