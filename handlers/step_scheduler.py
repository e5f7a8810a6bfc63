"""The StepScheduler decides *when*: the cadence of checkpoints, validation and garbage collection
(one setting each, counted by :func:`engine.events.every`), the run's length (``max_steps`` /
``num_epochs``) and the exits a long job needs (stop signals, ``exit_duration_in_mins``,
``exit_interval``).

One step numbering everywhere: during step ``k`` (1-based, ``trainer.state.step == k``)
``is_ckpt_step`` is true when ``k`` is a multiple of ``ckpt_every_steps``, and so on; ``epoch`` is
the 0-based index of the current epoch (the epochs completed before it).

A handler: ``s.attach(trainer)`` then ``trainer.run(dataloader)``; the trainer runs the loop (there
is no standalone iteration: the run plan owns the position). The scheduler configures the trainer's
run plan once (``trainer.plan``, :mod:`engine.run_limits`: limits and accumulation at attach, the
start position at TRAIN_START) and reads it; its stop signals and time limit go to the trainer's
run end (:meth:`engine.run_end.RunEnd.stop_on`); at STEP_START it *requests* its checkpoint and
validation steps on ``trainer.control``, saying which setting asked for a save.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hookloop.engine.checks import check_bool, check_int
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler import Handler, checked_settings, section_settings
from hookloop.engine.run_end import SignalLike, resolve_signals
from hookloop.engine.run_limits import (
    check_position,
    derive_limits,
    grad_acc_steps_for,
    microbatches_to_skip,
    read_position,
)
from hookloop.engine.running_mean import RunningMean
from hookloop.engine.step_batches import data_length, steps_in
from hookloop.handlers.sections.step_scheduler import StepSchedulerConfig

__all__ = ["StepScheduler", "StepSchedulerConfig"]

# Where the step scheduler runs, relative to the phases of an event (engine.Priority).
#: TRAIN_START / EPOCH_START / STEP_START / EPOCH_END: limits, cadence, this step's flags.
SCHEDULE = Priority.DECIDE
#: STEP_END: the loss-average window, before the metrics are published; TRAIN_END / TRAIN_FAILED:
#: restore GC.
EXIT_CHECK = Priority.OBSERVE + 100

# OmegaConf resolves the config section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045

logger = logging.getLogger(__name__)


class StepScheduler(Handler):
    """When to step, checkpoint, validate, log remotely, collect garbage and stop.

    Args:
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        local_batch_size: samples per microbatch on one rank.
        dp_size: data-parallel ranks. ``grad_acc_steps = global_batch_size // (local_batch_size *
            dp_size)``, which must divide exactly.
        dataloader: yields microbatches; ``len()`` may fail (iterable datasets).
        ckpt_every_steps: checkpoint every N steps (the one save-cadence setting); None: no saves
            on a step cadence (the last step, epoch ends and stops still save).
        save_checkpoint_every_epoch: also checkpoint on the last step of every epoch.
        val_every_steps: validate every N steps (the one validation-cadence setting), and at the
            last step; None: at the last step only. Without validation data nothing validates.
        loss_average_window_steps: steps in the moving average ``state.metrics["loss_avg"]``.
        gc_every_steps: run ``gc.collect()`` every N steps with automatic GC off during training.
        start_step, start_epoch: where to start (steps and epochs already done).
        num_epochs, max_steps: run until either is reached; a missing one is derived from the other.
        exit_duration_in_mins: stop (final checkpoint, exit code 75) once this much wall time has
            passed since training started on any rank.
        exit_interval: stop (final checkpoint, exit code 75) after every step that is a multiple.
        stop_signals: signals that request a final checkpoint and a stop (exit code 75).
        resume_skip: when resuming into the middle of an epoch, drop the microbatches already used
            in it. None (default): only if the loader and its sampler have no ``state_dict`` (a
            stateful loader restores its own position).
    """

    Config = StepSchedulerConfig
    section = "step_scheduler"
    doc = "docs/step_scheduler.md"  # its page (a shipped handler: handlers/declarations.py)
    state_key = "step_scheduler"
    # Its position is the trainer's: after a rollback it follows without reloading.
    restore_on_rollback = False

    def __init__(
        self,
        global_batch_size: int,
        local_batch_size: int,
        dp_size: int,
        dataloader: Iterable | None,
        ckpt_every_steps: int | None = None,
        save_checkpoint_every_epoch: bool = True,
        val_every_steps: int | None = None,
        loss_average_window_steps: int = 50,
        gc_every_steps: int | None = None,
        start_step: int = 0,
        start_epoch: int = 0,
        num_epochs: int | None = None,
        max_steps: int | None = None,
        *,
        exit_duration_in_mins: float | None = None,
        exit_interval: int | None = None,
        stop_signals: SignalLike | Sequence[SignalLike] | None = ("SIGTERM",),
        resume_skip: bool | None = None,
    ) -> None:
        checked_settings(StepSchedulerConfig, locals())
        check_int("local_batch_size", local_batch_size)
        check_int("dp_size", dp_size)
        grad_acc_steps = grad_acc_steps_for(global_batch_size, local_batch_size, dp_size)
        check_bool("resume_skip", resume_skip, allow_none=True)
        if dataloader is not None and not isinstance(dataloader, Iterable):
            raise ConfigError(
                "dataloader", f"must be an iterable of microbatches, got {type(dataloader).__name__}"
            )

        self.grad_acc_steps, self.global_batch_size = grad_acc_steps, global_batch_size
        self.local_batch_size, self.dp_size, self.dataloader = local_batch_size, dp_size, dataloader
        length = data_length(dataloader) if dataloader is not None else None
        if length == 0:
            raise ConfigError("dataloader", "is empty (len() == 0); pass data with at least one microbatch")
        self.epoch_len: int | None = steps_in(length, self.grad_acc_steps)

        self.num_epochs, self.max_steps = derive_limits(num_epochs, max_steps, self.epoch_len)
        self.ckpt_every_steps = ckpt_every_steps
        self.save_checkpoint_every_epoch = save_checkpoint_every_epoch
        self.val_every_steps = val_every_steps
        self.loss_average_window_steps = loss_average_window_steps
        self.gc_every_steps = gc_every_steps
        self.exit_interval = exit_interval
        self.stop_signals = resolve_signals(stop_signals)
        self.exit_duration_in_mins = None if exit_duration_in_mins is None else float(exit_duration_in_mins)
        self.resume_skip = resume_skip
        self._epoch = check_position(start_step, start_epoch, self.epoch_len, "start_step", "start_epoch")
        self._step, self._pending_start = start_step, start_step > 0 or start_epoch > 0
        self._loss_window = RunningMean(loss_average_window_steps)
        self._loss_window_loaded = False
        self._gc_was_enabled: bool | None = None

    @classmethod
    def from_config(
        cls,
        cfg: StepSchedulerConfig,
        *,
        dataloader: Iterable | None,
        local_batch_size: int,
        dp_size: int = 1,
        resume_skip: bool | None = None,
    ) -> StepScheduler | None:
        """Build from the ``step_scheduler`` section, or None when ``cfg.enabled`` is false.

        ``dataloader``, ``local_batch_size`` (``train.local_batch_size``) and ``dp_size`` (the
        data-parallel world size) are known only at run time."""
        if not cfg.enabled:
            return None
        return cls(
            **section_settings(cfg),
            dataloader=dataloader,
            local_batch_size=local_batch_size,
            dp_size=dp_size,
            resume_skip=resume_skip,
        )

    # ------------------------------------------------------------------ counters
    @property
    def step(self) -> int:
        """The current step (1-based while it runs), i.e. the number of steps started so far."""
        if self.trainer is not None and not self._pending_start:
            return self.trainer.state.iteration
        return self._step

    @property
    def epoch(self) -> int:
        """0-based index of the current epoch = epochs completed before it."""
        return (
            self.trainer.plan.epoch if self.trainer is not None and not self._pending_start else self._epoch
        )

    def _every(self, n: int | None) -> bool:
        return every(n, self.step)

    # ------------------------------------------------------------------ predicates
    @property
    def is_last_batch(self) -> bool:
        """The current step is the last of its epoch (always False without an epoch length)."""
        return self.epoch_len is not None and self._every(self.epoch_len)

    @property
    def is_last_step(self) -> bool:
        """The current step is the run's last: the run plan's (``trainer.plan.is_last_step``)."""
        return self.trainer is not None and self.trainer.plan.is_last_step

    @property
    def is_exit_interval_step(self) -> bool:
        return self._every(self.exit_interval)

    def _save_reason(self, step: int | None = None, last: bool | None = None) -> str | None:
        """Which setting asks for this step's save (None: none does). ``step`` and ``last`` (whether
        it is the run's last): the current step's, when the caller has them already."""
        step = self.step if step is None else step
        if every(self.ckpt_every_steps, step):
            return f"step_scheduler.ckpt_every_steps={self.ckpt_every_steps}"
        if self.is_last_step if last is None else last:
            return "last step"
        if self.save_checkpoint_every_epoch and self.epoch_len is not None and every(self.epoch_len, step):
            return "step_scheduler.save_checkpoint_every_epoch"
        if every(self.exit_interval, step):
            return f"step_scheduler.exit_interval={self.exit_interval}"
        return None

    @property
    def is_ckpt_step(self) -> bool:
        """Every ``ckpt_every_steps``, the last step of an epoch (``save_checkpoint_every_epoch``),
        the last step, and an ``exit_interval`` step (a stop signal or the time limit asks on its
        own, :meth:`engine.run_end.RunEnd.stop_on`)."""
        return self._save_reason() is not None

    @property
    def is_val_step(self) -> bool:
        """Every ``val_every_steps`` and the last step (a stop signal or the exit duration withdraws
        it: time is short then, :meth:`engine.run_end.RunEnd.stop_on`)."""
        return self._every(self.val_every_steps) or self.is_last_step

    @property
    def is_gc_step(self) -> bool:
        return self._every(self.gc_every_steps)

    @property
    def sigterm_received(self) -> bool:
        """A stop signal reached some rank and every rank agreed on it (latches)."""
        return self.trainer is not None and self.trainer.run_end.stop_kind == "signal"

    def close(self) -> None:
        """Restore the GC setting this scheduler replaced."""
        if self._gc_was_enabled is not None:
            if self._gc_was_enabled:
                gc.enable()
            self._gc_was_enabled = None

    # ------------------------------------------------------------------ loss average
    def record_loss(self, loss: float) -> float:
        """Add one step's loss to the moving window; returns the window mean. Non-finite losses are
        left out so one bad step does not blank the curve for a whole window."""
        return self._loss_window.add(loss)

    @property
    def loss_avg(self) -> float:
        return self._loss_window.mean

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"step": steps done, "epoch": epochs done, "loss_window": the losses behind loss_avg}``;
        a checkpoint taken at the end of step k resumes at step k + 1 with the same cadence and the
        same running average."""
        step = self.step
        epoch = self.epoch
        if self.epoch_len is not None and step == (epoch + 1) * self.epoch_len:
            epoch += 1
        return {"step": int(step), "epoch": int(epoch), "loss_window": self._loss_window.values}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (``step``, ``epoch`` and, from newer checkpoints, ``loss_window``).
        Attached to a trainer whose state is fresh, the position moves into the trainer when
        training starts."""
        step, epoch = read_position(state, "StepScheduler")
        self._epoch = check_position(step, epoch, self.epoch_len, "state_dict['step']", "state_dict['epoch']")
        self._step = step
        self._pending_start = True
        window = state.get("loss_window")
        if window is not None:  # older checkpoints have none: the average restarts, as before
            self._loss_window.restore(float(v.item() if hasattr(v, "item") else v) for v in window)
        self._loss_window_loaded = window is not None

    # ------------------------------------------------------------------ as a handler
    def attach(self, trainer: Any) -> StepScheduler:
        """Drive ``trainer``: its accumulation, length and stops come from this scheduler; the
        requests for step k are on ``trainer.control``, and its place in the schedule on
        ``trainer.state``, from STEP_START of step k on."""
        if self.trainer is not None:
            raise RuntimeError("this StepScheduler is already attached to a trainer")
        why = f"global_batch_size {self.global_batch_size} / (local_batch_size {self.local_batch_size} x "
        why = f" ({why}dp_size {self.dp_size}))"
        trainer.plan.configure("StepScheduler", self.max_steps, self.num_epochs, self.grad_acc_steps, why)
        trainer.run_end.stop_on(self.stop_signals, self.exit_duration_in_mins)
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=SCHEDULE)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=SCHEDULE)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=EXIT_CHECK)
        trainer.add_event_handler(Events.TRAIN_END, self.close, priority=EXIT_CHECK)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_exception, priority=EXIT_CHECK)
        return super().attach(trainer)

    def _on_train_start(self) -> None:
        """The position given to the scheduler (start_step or load_state_dict) becomes the run
        plan's start position (:meth:`engine.run_limits.RunPlan.start_at`), with the microbatches
        of the epoch already used skipped unless the loader restores its own position."""
        trainer = self.trainer
        data = trainer.step_data.data if trainer.step_data is not None else None
        data_epoch_len = steps_in(data_length(data), self.grad_acc_steps)
        if data is not self.dataloader and data_epoch_len != self.epoch_len:
            raise ConfigError(
                "dataloader",
                f"trainer.run() got data with {data_epoch_len} steps per epoch but the StepScheduler was "
                f"built for {self.epoch_len}; run the trainer on the scheduler's dataloader",
            )
        if self._pending_start:
            self._pending_start = False
            args = (self._step, self._epoch, self.epoch_len, self.grad_acc_steps, data, self.resume_skip)
            trainer.plan.start_at(self._step, self._epoch, microbatches_to_skip(*args))
        if not self._loss_window_loaded:  # a checkpoint's window survives the next start
            self._loss_window.clear()
        self._loss_window_loaded = False
        if self.gc_every_steps is not None and self._gc_was_enabled is None:
            self._gc_was_enabled = gc.isenabled()
            gc.disable()

    def _on_step_start(self) -> None:
        # the predicates above, each read once (this runs every step)
        trainer = self.trainer
        step = self.step
        last = trainer.plan.is_last_step
        if every(self.gc_every_steps, step):
            gc.collect()
        reason = self._save_reason(step, last)
        if reason is not None:
            trainer.control.request_save(reason)
        if last or every(self.val_every_steps, step):
            trainer.control.request_validate()
        if every(self.exit_interval, step) and not last:
            reason = f"exit_interval={self.exit_interval} reached at step {step}"
            logger.info("stop requested at step %d: %s", step, reason)
            trainer.control.request_stop(reason, ExitCode.STOPPED)

    def _on_step_end(self) -> None:
        state = self.trainer.state
        self._loss_window.push(state.peek("loss"))  # a tensor stays unread until someone asks
        state.metrics["loss_avg"] = self._loss_window.lazy_mean()

    def _on_exception(self, _error: BaseException) -> None:
        self.close()
