"""The StepScheduler decides *when*: steps, epochs, and the cadence of checkpoints, validation
and garbage collection (one setting each, counted by :func:`engine.events.every`), plus the exits
a long job needs (stop signals, ``exit_duration_in_mins``, ``exit_interval``).

One step numbering everywhere: during step ``k`` (1-based, ``trainer.state.step == k``, or
``scheduler.step == k`` when iterating the scheduler yourself) ``is_ckpt_step`` is true when ``k``
is a multiple of ``ckpt_every_steps``, ``is_val_step`` when ``k`` is a multiple of
``val_every_steps`` (or the last step), and so on. ``epoch`` is the 0-based index of the current
epoch, which is also the number of epochs completed before it.

Two ways to use it:

* Standalone (as in NeMo AutoModel): ``for epoch in s.epochs: for microbatches in s: ...``; each
  item is a list of ``grad_acc_steps`` microbatches (shorter at the end of an epoch) and the
  predicates describe the step being run.
* As a handler: ``s.attach(trainer)`` then ``trainer.run(dataloader)``. The scheduler sets the
  trainer's ``grad_accum_steps``, ``max_steps`` and ``max_epochs``. At STEP_START it *requests* what
  its schedule wants of the step on the trainer's control point (``trainer.control``): its
  checkpoint steps as ``request_save(by)`` (saying which setting asked), its validation steps as
  ``request_validate()``; the trainer decides them in the step's agreement, like any handler's
  requests. It *publishes* ``is_last_step`` on ``trainer.state`` (the trainer's ``at_last_step``
  reads it): information, the same on every rank, not a request. Stop signals and time limits
  become a final checkpoint request plus a stop request on ``trainer.control``, agreed like any
  other, with :attr:`engine.ExitCode.STOPPED` (and the step's validation withdrawn: time is short).
"""

from __future__ import annotations

import gc
import logging
import math
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hookloop.engine import parallel
from hookloop.engine.checks import check_bool, check_int, check_number, dotted
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler import Handler, checked_settings, section_settings
from hookloop.engine.running_mean import RunningMean
from hookloop.engine.step_batches import data_length, iter_groups, steps_in

__all__ = ["StepScheduler", "StepSchedulerConfig", "grad_acc_steps_for"]

# Where the step scheduler runs, relative to the phases of an event (engine.Priority).
#: TRAIN_START / EPOCH_START / STEP_START / EPOCH_END: limits, cadence, this step's flags.
SCHEDULE = Priority.DECIDE
#: STEP_END: the loss-average window, before the metrics are published; TRAIN_END / TRAIN_FAILED:
#: restore signal handlers and GC.
EXIT_CHECK = Priority.OBSERVE + 100

# OmegaConf resolves the config section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045

logger = logging.getLogger(__name__)

_SignalLike = str | int | signal.Signals


def _calculate_max_steps(num_epochs: int, epoch_len: int | None, default_max_steps: int = 2**63 - 1) -> int:
    """``num_epochs * epoch_len``; ``default_max_steps`` when the epoch length is unknown."""
    if epoch_len is None:
        return default_max_steps
    return num_epochs * epoch_len


def _calculate_num_epochs(max_steps: int | None, epoch_len: int | None, default_num_epochs: int = 10) -> int:
    """Epochs needed to reach ``max_steps``; ``default_num_epochs`` when either is unknown."""
    if max_steps is None or epoch_len is None:
        return default_num_epochs
    return math.ceil(max_steps / epoch_len)


