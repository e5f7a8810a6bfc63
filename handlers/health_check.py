"""HealthCheck: a bounded collective probe that turns a hung or dead peer into a clean exit.

Every ``every_steps`` steps each rank all-reduces a one-element tensor of ones with
``async_op=True`` and waits at most ``timeout_s`` for it; the result must equal the world size.
(GPU users know this as the "NCCL health check"; it works the same on gloo.)

When the probe fails or times out, no agreement is possible (the peer that should agree is the one
that is gone), so this rank does not ask the trainer for an agreed stop, which would hang in its
collective. Instead it logs which check failed, marks ``state.request_stop(...,
ExitCode.HEALTH_CHECK_FAILED)`` and raises :class:`~engine.errors.TrainingAborted` with exit code
77: the trainer's exception path runs (EXCEPTION handlers close loggers, drain local work) and the
script exits with ``e.exit_code``. Contract for EXCEPTION handlers (checkpointers in particular):
do not start collectives on that path, and bound every wait. As a last resort, a watchdog thread
ends the process with code 77 if it is still alive ``exit_grace_s`` seconds after the failure.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any

import torch

from engine import parallel
from engine.errors import ConfigError, TrainingAborted
from engine.events import Events
from engine.exit_codes import ExitCode

__all__ = ["HealthCheck", "HealthCheckError"]

logger = logging.getLogger(__name__)

# The first collective of STEP_END: before the StepScheduler's agreed exit check (2_000_000), the
# MetricsTracker's reduction (1_500_000), validation (1_000_000) and checkpoint handlers, whose
# collectives would block on a dead peer.
_PRIORITY = 5_000_000


class HealthCheckError(TrainingAborted):
    """The collective probe failed or timed out; ``exit_code`` is 77 (HEALTH_CHECK_FAILED)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ExitCode.HEALTH_CHECK_FAILED)


class HealthCheck:
    """Probe the process group every ``every_steps`` steps with a ``timeout_s``-bounded all-reduce.

    Args:
        every_steps: how often to probe (at STEP_END).
        timeout_s: how long to wait for every rank to take part.
        group: the process group (default: the training group).
        exit_grace_s: after a failure, end the process with exit code 77 if it is still running this
            many seconds later (a handler hung on the exception path); None disables the watchdog.
    """

    def __init__(
        self,
        every_steps: int = 100,
        timeout_s: float = 60.0,
        *,
        group: Any = None,
        exit_grace_s: float | None = 30.0,
    ) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ConfigError("every_steps", f"must be a positive integer, got {every_steps!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError("timeout_s", f"must be a positive number of seconds, got {timeout_s!r}")
        if exit_grace_s is not None and not exit_grace_s > 0:
            raise ConfigError(
                "exit_grace_s", f"must be a positive number of seconds or None, got {exit_grace_s!r}"
            )
        self.every_steps = every_steps
        self.timeout_s = float(timeout_s)
        self.group = group
        self.exit_grace_s = exit_grace_s
        self.trainer: Any = None
        self.checks = 0
        self.last_duration_s: float | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> HealthCheck:
        """Build from the ``health`` config section."""
        return cls(cfg.every_steps, cfg.timeout_s)

    def attach(self, trainer: Any) -> HealthCheck:
        self.trainer = trainer
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=_PRIORITY)
        return self

    def _on_step_end(self) -> None:
        step = self.trainer.state.step
        if step % self.every_steps == 0:
            self.check(step)

    def probe(self) -> str | None:
        """Run one probe; None when healthy, else what went wrong."""
        import torch.distributed as dist

        world = parallel.world_size()
        if world == 1:
            return None
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(self.group) == "nccl"
            else None
        )
        t = torch.ones(1, device=device)
        start = time.perf_counter()
        try:
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:  # timeout, or a peer's connection closed
            detail = str(e).splitlines()[0][:200]
            if "timed out" in detail.lower():
                return f"all-reduce did not complete within {self.timeout_s:g}s ({detail})"
            return f"all-reduce failed ({detail})"
        finally:
            self.last_duration_s = time.perf_counter() - start
        got = float(t[0])
        if got != world:
            return f"all-reduce of ones returned {got:g}, expected the world size {world}"
        return None

    def check(self, step: int | None = None) -> None:
        """Probe; on failure log, mark the stop and raise :class:`HealthCheckError`."""
        self.checks += 1
        problem = self.probe()
        if problem is None:
            return
        where = f" at step {step}" if step is not None else ""
        message = f"health check{where} failed on rank {parallel.rank()}: {problem}; a peer is hung or gone"
        logger.error(message)
        if self.trainer is not None:
            self.trainer.state.request_stop(message, ExitCode.HEALTH_CHECK_FAILED)
        self._arm_watchdog()
        raise HealthCheckError(message)

    def _arm_watchdog(self) -> None:
        if self.exit_grace_s is None:
            return

        def hard_exit() -> None:
            logger.error(
                "still running %gs after the failed health check: exiting with code 77", self.exit_grace_s
            )
            os._exit(int(ExitCode.HEALTH_CHECK_FAILED))

        timer = threading.Timer(self.exit_grace_s, hard_exit)
        timer.daemon = True
        timer.start()
