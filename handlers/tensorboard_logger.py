"""TensorBoardLogger: scalars in real TensorBoard event files under stable tags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hookloop.engine.events import Priority
from hookloop.engine.record_file import RecordFile
from hookloop.handlers.metric_logger import LoggingConfig, MetricLogger, metric_tag

__all__ = ["TensorBoardLogger"]

#: Where the TensorBoard logger records a step: after the JSONL logger.
LOG_TENSORBOARD = Priority.RECORD - 1


class TensorBoardLogger(MetricLogger):
    """Writes every logged metric as a TensorBoard scalar under :func:`metric_tag`
    (``train/loss``, ``train/lr``, ``perf/tokens_per_s``, ``val/loss``, ``loss/<dataset>``), the x
    axis being the optimizer step; one event per logged step holds all its scalars.

    Writes through ``torch.utils.tensorboard.SummaryWriter`` (imported when the logger is
    attached, created once the run has started: RUN_STARTED); ``logger.writer`` is that writer,
    for images or histograms of your own. The training thread only hands each step's scalars over:
    a background thread (a :class:`~hookloop.engine.RecordFile`) builds the events and writes them
    out, in step order, at least every ``flush_secs``, when a checkpoint is published and at the end.

    Args:
        log_dir: the event files' directory (``tensorboard --logdir`` it).
        flush_secs: write the scalars out at least this often (and at a published checkpoint,
            TRAIN_END or an error).
    """

    doc = "docs/metrics_and_loggers.md"  # its page (a shipped handler: handlers/declarations.py)
    switch = "tensorboard"  # the logging section's boolean that builds it

    priority = LOG_TENSORBOARD

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        all_ranks: bool = False,
        flush_secs: float = 10.0,
    ) -> None:
        super().__init__(all_ranks=all_ranks)
        self.log_dir = Path(log_dir)
        self.flush_secs = flush_secs
        self.writer: Any = None
        self._scalars: RecordFile | None = None

    @classmethod
    def from_config(cls, cfg: LoggingConfig, *, run_dir: str | os.PathLike) -> TensorBoardLogger | None:
        """``<run_dir>/tensorboard`` from the ``logging`` section, or None when ``cfg.tensorboard``
        is false."""
        if not getattr(cfg, cls.switch):
            return None
        return cls(Path(run_dir) / "tensorboard")

    def attach(self, trainer: Any) -> TensorBoardLogger:
        if self.active:  # a missing backend fails here, before the run starts; files come at open()
            import torch.utils.tensorboard  # noqa: F401
        return super().attach(trainer)

    def open(self) -> None:
        log_dir = self.log_dir
        if self.all_ranks:
            from hookloop.engine import parallel

            log_dir = log_dir / f"rank{parallel.rank()}"
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._summary = Summary
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=self.flush_secs)
        self._scalars = RecordFile(self._write_events, flush_secs=self.flush_secs)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._scalars is not None:
            self._scalars.write((step, metrics))

    def _write_events(self, records: list[tuple[int, dict[str, float]]]) -> None:
        # One event holding every scalar of a step: the writer frames and checksums each event in
        # Python, so one per step instead of one per scalar keeps logging cheap.
        summary, add = self._summary, self.writer.file_writer.add_summary
        for step, metrics in records:
            values = [summary.Value(tag=metric_tag(k), simple_value=float(v)) for k, v in metrics.items()]
            add(summary(value=values), global_step=step)
        self.writer.flush()

    def flush(self) -> None:
        if self._scalars is not None:
            self._scalars.flush()

    def close(self) -> None:
        scalars, self._scalars = self._scalars, None
        try:
            if scalars is not None:
                scalars.close()
        finally:
            if self.writer is not None:
                self.writer.close()
                self.writer = None