def _resolve_signals(
    value: _SignalLike | Sequence[_SignalLike] | None, field: str = "stop_signals"
) -> tuple[signal.Signals, ...]:
    """Signal names ("SIGTERM"), numbers or members -> members; None or empty -> none. The one
    rule for ``stop_signals``: catchable signals only; errors name ``field``."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, int, signal.Signals)) else list(value)
    out: list[signal.Signals] = []
    for item in items:
        try:
            if isinstance(item, str):
                sig = signal.Signals[item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()]
            elif isinstance(item, int) and not isinstance(item, bool):
                sig = signal.Signals(item)
            else:
                raise TypeError
        except (KeyError, ValueError, TypeError):
            raise ConfigError(
                field, f"{item!r} is not a signal; use names such as 'SIGTERM' or 'SIGUSR1'"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(field, f"{sig.name} cannot be caught; use SIGTERM, SIGUSR1 or SIGUSR2")
        if sig not in out:
            out.append(sig)
    return tuple(out)


def grad_acc_steps_for(
    global_batch_size: int,
    local_batch_size: int,
    dp_size: int,
    *,
    field: str = "global_batch_size",
    local_field: str = "local_batch_size",
) -> int:
    """Microbatches per optimizer step, ``global_batch_size // (local_batch_size * dp_size)``; the
    one rule that it must divide exactly (the run config checks it with the world size too)."""
    per_microbatch = local_batch_size * dp_size
    if global_batch_size % per_microbatch:
        lower = max(per_microbatch, global_batch_size // per_microbatch * per_microbatch)
        raise ConfigError(
            field,
            f"({global_batch_size}) must be a multiple of {local_field} x data-parallel size "
            f"({local_batch_size} x {dp_size} = {per_microbatch}); use a multiple such as {lower} or "
            f"change {local_field}",
        )
    return global_batch_size // per_microbatch


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
        _resolve_signals(self.stop_signals, dotted(p, "stop_signals"))


def _restores_own_position(data: Any) -> bool:
    """A loader (or its sampler) with ``state_dict`` is assumed to restore its own position."""
    return any(
        hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
        for obj in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None))
        if obj is not None
    )


class StepScheduler(Handler):
    """When to step, checkpoint, validate, collect garbage and stop.

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

    asks_after_agreement = False  # late decisions only from values every rank shares

    Config = StepSchedulerConfig
    section = "step_scheduler"
    state_key = "step_scheduler"
    # Its position is the trainer's (step and epoch): a rollback moves the trainer back, and the
    # scheduler follows without reloading, so the cadence after a rollback is the same as without,
    # and a stop signal received before the rollback still stands.
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
        stop_signals: _SignalLike | Sequence[_SignalLike] | None = ("SIGTERM",),
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

        self.grad_acc_steps = grad_acc_steps
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_size = dp_size
        self.dataloader = dataloader
        length = data_length(dataloader) if dataloader is not None else None
        if length == 0:
            raise ConfigError("dataloader", "is empty (len() == 0); pass data with at least one microbatch")
        self.epoch_len: int | None = steps_in(length, self.grad_acc_steps)

        if num_epochs is None:
            num_epochs = _calculate_num_epochs(max_steps, self.epoch_len)
        if max_steps is None:
            if self.epoch_len is None:
                raise ConfigError(
                    "max_steps",
                    "is required when the dataloader has no length (an iterable dataset): set max_steps",
                )
            max_steps = _calculate_max_steps(num_epochs, self.epoch_len)
        self.num_epochs: int = num_epochs
        self.max_steps: int = max_steps
        self.ckpt_every_steps = ckpt_every_steps
        self.save_checkpoint_every_epoch = save_checkpoint_every_epoch
        self.val_every_steps = val_every_steps
        self.loss_average_window_steps = loss_average_window_steps
        self.gc_every_steps = gc_every_steps
        self.exit_duration_in_mins = None if exit_duration_in_mins is None else float(exit_duration_in_mins)
        self.exit_interval = exit_interval
        self.stop_signals = _resolve_signals(stop_signals)
        self.resume_skip = resume_skip

        start_epoch = self._check_position(start_step, start_epoch, "start_step", "start_epoch")
        self._step = start_step
        self._epoch = start_epoch
        self._pending_start = start_step > 0 or start_epoch > 0

        self._in_epoch = False
        self._loss_window = RunningMean(loss_average_window_steps)
        self._loss_window_loaded = False  # a checkpoint's window survives the next start
        self._exit_kind: str | None = None  # "signal", "duration" or "interval" once agreed
        self._exit_reason: str | None = None
        self._polled_step: int | None = None
        self._signal_seen: signal.Signals | None = None
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._start_time: float | None = None
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
        if self.trainer is not None and not self._pending_start:
            epoch = self.trainer.state.epoch
            return epoch - 1 if self._in_epoch else epoch
        return self._epoch

    def _every(self, n: int | None) -> bool:
        return every(n, self.step)

    def _check_position(self, step: int, epoch: int, step_name: str, epoch_name: str) -> int:
        """With a known epoch length, ``step`` must lie in epoch ``epoch``; returns the epoch,
        moved past an epoch that ``step`` completes exactly."""
        if self.epoch_len is None:
            return epoch
        first = epoch * self.epoch_len
        if step == first + self.epoch_len:
            return epoch + 1
        if not first <= step < first + self.epoch_len:
            raise ConfigError(
                step_name,
                f"step {step} is not in epoch {epoch} ({self.epoch_len} steps per epoch: steps {first} to "
                f"{first + self.epoch_len}); pass {epoch_name}={step // self.epoch_len} with it",
            )
        return epoch

    # ------------------------------------------------------------------ predicates
    @property
    def is_last_batch(self) -> bool:
        """The current step is the last of its epoch (always False without an epoch length)."""
        return self.epoch_len is not None and self._every(self.epoch_len)

    @property
    def is_last_step(self) -> bool:
        """The current step is the last that will run: ``max_steps`` reached, or the last batch of
        the last epoch (e.g. max_steps=100 with 60 steps of data: step 60)."""
        if self.step >= self.max_steps:
            return True
        return self.epoch + 1 >= self.num_epochs and self.is_last_batch

    @property
    def is_exit_interval_step(self) -> bool:
        return self._every(self.exit_interval)

    def _save_reason(self) -> str:
        """Who asks for this step's save: the cadence, the epoch's end, the last step or a stop."""
        if self._every(self.ckpt_every_steps):
            return f"step_scheduler.ckpt_every_steps={self.ckpt_every_steps}"
        if self.is_last_step:
            return "last step"
        if self.save_checkpoint_every_epoch and self.is_last_batch:
            return "step_scheduler.save_checkpoint_every_epoch"
        if self.is_exit_interval_step:
            return f"step_scheduler.exit_interval={self.exit_interval}"
        return f"stop: {self._exit_reason}"

    @property
    def is_ckpt_step(self) -> bool:
        """Every ``ckpt_every_steps``, the last step of an epoch (``save_checkpoint_every_epoch``),
        the last step, and the step a stop (signal, exit duration, exit interval) happens on."""
        return (
            self._every(self.ckpt_every_steps)
            or (self.save_checkpoint_every_epoch and self.is_last_batch)
            or self.is_last_step
            or self.is_exit_interval_step
            or self._stopping()
        )

    @property
    def is_val_step(self) -> bool:
        """Every ``val_every_steps`` and the last step; never on a step that stops on a signal or
        the exit duration (time is short then)."""
        wanted = self._every(self.val_every_steps) or self.is_last_step
        return wanted and not (self._stopping() and self._exit_kind in ("signal", "duration"))

    @property
    def is_gc_step(self) -> bool:
        return self._every(self.gc_every_steps)

    @property
    def sigterm_received(self) -> bool:
        """A stop signal reached some rank and every rank agreed on it (latches)."""
        self._stopping()
        return self._exit_kind == "signal"

    @property
    def exit_reason(self) -> str | None:
        """Why the run stops early (signal, exit duration, exit interval), or None."""
        return self._exit_reason

    def _stopping(self) -> bool:
        # Standalone, the agreement is polled here (every rank runs the same loop, so every rank
        # polls once per step); attached, only the STEP_END handler polls and this reads the latch.
        if self.trainer is None:
            self._poll_exit(parallel.agree_any)
        return self._exit_kind in ("signal", "duration")

    # ------------------------------------------------------------------ exits
    def _poll_exit(self, agree: Any) -> None:
        """Agree stop signals and the exit duration across ranks, at most once per step (standalone;
        attached, the two travel in the trainer's step agreement instead)."""
        step = self.step
        if self._polled_step == step or self._exit_kind in ("signal", "duration"):
            return
        self._polled_step = step
        if self.stop_signals and agree(self._signal_seen is not None):
            self._latch_signal()
        elif self.exit_duration_in_mins is not None and agree(self._duration_reached()):
            self._latch_duration()

    def _duration_reached(self) -> bool:
        if self.exit_duration_in_mins is None or self._start_time is None:
            return False
        return (time.monotonic() - self._start_time) / 60.0 >= self.exit_duration_in_mins

    def _latch_signal(self) -> None:
        if self._signal_seen is not None:
            name = self._signal_seen.name
        elif len(self.stop_signals) == 1:
            name = self.stop_signals[0].name
        else:
            name = "on another rank"
        self._latch("signal", f"signal {name}")

    def _latch_duration(self) -> None:
        elapsed = (
            (time.monotonic() - self._start_time) / 60.0 if self._start_time is not None else float("nan")
        )
        self._latch(
            "duration",
            f"exit_duration_in_mins={self.exit_duration_in_mins:g} reached ({elapsed:.2f} min on this rank)",
        )

    def _signal_vote(self) -> bool:
        return self._exit_kind not in ("signal", "duration") and self._signal_seen is not None

    def _duration_vote(self) -> bool:
        return self._exit_kind not in ("signal", "duration") and self._duration_reached()

    def _on_agreed_exit(self, kind: str, ranks: float) -> None:
        """After the step's agreement, on every rank alike: a stop signal or the time limit seen by
        any rank stops every rank after this step, with a final checkpoint and exit code 75."""
        if not ranks or self._exit_kind in ("signal", "duration"):
            return
        self._latch_signal() if kind == "signal" else self._latch_duration()
        state, control = self.trainer.state, self.trainer.control
        control.request_save(f"stop: {self._exit_reason}")
        control.withdraw_validate()  # agreed values: every rank withdraws alike
        if not state.is_last_step:  # a run that ends here anyway ends as a finished run
            control.request_stop(self._exit_reason, ExitCode.STOPPED)

    def _latch(self, kind: str, reason: str) -> None:
        self._exit_kind, self._exit_reason = kind, reason
        logger.info("stop requested at step %d: %s", self.step, reason)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        # Only a flag: the decision is taken at a step boundary, agreed by every rank.
        self._signal_seen = signal.Signals(signum)

    def _install_signals(self) -> None:
        if not self.stop_signals or self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: stop signals %s are not handled", self.stop_signals)
            return
        for sig in self.stop_signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def _reset_run(self) -> None:
        self._exit_kind = self._exit_reason = None
        self._polled_step = None
        self._signal_seen = None
        if not self._loss_window_loaded:
            self._loss_window.clear()
        self._loss_window_loaded = False
        self._start_time = time.monotonic()

    def close(self) -> None:
        """Restore the signal handlers (and GC setting) this scheduler replaced."""
        self._restore_signals()
        if self._gc_was_enabled is not None:
            if self._gc_was_enabled:
                gc.enable()
            self._gc_was_enabled = None

    def __enter__(self) -> StepScheduler:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loss average
    def record_loss(self, loss: float) -> float:
        """Add one step's loss to the moving window; returns the window mean. Non-finite losses are
        left out so one bad step does not blank the curve for a whole window."""
        return self._loss_window.add(loss)

    @property
    def loss_avg(self) -> float:
        return self._loss_window.mean

    # ------------------------------------------------------------------ standalone iteration
    def _standalone(self, what: str) -> None:
        if self.trainer is not None:
            raise RuntimeError(
                f"this StepScheduler is attached to a trainer: {what} is for standalone use; "
                "call trainer.run(dataloader) instead"
            )
        if self.dataloader is None:
            raise RuntimeError(f"{what} needs a dataloader: pass one to StepScheduler(dataloader=...)")
        if self._start_time is None:
            self._reset_run()
            self._install_signals()

    def _done(self) -> bool:
        if self.step >= self.max_steps or self._stopping():
            return True
        if self.is_exit_interval_step and self._exit_kind is None:
            self._latch("interval", f"exit_interval={self.exit_interval} reached at step {self.step}")
        return self._exit_kind is not None

    def _skip_for_resume(self) -> int:
        """Microbatches to drop at the start of this pass when resuming into an epoch."""
        if not self._pending_start:
            return 0
        self._pending_start = False
        if self.epoch_len is None:
            return 0
        into = self._step - self._epoch * self.epoch_len
        return into * self.grad_acc_steps if self._skips_on_resume(self.dataloader) and into > 0 else 0

    def _skips_on_resume(self, data: Any) -> bool:
        return self.resume_skip if self.resume_skip is not None else not _restores_own_position(data)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, and tell the loader (or its sampler) so it reshuffles."""
        self._epoch = epoch
        for obj in (self.dataloader, getattr(self.dataloader, "sampler", None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                break

    def __iter__(self) -> Iterator[list]:
        """Lists of ``grad_acc_steps`` microbatches for one pass over the data (a shorter list at
        the end). ``step`` is the number of the yielded step while its body runs. Stops at
        ``max_steps``, on an agreed stop signal, the exit duration or an exit-interval step."""
        self._standalone("iterating the scheduler")
        return self._iterate()

    def _iterate(self) -> Iterator[list]:
        if self._done():
            return
        skip = self._skip_for_resume()
        self.set_epoch(self._epoch)
        it = iter(self.dataloader)  # type: ignore[arg-type]
        for _ in range(skip):
            next(it, None)
        yielded = False
        for group in iter_groups(it, self.grad_acc_steps):
            self._step += 1
            yielded = True
            yield group
            # a shorter group ends the pass: the stop check happens before the next epoch's first step
            if len(group) == self.grad_acc_steps and self._done():
                if self.is_last_batch:  # the pass ended exactly here
                    self._epoch += 1
                return
        if not yielded and not skip:
            raise ValueError("the dataloader yielded no microbatches in this epoch: pass non-empty data")
        self._epoch += 1

    @property
    def epochs(self) -> Iterator[int]:
        """The epochs left to run (0-based), stopping early once ``max_steps`` is reached or a stop
        was agreed. Restores the signal handlers when exhausted."""
        self._standalone("epochs")
        return self._epochs()

    def _epochs(self) -> Iterator[int]:
        try:
            for e in range(self._epoch, self.num_epochs):
                if self.step >= self.max_steps or self._exit_kind is not None:
                    return
                self._epoch = e
                yield e
        finally:
            self._restore_signals()

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
        if not isinstance(state, Mapping):
            raise ValueError(
                "a StepScheduler state must be a mapping with 'step' and 'epoch', got "
                f"{type(state).__name__}: pass what StepScheduler.state_dict() returned"
            )
        missing = [key for key in ("step", "epoch") if key not in state]
        if missing:
            raise ValueError(
                f"the StepScheduler state has no {' or '.join(map(repr, missing))} "
                f"(it has {sorted(map(str, state))}); a state needs 'step' and 'epoch': pass what "
                "StepScheduler.state_dict() returned"
            )
        step, epoch = state["step"], state["epoch"]
        step = int(step.item() if hasattr(step, "item") else step)
        epoch = int(epoch.item() if hasattr(epoch, "item") else epoch)
        check_int("state_dict['step']", step, low=0)
        check_int("state_dict['epoch']", epoch, low=0)
        self._epoch = self._check_position(step, epoch, "state_dict['step']", "state_dict['epoch']")
        self._step = step
        self._pending_start = True
        self._polled_step = None
        self._exit_kind = self._exit_reason = None
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
        # 1 is the trainer's default: anything else was asked for and must not be silently replaced
        if trainer.grad_accum_steps not in (1, self.grad_acc_steps):
            raise ConfigError(
                "grad_accum_steps",
                f"the trainer was built with grad_accum_steps={trainer.grad_accum_steps} but its "
                f"StepScheduler computes {self.grad_acc_steps} (global_batch_size {self.global_batch_size} "
                f"/ (local_batch_size {self.local_batch_size} x dp_size {self.dp_size})); drop "
                "grad_accum_steps from Trainer(...) and set global_batch_size on the StepScheduler",
            )
        trainer.grad_accum_steps = self.grad_acc_steps
        trainer.max_steps = self.max_steps
        trainer.max_epochs = self.num_epochs
        # Requests are made before user STEP_START handlers run; the exit check at STEP_END
        # runs before the trainer's validation, so a stop can cancel that validation.
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=SCHEDULE)
        trainer.add_event_handler(Events.EPOCH_START, self._on_epoch_start, priority=SCHEDULE)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=SCHEDULE)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=EXIT_CHECK)
        if self.stop_signals:
            trainer.agreement.add(
                "step_scheduler.signal", self._signal_vote, lambda n: self._on_agreed_exit("signal", n)
            )
        if self.exit_duration_in_mins is not None:
            trainer.agreement.add(
                "step_scheduler.duration", self._duration_vote, lambda n: self._on_agreed_exit("duration", n)
            )
        trainer.add_event_handler(Events.EPOCH_END, self._on_epoch_end, priority=SCHEDULE)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=EXIT_CHECK)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_exception, priority=EXIT_CHECK)
        return super().attach(trainer)

    def _check_trainer(self) -> None:
        trainer = self.trainer
        run_steps, run_epochs = trainer.limits
        for name, mine, theirs in (
            ("max_steps", self.max_steps, run_steps),
            ("max_epochs", self.num_epochs, run_epochs),
            ("grad_accum_steps", self.grad_acc_steps, trainer.grad_accum_steps),
        ):
            if mine != theirs:
                raise ConfigError(
                    name,
                    f"the trainer has {name}={theirs} but its StepScheduler says {mine}; set it on the "
                    "StepScheduler and call trainer.run(data) without it",
                )
        data = trainer.step_data.data if trainer.step_data is not None else None
        data_epoch_len = steps_in(data_length(data), self.grad_acc_steps)
        if data is not self.dataloader and data_epoch_len != self.epoch_len:
            raise ConfigError(
                "dataloader",
                f"trainer.run() got data with {data_epoch_len} steps per epoch but the StepScheduler was "
                f"built for {self.epoch_len}; run the trainer on the scheduler's dataloader",
            )

    def _move_start_into_trainer(self) -> None:
        """A position given to the scheduler (start_step or load_state_dict) before training starts.

        A fresh trainer is moved there (and told how many microbatches to skip). A trainer that was
        restored to the same step by a checkpoint handler (which runs earlier at TRAIN_START) keeps
        its data position; only its epoch is set to the epochs *completed*, since the loop adds one
        when the next epoch starts.
        """
        trainer, state = self.trainer, self.trainer.state
        pending, self._pending_start = self._pending_start, False
        if not pending:
            return
        if state.iteration == self._step and self._step > 0:
            state.epoch = self._epoch
            return
        if state.iteration != 0:
            logger.warning(
                "trainer already at step %d: StepScheduler start position (step %d, epoch %d) ignored",
                state.iteration,
                self._step,
                self._epoch,
            )
            return
        state.iteration, state.epoch = self._step, self._epoch
        if self.epoch_len is not None:
            into = self._step - self._epoch * self.epoch_len
            if self._skips_on_resume(trainer.step_data.data) and into > 0:
                trainer.step_data.skip_next = into * self.grad_acc_steps
        logger.info("starting at step %d, epoch %d", self._step, self._epoch)

    def _on_train_start(self) -> None:
        self._check_trainer()
        self._move_start_into_trainer()
        self._in_epoch = False
        self._reset_run()
        if self.gc_every_steps is not None and self._gc_was_enabled is None:
            self._gc_was_enabled = gc.isenabled()
            gc.disable()
        self._install_signals()

    def _on_epoch_start(self) -> None:
        self._in_epoch = True

    def _on_epoch_end(self) -> None:
        self._in_epoch = False

    def _on_step_start(self) -> None:
        state = self.trainer.state
        if self.is_gc_step:
            gc.collect()
        if self.is_ckpt_step:
            self.trainer.control.request_save(self._save_reason())
        if self.is_val_step:
            self.trainer.control.request_validate()
        last = self.is_last_step
        state.is_last_step = state.is_last_step or last
        if self.is_exit_interval_step and not last:
            self._latch("interval", f"exit_interval={self.exit_interval} reached at step {self.step}")
            self.trainer.control.request_stop(self._exit_reason, ExitCode.STOPPED)

    def _on_step_end(self) -> None:
        state = self.trainer.state
        self._loss_window.push(state.peek("loss"))  # a tensor stays unread until someone asks
        state.metrics["loss_avg"] = self._loss_window.lazy_mean()

    def _on_train_end(self) -> None:
        self.close()

    def _on_exception(self, _error: BaseException) -> None:
        self.close()
