"""HealthCheck: a bounded collective probe that turns a hung or dead peer into a clean exit.

Every ``every_steps`` steps each rank all-reduces a one-element tensor of ones with
``async_op=True`` and waits at most ``timeout_s`` for it; the result must equal the world size.
(GPU users know this as the "NCCL health check"; it works the same on gloo.)

When the probe fails or times out, no agreement is possible (the peer that should agree is the one
that is gone), so this rank does not ask the trainer for an agreed stop, which would hang in its
collective. Instead it logs which check failed, records the stop on the trainer's control point
(``trainer.control.request_stop(..., ExitCode.HEALTH_CHECK_FAILED)``) and raises
:class:`~engine.errors.TrainingAborted` with exit code 77: the trainer's error path runs
(TRAIN_FAILED handlers close loggers, drain local work) and the script exits with
``e.exit_code``. Contract for TRAIN_FAILED handlers (checkpointers in particular): do not start
collectives on that path, and bound every wait. As a last resort, a watchdog thread
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

from hookloop.engine import parallel
from hookloop.engine.checks import check_number
from hookloop.engine.errors import TrainingAborted
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler import Handler, checked_settings
from hookloop.engine.watchdog import dump_stacks
from hookloop.handlers.sections.health import HealthConfig

__all__ = ["HealthCheck", "HealthCheckError", "HealthConfig"]

#: Where the health check runs on STEP_END: the first observer, before anything reads the step.
HEALTH = Priority.OBSERVE + 400


logger = logging.getLogger(__name__)


class HealthCheckError(TrainingAborted):
    """The collective probe failed or timed out; ``exit_code`` is 77 (HEALTH_CHECK_FAILED)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ExitCode.HEALTH_CHECK_FAILED)


class HealthCheck(Handler):
    """Probe the process group every ``every_steps`` steps with a ``timeout_s``-bounded all-reduce.

    Args:
        every_steps: how often to probe (at STEP_END).
        timeout_s: how long to wait for every rank to take part.
        group: the process group (default: the training group).
        exit_grace_s: after a failure, end the process with exit code 77 if it is still running this
            many seconds later (a handler hung on the exception path); None disables the watchdog.
    """

    Config = HealthConfig
    section = "health"
    doc = "docs/health_check.md"  # its page (a shipped handler: handlers/declarations.py)

    def __init__(
        self,
        every_steps: int = 100,
        timeout_s: float = 60.0,
        *,
        group: Any = None,
        exit_grace_s: float | None = 30.0,
    ) -> None:
        checked_settings(HealthConfig, locals())
        check_number("exit_grace_s", exit_grace_s, positive=True, allow_none=True, hint="seconds")
        self.every_steps = every_steps
        self.timeout_s = float(timeout_s)
        self.group = group
        self.exit_grace_s = exit_grace_s
        self.checks = 0
        self.last_duration_s: float | None = None

    def attach(self, trainer: Any) -> HealthCheck:
        # The first collective of STEP_END: before the StepScheduler's agreed exit check, the
        # MetricsTracker's reduction, validation and the checkpointer, whose collectives would block
        # on a dead peer.
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=HEALTH)
        # A hang inside a step (a peer stopped mid-collective) is bounded by the same timeout: the
        # trainer's watchdog exits 77 when the loop makes no progress for that long.
        if getattr(trainer, "watchdog", None) is not None:
            trainer.watchdog.set_bound("health_check", self.timeout_s)
        return super().attach(trainer)

    def _on_step_end(self) -> None:
        step = self.trainer.state.step
        if every(self.every_steps, step):
            self.check(step)

    def probe(self) -> str | None:
        """Run one probe; None when healthy, else what went wrong."""
        import torch.distributed as dist

        world = parallel.world_size()
        if world == 1:
            return None
        t = torch.ones(1, device=parallel.collective_device(self.group))
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
            self.trainer.control.request_stop(message, ExitCode.HEALTH_CHECK_FAILED)
            # Recorded now: the grace timer below may end the process before the run's own exit
            # path gets to write it. The stacks show where every thread was when the peer went.
            self.trainer.write_exit_status(int(ExitCode.HEALTH_CHECK_FAILED), message)
            path = dump_stacks(getattr(self.trainer, "run_dir", None), parallel.rank(), message)
            if path is not None:
                logger.error("stacks of every thread in %s", path)
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
