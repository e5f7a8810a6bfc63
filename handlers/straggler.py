"""StragglerDetector: find the rank that holds the others back, and optionally stop the job.

In synchronous data parallel every rank's *wall-clock* step time is the same: fast ranks spend the
difference waiting inside the gradient all-reduce. What differs is the work each rank does, so by
default each rank times its steps in CPU time of the training thread (``time.thread_time``): time
spent blocked in a collective, or descheduled, does not count. ``clock="wall"`` uses wall time
instead (for runs whose ranks do not synchronise every step).

Every ``every_steps`` steps each rank's median step time over the last ``window`` steps is
all-gathered (one small collective); the slowest and fastest ranks and the slowdown (slowest /
median over ranks) go into ``state.metrics`` under ``straggler/...`` and the log. With
``stop_threshold`` set, a slowdown above it stops the run (every rank sees the same figures, and the
trainer agrees the stop) with ``ExitCode.STRAGGLER_ABORT`` (78).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

import torch

from hookloop.engine import parallel
from hookloop.engine.checks import check_choice, check_int
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler import Handler, checked_settings
from hookloop.handlers.sections.straggler import StragglerConfig

__all__ = ["StragglerConfig", "StragglerDetector"]

# Where the straggler detector runs, relative to the phases of an event (engine.Priority).
#: STEP_START / STEP_END: its step clock, inside the metrics tracker's.
TIME_STRAGGLER = Priority.CLOCK - 100
#: STEP_END: the report, after the observers, before the checkpointer acts.
STRAGGLER = Priority.DECIDE - 500

# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


logger = logging.getLogger(__name__)


class StragglerDetector(Handler):
    """Report per-rank relative speed every ``every_steps`` steps; optionally stop on a straggler.

    Args:
        every_steps: how often to compare ranks.
        stop_threshold: stop when slowest / median step time exceeds it (> 1); None only reports.
        window: steps in each rank's median (default ``every_steps``).
        clock: ``"cpu"`` (training thread CPU time, default) or ``"wall"``.
    """

    Config = StragglerConfig
    section = "straggler"
    doc = "docs/health_check.md"  # its page (a shipped handler: handlers/declarations.py)

    @property
    def asks_after_agreement(self) -> bool:  # type: ignore[override]
        """Whether it may stop the run at STEP_END: only with ``stop_threshold`` set. Its stop comes
        from figures every rank shares, but is carried out at the end of the same step, so it costs
        the trainer's second small all-reduce at the end of every step; without a threshold it
        only reports, at no cost."""
        return self.stop_threshold is not None

    def __init__(
        self,
        every_steps: int = 100,
        *,
        stop_threshold: float | None = None,
        window: int | None = None,
        clock: str = "cpu",
        group: Any = None,
    ) -> None:
        checked_settings(StragglerConfig, locals())
        check_int("window", window, allow_none=True)
        check_choice("clock", clock, ("cpu", "wall"))
        self.every_steps = every_steps
        self.stop_threshold = stop_threshold
        self.window = window or every_steps
        self.group = group
        self._now = time.thread_time if clock == "cpu" else time.perf_counter
        self._times: deque[float] = deque(maxlen=self.window)
        self._t0 = 0.0
        self.last_report: dict[str, Any] | None = None

    def attach(self, trainer: Any) -> StragglerDetector:
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=TIME_STRAGGLER)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=TIME_STRAGGLER)
        trainer.add_event_handler(Events.STEP_END, self._maybe_report, priority=STRAGGLER)
        return super().attach(trainer)

    def _on_step_start(self) -> None:
        self._t0 = self._now()

    def _on_step_end(self) -> None:
        self._times.append(self._now() - self._t0)

    def _maybe_report(self) -> None:
        state = self.trainer.state
        if every(self.every_steps, state.step) and self._times:
            self.report(state.step)

    def gather(self) -> list[float]:
        """Every rank's median step time over the window (one all-gather)."""
        local = statistics.median(self._times) if self._times else float("nan")
        if parallel.world_size() == 1:
            return [local]
        import torch.distributed as dist

        t = torch.tensor([local], dtype=torch.float64, device=parallel.collective_device(self.group))
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t, group=self.group)
        return [float(x[0]) for x in out]

    def report(self, step: int) -> dict[str, Any]:
        times = self.gather()
        slowest = max(range(len(times)), key=times.__getitem__)
        fastest = min(range(len(times)), key=times.__getitem__)
        median = statistics.median(times)
        slowdown = times[slowest] / median if median > 0 else 1.0
        report = {
            "step": step,
            "rank_step_s": times,
            "slowest_rank": slowest,
            "slowest_step_s": times[slowest],
            "fastest_rank": fastest,
            "fastest_step_s": times[fastest],
            "slowdown": slowdown,
        }
        self.last_report = report
        m = self.trainer.state.metrics
        for key in ("slowest_rank", "slowest_step_s", "fastest_rank", "fastest_step_s", "slowdown"):
            m[f"straggler/{key}"] = report[key]
        logger.info(
            "step %d: slowest rank %d (%.4f s/step, %.2fx the median), fastest rank %d (%.4f s/step)",
            step,
            slowest,
            times[slowest],
            slowdown,
            fastest,
            times[fastest],
        )
        if self.stop_threshold is not None and slowdown > self.stop_threshold:
            reason = (
                f"straggler: rank {slowest} takes {times[slowest]:.4f} s/step, {slowdown:.2f}x the median "
                f"(threshold {self.stop_threshold:g})"
            )
            logger.warning(reason)
            self.trainer.control.request_stop(reason, ExitCode.STRAGGLER_ABORT)
        return report
