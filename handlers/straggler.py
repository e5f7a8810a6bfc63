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

from engine import parallel
from engine.errors import ConfigError
from engine.events import Events
from engine.exit_codes import ExitCode

__all__ = ["StragglerDetector"]

logger = logging.getLogger(__name__)

_TIMER_PRIORITY = float("inf")
# after validation, before the loggers (which run at -1000)
_REPORT_PRIORITY = 500


class StragglerDetector:
    """Report per-rank relative speed every ``every_steps`` steps; optionally stop on a straggler.

    Args:
        every_steps: how often to compare ranks.
        stop_threshold: stop when slowest / median step time exceeds it (> 1); None only reports.
        window: steps in each rank's median (default ``every_steps``).
        clock: ``"cpu"`` (training thread CPU time, default) or ``"wall"``.
    """

    def __init__(
        self,
        every_steps: int = 100,
        *,
        stop_threshold: float | None = None,
        window: int | None = None,
        clock: str = "cpu",
        group: Any = None,
    ) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ConfigError("every_steps", f"must be a positive integer, got {every_steps!r}")
        if stop_threshold is not None and not (
            isinstance(stop_threshold, (int, float)) and stop_threshold > 1
        ):
            raise ConfigError(
                "stop_threshold", f"must be > 1 (slowest / median step time) or None, got {stop_threshold!r}"
            )
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError("window", f"must be a positive integer or None, got {window!r}")
        if clock not in ("cpu", "wall"):
            raise ConfigError("clock", f"must be 'cpu' or 'wall', got {clock!r}")
        self.every_steps = every_steps
        self.stop_threshold = stop_threshold
        self.window = window or every_steps
        self.clock = clock
        self.group = group
        self._now = time.thread_time if clock == "cpu" else time.perf_counter
        self._times: deque[float] = deque(maxlen=self.window)
        self._t0 = 0.0
        self.trainer: Any = None
        self.last_report: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> StragglerDetector:
        """Build from the ``straggler`` config section."""
        return cls(cfg.every_steps, stop_threshold=cfg.stop_threshold)

    def attach(self, trainer: Any) -> StragglerDetector:
        self.trainer = trainer
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=_TIMER_PRIORITY)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=_TIMER_PRIORITY)
        trainer.add_event_handler(Events.STEP_END, self._maybe_report, priority=_REPORT_PRIORITY)
        return self

    def _on_step_start(self) -> None:
        self._t0 = self._now()

    def _on_step_end(self) -> None:
        self._times.append(self._now() - self._t0)

    def _maybe_report(self) -> None:
        state = self.trainer.state
        if state.step % self.every_steps == 0 and self._times:
            self.report(state.step)

    def gather(self) -> list[float]:
        """Every rank's median step time over the window (one all-gather)."""
        local = statistics.median(self._times) if self._times else float("nan")
        if parallel.world_size() == 1:
            return [local]
        import torch.distributed as dist

        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(self.group) == "nccl"
            else None
        )
        t = torch.tensor([local], dtype=torch.float64, device=device)
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
            self.trainer.state.request_stop(reason, ExitCode.STRAGGLER_ABORT)
        return report
