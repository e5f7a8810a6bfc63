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

from hookloop.engine import parallel
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority
from hookloop.engine.handler import Handler, checked_settings, section_settings
from hookloop.handlers.sections.profiling import ProfilingConfig

__all__ = ["ProfilerWindow", "ProfilingConfig"]

# Where the profiler runs, relative to the phases of an event (engine.Priority).
#: STEP_START: step the profiler before any clock starts (the head of CLOCK).
PROFILE = Priority.CLOCK + 900
#: STEP_END / TRAIN_END / TRAIN_FAILED: late in CLEANUP, so a trace holds every other handler's work.
PROFILE_END = Priority.CLEANUP - 900

# OmegaConf resolves the config section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


logger = logging.getLogger(__name__)


def _record_every_step(_step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


class ProfilerWindow(Handler):
    """Profile steps ``start_step <= step < end_step`` on ``ranks``.

    Args:
        start_step: first traced step (1-based, absolute).
        end_step: first step not traced; must be larger than ``start_step``.
        ranks: the ranks that trace (others do nothing); None for every rank.
        output_dir: where traces go.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
        use_gzip: compress the exported trace.
    """

    Config = ProfilingConfig
    section = "profiling"
    doc = "docs/profiler.md"  # its page (a shipped handler: handlers/declarations.py)

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
        checked_settings(ProfilingConfig, {**locals(), "output_dir": None})  # output_dir: checked below
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
        self.profiler: torch.profiler.profile | None = None
        self.traced_steps: list[int] = []
        self._cuda_memory = False

    @classmethod
    def from_config(
        cls, cfg: ProfilingConfig, *, run_dir: str | os.PathLike | None = None
    ) -> ProfilerWindow | None:
        """Build from the ``profiling`` section, or None when ``cfg.enabled`` is false; traces go
        to ``cfg.output_dir``, else ``<run_dir>/profile``."""
        if not cfg.enabled:
            return None
        if cfg.output_dir is None and run_dir is None:
            raise ConfigError("profiling.output_dir", "is null and no run_dir was given: set one of them")
        output_dir = cfg.output_dir or Path(run_dir) / "profile"  # type: ignore[arg-type]
        return cls(**{**section_settings(cfg), "output_dir": output_dir})

    def attach(self, trainer: Any) -> ProfilerWindow:
        if self.ranks is None or parallel.rank() in self.ranks:
            # Open the step region before anything else runs in the step, close it after everything.
            trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=PROFILE)
            trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=PROFILE_END)
            trainer.add_event_handler(Events.TRAIN_END, self._stop, priority=PROFILE_END)
            trainer.add_event_handler(Events.TRAIN_FAILED, self._on_failed, priority=PROFILE_END)
        return super().attach(trainer)

    def _on_failed(self, _error: BaseException) -> None:
        self._stop()

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
