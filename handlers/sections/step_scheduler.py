"""The ``step_scheduler`` section: :class:`StepSchedulerConfig`, read by
:class:`~hookloop.handlers.step_scheduler.StepScheduler`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hookloop.engine.checks import check_bool, check_int, check_number, dotted, resolve_signals

__all__ = ["StepSchedulerConfig"]

# OmegaConf resolves the section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


@dataclass
class StepSchedulerConfig:
    """The ``step_scheduler`` section: when things happen; see :class:`StepScheduler` for the
    semantics. ``enabled: false`` leaves the trainer without a scheduler."""

    global_batch_size: int = 32
    num_epochs: Optional[int] = 10
    max_steps: Optional[int] = None
    ckpt_every_steps: Optional[int] = 100
    save_checkpoint_every_epoch: bool = True
    val_every_steps: Optional[int] = None
    loss_average_window_steps: int = 50
    gc_every_steps: Optional[int] = None
    start_step: int = 0
    start_epoch: int = 0
    exit_duration_in_mins: Optional[float] = None
    exit_interval: Optional[int] = None
    stop_signals: List[str] = field(default_factory=lambda: ["SIGTERM"])
    enabled: bool = True

    def validate(self, prefix: str = "step_scheduler") -> None:
        """The only copy of the scheduler's rules (its constructor calls this with ``prefix=""``)."""
        p = prefix
        check_bool(dotted(p, "enabled"), self.enabled)
        check_int(dotted(p, "global_batch_size"), self.global_batch_size)
        for name in ("num_epochs", "max_steps", "ckpt_every_steps", "val_every_steps", "gc_every_steps"):
            check_int(dotted(p, name), getattr(self, name), allow_none=True)
        check_bool(dotted(p, "save_checkpoint_every_epoch"), self.save_checkpoint_every_epoch)
        check_int(dotted(p, "loss_average_window_steps"), self.loss_average_window_steps)
        check_int(dotted(p, "start_step"), self.start_step, low=0, hint="steps already done")
        check_int(dotted(p, "start_epoch"), self.start_epoch, low=0, hint="epochs already done")
        check_number(
            dotted(p, "exit_duration_in_mins"), self.exit_duration_in_mins, positive=True, allow_none=True
        )
        check_int(dotted(p, "exit_interval"), self.exit_interval, allow_none=True)
        resolve_signals(self.stop_signals, dotted(p, "stop_signals"))

    def produces(self, cfg: Any) -> set[str]:
        """The moving average of the loss, ``loss_avg``."""
        return {"loss_avg"} if self.enabled else set()
