"""NaNDetector: skip bad optimizer steps on every rank together, and roll back when they persist.

At BEFORE_OPTIMIZER_STEP each rank checks its own loss (and the gradient norm) for NaN/Inf on the
device, without reading them to the host, and optionally for a spike over the running median of
recent good losses (the one check that reads the loss). The verdict travels in the trainer's step
agreement (its one all-reduce per step): if any rank is bad, every rank vetoes the step, so no
rank steps alone. With fp16 loss scaling a non-finite gradient norm is the scaler's overflow, a
skipped step of its own, not a NaN.

``action``:

- ``"warn"``: log and veto the step.
- ``"raise"``: veto, and stop at the end of the first bad step (once its STEP_END handlers have
  recorded it) with :class:`~engine.TrainingAborted` (exit code ``ExitCode.NAN_ABORT``), naming the
  step.
- ``"rollback"``: veto; after ``max_consecutive`` bad steps in a row, ask for a rollback
  (``control.request_rollback``, from the agreed verdict): the trainer fires ``Events.ROLLBACK`` at
  the end of that step, once every STEP_END handler has seen it (the whole STEP_END firing sees the
  step that triggered the rollback, with its own number and loss; the ROLLBACK handlers and the
  next step see the restored state). A checkpointer answers it by
  restoring the newest intact checkpoint at or before the last step known good whose saved state
  is finite (model, optimizer, LR scheduler, handlers, RNG, trainer counters); with
  ``skip_data_on_rollback`` the data position is *not* restored, so training continues past the
  window that went bad instead of re-feeding it. If the restored state goes bad again before any
  good step, the next rollback goes to an older checkpoint: a bad update can leave finite losses
  for a step or two, so the newest "good" checkpoint may hold poisoned weights. After
  ``max_rollbacks`` rollbacks, or with no checkpoint old enough, the run stops with
  ``TrainingAborted`` (``ExitCode.NAN_ABORT``) and leaves the checkpoints untouched.

  The detector never talks to the checkpointer directly. What it knows about the state goes to the
  trainer's save policy (``trainer.save_policy``, :mod:`engine.save_policy`), which the
  checkpointer reads: while steps are bad it holds saves (``save_policy.hold_saves("nan_detector")``,
  released at the next good step or after the restore): nothing is saved or published during a
  bad streak; each good step is protected (``save_policy.protect(step, "nan_detector")``): the
  checkpointer never prunes the newest finite checkpoint at or before it; and it wants a step-0
  checkpoint when a run starts fresh (``save_policy.want_initial_save()``), so a NaN before the
  first save can roll back. What it asks of the loop goes to the trainer's control point
  (``trainer.control``, :mod:`engine.control`): the skip, and what a rollback restores with
  ``control.request_rollback(...)`` (and that a failed restore ends the run with
  ``ExitCode.NAN_ABORT``). It counts the rollback and logs it from its own ROLLBACK handlers: first
  of all (``ROLLBACK_COUNT``), and last, after the restore (``ROLLBACK_DONE``).

The detector's own counters survive a rollback (``restore_on_rollback = False``) and are saved in
checkpoints, so a resumed run keeps its rollback budget.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from typing import Any

import torch

from hookloop.engine import ConfigError, Events, ExitCode, Trainer, TrainingAborted
from hookloop.engine.checks import check_int
from hookloop.engine.events import Priority
from hookloop.engine.handler import Handler, checked_settings
from hookloop.engine.parallel import rank
from hookloop.handlers.sections.nan import NaNConfig

__all__ = ["NaNConfig", "NaNDetector"]

# Where the NaN detector runs, relative to the phases of an event (engine.Priority).
#: BEFORE_OPTIMIZER_STEP: this rank's verdict on its gradients, before user handlers that may veto.
NAN_CHECK = Priority.DECIDE - 900
#: TRAIN_START: choose where bad steps are skipped, once every handler is attached.
NAN_PATH = Priority.CLEANUP - 500
#: STEP_END: read the verdicts skipped on the device on a step that reads anyway, before the metrics
#: tracker publishes (OBSERVE + 50: its skipped_steps and lr are then current), the checkpointer
#: (ACT) and the loggers (RECORD).
NAN_SETTLE = Priority.OBSERVE + 75
#: TRAIN_END: the last verdicts read before anything reports the run.
NAN_SETTLE_END = Priority.CLOCK + 800
#: STEP_END: ask for a rollback once the loggers recorded the bad step.
ROLLBACK_REQUEST = Priority.RECORD - 900
#: ROLLBACK: count the rollback this detector asked for, before anything restores: the head of CLOCK
#: (it writes only its own counter and a log line, before the rollback's clock starts).
ROLLBACK_COUNT = Priority.CLOCK + 900
#: ROLLBACK: take the restored step, late in CLEANUP: after the checkpointer and every other shipped handler.
ROLLBACK_DONE = Priority.CLEANUP - 900

logger = logging.getLogger(__name__)

_MIN_SPIKE_HISTORY = 10
#: On the device path, verdicts are read at the latest after this many unread steps (a run that
#: neither logs nor saves for that long keeps a bounded list of them).
_MAX_UNREAD = 1000


def _number(value: Any) -> Any:
    """A host number of a loss or gradient norm (a tensor read: a bad step's, or a spike check's)."""
    return value.item() if isinstance(value, torch.Tensor) else value


# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


class NaNDetector(Handler):
    """Skip non-finite (or spiking) steps across ranks; roll back when they persist."""

    state_key = "nan_detector"
    restore_on_rollback = False
    Config = NaNConfig
    section = "nan"
    doc = "docs/nan_detector.md"  # its page (a shipped handler: handlers/declarations.py)

    def __init__(
        self,
        *,
        max_consecutive: int = 5,
        check_grad_norm: bool = True,
        action: str = "rollback",
        max_rollbacks: int = 3,
        skip_data_on_rollback: bool = True,
        spike_factor: float | None = None,
        spike_window: int = 100,
        bad_steps_kept: int = 1000,
    ) -> None:
        checked_settings(NaNConfig, locals(), "nan")
        check_int("bad_steps_kept", bad_steps_kept)
        self.max_consecutive = max_consecutive
        self.check_grad_norm = check_grad_norm
        self.action = action
        self.max_rollbacks = max_rollbacks
        self.skip_data_on_rollback = skip_data_on_rollback
        self.spike_factor = spike_factor
        self.consecutive = 0
        self.total = 0
        self.rollbacks = 0
        self.bad_steps: collections.deque[int] = collections.deque(maxlen=bad_steps_kept)
        self.last_good_step: int | None = None
        self._last_good_loss: Any = None  # the loss tensor of the last good step, read when asked
        self._window: collections.deque[float] = collections.deque(maxlen=spike_window)
        self._rollback_pending = False
        self._abort: str | None = None  # action "raise": why the run stops at this step's end
        self._verdict: Any = False
        #: This rank's own verdict on the latest step (a bool, or a 0-dim bool tensor not read to
        #: the host), before the agreement: what a rerun's result is compared with.
        self.verdict: Any = False
        self._asked: tuple[int, int] | None = None  # (bad step, target) of the rollback asked for
        self.restored_step: int | None = None
        #: Verdicts skipped on the device, not read yet: (step, agreed bad ranks, loss, grad norm).
        self._pending: list[tuple[int, torch.Tensor, Any, Any]] = []
        self._slot: Any = None
        self._tracker: Any = None  # the metrics tracker, whose log steps read the verdicts

    def attach(self, trainer: Trainer) -> NaNDetector:
        if self.action == "rollback":
            if not trainer.has_event_handler_for(Events.ROLLBACK):
                raise ConfigError(
                    "nan.action",
                    "'rollback' needs a checkpointer that answers Events.ROLLBACK: attach an "
                    "AsyncCheckpointer before the NaNDetector, or use action='warn' or 'raise'",
                )
            trainer.save_policy.want_initial_save()
        trainer.add_event_handler(Events.TRAIN_START, self._choose_path, priority=NAN_PATH)
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, self._check, priority=NAN_CHECK)
        self._slot = trainer.agreement.add("nan_detector.bad", self._local_verdict, self._on_verdict)
        trainer.add_event_handler(Events.STEP_END, self._settle_if_read, priority=NAN_SETTLE)
        trainer.add_event_handler(Events.TRAIN_END, self.settle, priority=NAN_SETTLE_END)
        trainer.add_event_handler(Events.STEP_END, self._maybe_roll_back, priority=ROLLBACK_REQUEST)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_start, priority=ROLLBACK_COUNT)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_done, priority=ROLLBACK_DONE)
        return super().attach(trainer)

    # ---------------------------------------------------------------- where the skip is decided
    @property
    def skips_on_device(self) -> bool:
        """Whether this run's bad steps are skipped on the device, the verdict read only when a step
        reads anyway (see the module docstring): the trainer can (``trainer.skips_on_device``), no
        spike check (it reads the loss every step) and ``action`` is not ``"raise"`` (it stops at
        the bad step itself)."""
        return self.action != "raise" and self.spike_factor is None and self.trainer.skips_on_device

    def _choose_path(self, trainer: Trainer) -> None:
        """TRAIN_START (every handler attached, the schedule built): the device path or the host's,
        and who says which steps are log steps (the metrics tracker, by its state key: handlers
        import no other handler; none: every step)."""
        self._slot.on_device = self.skips_on_device
        tracker = trainer.get_handler("metrics_tracker")
        self._tracker = tracker if callable(getattr(tracker, "publishes_now", None)) else None

    def _settle_if_read(self, trainer: Trainer) -> None:
        """STEP_END, before the metrics tracker publishes and anything saves or logs: on a step that
        reads anyway (a log step; with no tracker, every step; the run's last step), the verdicts
        skipped on the device are read and counted."""
        if not self._pending:
            return
        if self._tracker is None or self._tracker.publishes_now() or trainer.at_last_step:
            self.settle()

    def settle(self, *_: Any) -> None:
        """Read the verdicts skipped on the device since the last read (one transfer) and do what
        reading each at its step would have done: count, hold or release saves, protect the last
        good step, publish ``nan/*``, tell the trainer how many steps were skipped, and ask for a
        rollback when the run ends in ``max_consecutive`` bad steps. Anything that reads the
        detector's state or the save policy settles first."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        self.trainer.save_policy.defer(self.state_key, None)
        flags = pending[0][1].reshape(1) if len(pending) == 1 else torch.stack([p[1] for p in pending])
        verdicts = flags.tolist()
        self.trainer.count_device_skips(sum(1 for bad in verdicts if bad))
        for (step, _, loss, norm), bad_ranks in zip(pending, verdicts):
            self._judged(step, bad_ranks, loss, norm)

    # ---------------------------------------------------------------- checks
    def _is_spike(self, loss: float) -> bool:
        if self.spike_factor is None or len(self._window) < min(_MIN_SPIKE_HISTORY, self._window.maxlen or 1):
            return False
        median = statistics.median(self._window)
        return median > 0 and loss > self.spike_factor * median

    def _check(self, trainer: Trainer) -> None:
        """This rank's verdict, kept on the device: non-finite loss or gradient norm, or a spike."""
        state = trainer.state
        loss, norm = state.peek("loss"), state.peek("grad_norm")
        check_norm = self.check_grad_norm and trainer.grad_scaler is None
        if isinstance(loss, torch.Tensor):
            bad: Any = ~torch.isfinite(loss)
            if check_norm and isinstance(norm, torch.Tensor):
                bad = bad | ~torch.isfinite(norm)
        else:
            bad = not math.isfinite(loss) or (check_norm and not math.isfinite(norm))
        if self.spike_factor is not None and self._is_spike(state.loss):
            bad = True
        self._verdict = self.verdict = bad

    def _local_verdict(self) -> Any:
        verdict, self._verdict = self._verdict, False
        return verdict

    def judge(self, loss: float, grad_norm: float | None = None) -> str | None:
        """Why a step with this loss and gradient norm (host numbers; None: not measured) is bad,
        by the detector's rule, or None when it is good: what a rerun of a step is judged by."""
        if not math.isfinite(loss):
            return "non-finite loss"
        check_norm = self.check_grad_norm and self.trainer.grad_scaler is None
        if check_norm and grad_norm is not None and not math.isfinite(grad_norm):
            return "non-finite grad norm"
        if self._is_spike(loss):
            median = statistics.median(self._window)
            return f"loss spike ({loss:.4g} > {self.spike_factor} x median {median:.4g})"
        return None

    def _on_verdict(self, bad_ranks: Any) -> None:
        """After the step's agreement, on every rank alike: veto a bad step, count, hold saves. A
        tensor (the device path, nothing else read this step): the optimizer skips on the device
        where it is set, and the bookkeeping waits for the next step that reads (:meth:`settle`)."""
        state = self.trainer.state
        self._asked = None  # a rollback asked for at an earlier step is over (done, or it failed)
        if isinstance(bad_ranks, torch.Tensor):
            self.trainer.control.request_skip(on_device=bad_ranks)
            self._pending.append((state.step, bad_ranks, state.peek("loss"), state.peek("grad_norm")))
            self.trainer.save_policy.defer(self.state_key, self.settle)
            if len(self._pending) >= _MAX_UNREAD:
                self.settle()
            return
        self.settle()  # earlier steps' verdicts first, in order
        if bad_ranks:
            self.trainer.control.request_skip()
        self._judged(state.step, bad_ranks, state.peek("loss"), state.peek("grad_norm"))

    def _judged(self, step: int, bad_ranks: float, loss: Any, norm: Any) -> None:
        """Step ``step``'s agreed verdict (read), with its loss and gradient norm: count, hold or
        release saves, protect a good step, and note a rollback due or the stop of ``"raise"``."""
        state, policy = self.trainer.state, self.trainer.save_policy
        if not bad_ranks:
            self.consecutive = 0
            self._rollback_pending = False  # the streak ended by itself (read late): nothing to undo
            self.last_good_step, self._last_good_loss = step, loss
            if self.spike_factor is not None:
                self._window.append(_number(loss))
            policy.protect(step, by=self.state_key)
            policy.release_saves(by=self.state_key)
            self._publish(state)
            return
        loss, norm = _number(loss), _number(norm)
        reason = self.judge(loss, norm) or "bad on another rank"
        if self.action != "warn":  # the state may be poisoned: nothing saved until it is good
            policy.hold_saves(by=self.state_key)
        self.consecutive += 1
        self.total += 1
        self.bad_steps.append(step)
        logger.warning(
            "rank %d step %d: %s (loss %s, grad norm %s); step skipped on every rank (%d in a row)",
            rank(),
            step,
            reason,
            loss,
            norm,
            self.consecutive,
        )
        self._publish(state)
        if self.action == "raise":  # at STEP_END: the loggers record the step, a rerun attributes it
            self._abort = f"step {step}: {reason} (nan.action='raise')"
        if self.action == "rollback" and self.consecutive >= self.max_consecutive:
            self._rollback_pending = True

    @property
    def last_good_loss(self) -> float | None:
        """The loss of the last step judged good (None: none yet)."""
        self.settle()
        if isinstance(self._last_good_loss, torch.Tensor):
            self._last_good_loss = self._last_good_loss.item()
        return self._last_good_loss

    def _maybe_roll_back(self, trainer: Trainer) -> None:
        """Late at STEP_END (every logger has recorded the bad step): give up, or ask the trainer
        for the rollback, which it carries out once every STEP_END handler of this step has seen
        the bad step. ``_rollback_pending`` was set from the agreed verdict: every rank asks alike.
        With ``action="raise"`` the run stops here instead."""
        if self._abort is not None:
            message, self._abort = self._abort, None
            raise TrainingAborted(message, ExitCode.NAN_ABORT)
        if not self._rollback_pending:
            return
        self._rollback_pending = False
        state = trainer.state
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingAborted(
                f"step {state.step}: {self.consecutive} bad steps in a row after {self.rollbacks} rollbacks "
                f"(nan.max_rollbacks={self.max_rollbacks}); giving up, checkpoints left as they are",
                ExitCode.NAN_ABORT,
            )
        self._asked = (state.step, self._rollback_target())
        trainer.control.request_rollback(
            self._asked[1],
            keep_data_position=self.skip_data_on_rollback,
            reason="nan.action='rollback'",
            exit_code=ExitCode.NAN_ABORT,
        )

    def _on_rollback_start(self, trainer: Trainer) -> None:
        """First at the ROLLBACK the trainer fires for this detector's request: count it."""
        self.settle()  # verdicts still on the device belong to the steps before the restore
        if self._asked is None:  # a ROLLBACK someone else asked for
            return
        bad_step, target = self._asked
        self.rollbacks += 1
        self.consecutive = 0
        logger.warning(
            "step %d: %d bad steps in a row; rolling back to the newest checkpoint at or before step %d "
            "(rollback %d of %d)",
            bad_step,
            self.max_consecutive,
            target,
            self.rollbacks,
            self.max_rollbacks,
        )

    def _on_rollback_done(self, trainer: Trainer) -> None:
        """Last at ROLLBACK (the checkpointer restored, every other handler saw it): the restored
        step, saves allowed again."""
        if self._asked is None:
            return
        bad_step, self._asked = self._asked[0], None
        state = trainer.state
        self.restored_step = state.step
        trainer.save_policy.release_saves(by=self.state_key)
        logger.warning("rolled back from step %d to step %d", bad_step, state.step)
        self._publish(state)

    def _rollback_target(self) -> int:
        """The newest step a restore may go to: the last good step, or, when the last restore went
        bad again before any good step, a step older than that restore."""
        good = self.last_good_step if self.last_good_step is not None else 0
        if self.restored_step is not None and good <= self.restored_step:
            return max(0, self.restored_step - 1)
        return good

    def _publish(self, state: Any) -> None:
        state.metrics["nan/bad_steps"] = self.total
        state.metrics["nan/consecutive"] = self.consecutive
        state.metrics["nan/rollbacks"] = self.rollbacks

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return {
            "consecutive": self.consecutive,
            "total": self.total,
            "rollbacks": self.rollbacks,
            "bad_steps": list(self.bad_steps),
            "last_good_step": self.last_good_step,
            "last_good_loss": self.last_good_loss,
            "window": list(self._window),
            "restored_step": self.restored_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending.clear()  # verdicts of steps a restore undid (a rollback settled first)
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            trainer.save_policy.defer(self.state_key, None)
        self.consecutive = int(state["consecutive"])
        self.total = int(state["total"])
        self.rollbacks = int(state["rollbacks"])
        self.bad_steps.clear()
        self.bad_steps.extend(state["bad_steps"])
        self.last_good_step = state["last_good_step"]
        self._last_good_loss = state["last_good_loss"]
        self._window.clear()
        self._window.extend(state["window"])
        self.restored_step = state.get("restored_step")
