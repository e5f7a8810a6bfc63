"""JSONLLogger: one JSON object per logged step in a file; cheap enough to leave on always."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hookloop.engine.events import Priority
from hookloop.engine.record_file import FLUSH_SECS, RecordFile
from hookloop.handlers.metric_logger import LoggingConfig, MetricLogger

__all__ = ["JSONLLogger"]

#: Where the JSONL logger records a step: the first of the shipped loggers.
LOG_JSONL = Priority.RECORD


def _line(record: tuple[int, float, dict[str, float]]) -> str:
    step, unix_time, metrics = record
    return json.dumps({"step": step, "time": unix_time, **metrics})


class JSONLLogger(MetricLogger):
    """Appends ``{"step": N, "time": unix_seconds, <metric>: value, ...}`` lines to ``path``.

    The file is appended to, so a resumed run continues its history in the same file, each step
    once: when the run starts, the lines of steps after the step it starts from are cut
    (:meth:`~hookloop.engine.RecordFile.cut`), so steps a killed run logged after its last
    checkpoint are not there twice. Non-finite values are written as ``NaN`` / ``Infinity``
    (Python's ``json`` reads them). Rank 0 only unless ``all_ranks=True``, in which case every
    rank but 0 writes ``<stem>.rank<r><suffix>``.

    Lines are whole and in step order; they reach the file within ``flush_secs`` seconds, when a
    checkpoint is published and at the end (a :class:`~hookloop.engine.RecordFile`): a killed run
    loses at most its last ``flush_secs`` seconds of lines, which a run resumed from its last
    checkpoint writes again.
    """

    doc = "docs/metrics_and_loggers.md"  # its page (a shipped handler: handlers/declarations.py)
    switch = "jsonl"  # the logging section's boolean that builds it

    priority = LOG_JSONL

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        all_ranks: bool = False,
        flush_secs: float = FLUSH_SECS,
    ) -> None:
        super().__init__(all_ranks=all_ranks)
        self.path = Path(path)
        self.flush_secs = flush_secs
        self._file: RecordFile | None = None

    @classmethod
    def from_config(cls, cfg: LoggingConfig, *, run_dir: str | os.PathLike) -> JSONLLogger | None:
        """``<run_dir>/metrics.jsonl`` from the ``logging`` section, or None when ``cfg.jsonl`` is false."""
        if not getattr(cfg, cls.switch):
            return None
        return cls(Path(run_dir) / "metrics.jsonl")

    def _rank_path(self) -> Path:
        from hookloop.engine import parallel

        r = parallel.rank()
        return self.path if r == 0 else self.path.with_name(f"{self.path.stem}.rank{r}{self.path.suffix}")

    def open(self) -> None:
        self._file = RecordFile(self._rank_path(), flush_secs=self.flush_secs, encode=_line)
        self._file.cut(self.trainer.state.step)  # each step once: a killed run's later lines go

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._file is not None:
            self._file.write((step, time.time(), metrics))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
