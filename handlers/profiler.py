"""ProfilerWindow: trace exactly the steps ``[start_step, end_step)``, counted in absolute steps.

The window is in the trainer's own step numbers (``state.step``), not "steps since this process
started", so a job resumed from a checkpoint at step 4000 with a window of [4100, 4105) traces
steps 4100-4104, and a window that ended before the resume point is not traced again. Each traced
step is the region ``ProfilerStep#<step>`` in the trace, carrying its absolute number.

One trace per profiled rank is exported when the window closes (or when the run ends inside it)
with ``torch.profiler.tensorboard_trace_handler``: a Chrome trace (``chrome://tracing``, Perfetto)
that the TensorBoard profiler plugin also reads, named ``rank<r>_steps<start>-<end>.<...>.pt.trace.json``.
With CUDA and ``profile_memory=True``, a CUDA memory snapshot (``memory_snapshot_rank<r>.pickle``,
for pytorch.org/memory_viz) is written too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine import parallel
from engine.errors import ConfigError
from engine.events import Events

__all__ = ["ProfilerWindow"]

logger = logging.getLogger(__name__)

# Open the step region before anything else runs in the step, close it after everything.
_FIRST = float("inf")
_LAST = -1e12


def _record_every_step(_step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


class ProfilerWindow:
    """Profile steps ``start_step <= step < end_step`` on ``ranks``.

    Args:
        start_step: first traced step (1-based, absolute).
        end_step: first step not traced; must be larger than ``start_step``.
        ranks: the ranks that trace (others do nothing); None for every rank.
        output_dir: where traces go.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
        use_gzip: compress the exported trace.
    """

    def __init__(
        self,
        start_step: int,
        end_step: int,
        *,
        ranks: Sequence[int] | None = (0,),
        output_dir: str | os.PathLike,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        use_gzip: bool = False,
    ) -> None:
        for name, value in (("start_step", start_step), ("end_step", end_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer (steps are 1-based), got {value!r}")
        if end_step <= start_step:
            raise ConfigError(
                "end_step",
                f"must be larger than start_step ({start_step}), got {end_step}: the window is [start, end)",
            )
        if ranks is not None and any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise ConfigError("ranks", f"must be non-negative integers or None (every rank), got {ranks!r}")
        if output_dir is None or str(output_dir) == "":
            raise ConfigError("output_dir", "must be a directory path for the traces")
        self.start_step = start_step
        self.end_step = end_step
        self.ranks = None if ranks is None else tuple(ranks)
        self.output_dir = Path(output_dir)
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.use_gzip = use_gzip
        self.trainer: Any = None
        self.profiler: torch.profiler.profile | None = None
        self.traced_steps: list[int] = []
        self._cuda_memory = False

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | os.PathLike) -> ProfilerWindow:
        """Build from the ``profiling`` config section (traces under ``<run_dir>/profile`` by default)."""
        return cls(
            cfg.start_step,
            cfg.end_step,
            ranks=cfg.ranks,
            output_dir=cfg.output_dir or Path(run_dir) / "profile",
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )

    def attach(self, trainer: Any) -> ProfilerWindow:
        self.trainer = trainer
        if self.ranks is not None and parallel.rank() not in self.ranks:
            return self
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=_FIRST)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=_LAST)
        trainer.add_event_handler(Events.TRAIN_END, self._stop)
        trainer.add_event_handler(Events.TRAIN_FAILED, lambda _e: self._stop())
        return self

    @property
    def active(self) -> bool:
        return self.profiler is not None

    def _on_step_start(self) -> None:
        step = self.trainer.state.step
        if self.profiler is not None:
            self.profiler.step()  # closes ProfilerStep#(step-1), opens ProfilerStep#step
            self.traced_steps.append(step)
        elif self.start_step <= step < self.end_step and not self.traced_steps:
            if step > self.start_step:
                logger.warning(
                    "profiler window [%d, %d) opens before this run's first step %d (resumed): "
                    "tracing [%d, %d)",
                    self.start_step,
                    self.end_step,
                    step,
                    step,
                    self.end_step,
                )
            self._start(step)

    def _start(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        worker = f"rank{parallel.rank()}_steps{self.start_step}-{self.end_step}"
        self.profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            # a schedule (always RECORD) makes the profiler mark ProfilerStep#N regions
            schedule=_record_every_step,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.output_dir), worker_name=worker, use_gzip=self.use_gzip
            ),
        )
        # the step regions are named ProfilerStep#<step_num>: make that the absolute step number
        self.profiler.step_num = step
        if self.profile_memory and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history()
            self._cuda_memory = True
        self.profiler.start()
        self.traced_steps.append(step)

    def _on_step_end(self) -> None:
        if self.profiler is not None and self.trainer.state.step >= self.end_step - 1:
            self._stop()

    def _stop(self) -> None:
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        # stop() exports through on_trace_ready
        profiler.stop()
        if self._cuda_memory:
            torch.cuda.memory._dump_snapshot(
                str(self.output_dir / f"memory_snapshot_rank{parallel.rank()}.pickle")
            )
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_memory = False
        logger.info(
            "profiled steps %s on rank %d into %s", self.traced_steps, parallel.rank(), self.output_dir
        )

    def trace_files(self) -> list[Path]:
        """The trace files this window wrote (this rank)."""
        pattern = f"rank{parallel.rank()}_steps{self.start_step}-{self.end_step}.*.pt.trace.json*"
        return sorted(self.output_dir.glob(pattern))
