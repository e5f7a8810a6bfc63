"""The trainer's state: counters and metrics handlers read, flags handlers use to ask.

Handlers *request* through flags; the trainer *decides* at fixed points. Reset rules:

=================  =====================================  ==========================================
flag               who sets it, when                      reset
=================  =====================================  ==========================================
skip_step          any handler, at BEFORE_OPTIMIZER_STEP  False before every STEP_START
should_checkpoint  scheduler at STEP_START, or anyone     False before every STEP_START
should_validate    scheduler at STEP_START, or anyone     False before every STEP_START
should_log_remote  scheduler at STEP_START                False before every STEP_START
is_last_step       scheduler at STEP_START                False before every STEP_START
should_stop        any handler, any time                  latches; cleared when a run starts
exit_code          whoever stops the run                  0 when a run starts
hold_checkpoints   a detector while steps are bad         set/cleared by its owner every step
=================  =====================================  ==========================================

What handlers tell each other about checkpoints (none imports another):

- ``known_good_step``: the newest step a detector judged good (None: none yet). A checkpointer
  never prunes the newest checkpoint at or before it whose saved state is finite.
- ``hold_checkpoints``: while true, a checkpointer starts and publishes no save (the state may be
  poisoned).
- ``rollback_target_step``: set by whoever fires ROLLBACK: restore the newest intact checkpoint
  at or before this step (None: the newest) whose saved parameters and optimizer state are finite.
- ``initial_checkpoint_requested``: a handler that may roll back asks for a step-0 checkpoint
  when a run starts fresh, so there is always something to roll back to.
- ``last_checkpoint``: the newest published checkpoint (a path), for ``exit_status.json``.

``skip_step`` and ``should_stop`` are agreed across data-parallel ranks by the trainer (if any
rank asks, every rank does it), so no rank steps or stops alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from ignite.engine.events import State

__all__ = ["TrainState"]

_PER_STEP_FLAGS = ("skip_step", "should_checkpoint", "should_validate", "should_log_remote", "is_last_step")


class _StepValue:
    """A number the step body may hold as a tensor: read to a Python number (one scalar read) only
    when something asks for it, then kept as that number. A step in which nobody reads the loss
    or the gradient norm never waits for the device to produce them."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = f"_{name}"

    def __get__(self, state: Any, owner: type | None = None) -> Any:
        if state is None:
            return self
        value = state.__dict__[self.key]
        if isinstance(value, torch.Tensor):
            value = value.item()
            state.__dict__[self.key] = value
        return value

    def __set__(self, state: Any, value: Any) -> None:
        state.__dict__[self.key] = value


@functools.cache
def _with_train_state(train_state: type, user_state: type) -> type:
    """A class that is both a TrainState and the user's own ``State`` subclass."""
    return type(user_state.__name__, (train_state, user_state), {"__module__": user_state.__module__})


class TrainState(State):
    """ignite's ``State`` plus what a training run needs.

    ``step`` is ignite's ``iteration``: optimizer steps completed, which equals the 1-based number
    of the current step from STEP_START on. Every ignite filter (``every=``) counts it.

    ``loss``, ``grad_norm``, ``microbatch_loss``, ``step_tokens`` and ``tokens_seen`` read as
    Python numbers but may be held as tensors until first read (:meth:`peek` gives the held value
    without reading it), so a step nobody inspects costs no host synchronisation.
    """

    loss = _StepValue()
    grad_norm = _StepValue()
    microbatch_loss = _StepValue()
    step_tokens = _StepValue()
    tokens_seen = _StepValue()

    def __init__(self, **kwargs: Any) -> None:
        self.reset_counters()
        self.should_stop = False
        self.stop_reason: str | None = None
        self.exit_code = 0
        # Set by a rollback requester while ROLLBACK fires: keep the data position (move past the
        # bad window) instead of restoring the checkpoint's.
        self.rollback_keep_data_position = False
        self.rollback_target_step: int | None = None
        self.known_good_step: int | None = None
        self.hold_checkpoints = False
        self.initial_checkpoint_requested = False
        self.last_checkpoint: str | None = None
        self.grad_scaler_overflow = False
        self.clear_step_flags()
        super().__init__(**kwargs)

    @classmethod
    def adopt(cls, state: Any) -> TrainState:
        """``state`` as a TrainState: a TrainState as it is; an ignite ``State`` (what ignite's docs
        and tests assign to ``engine.state``) becomes one in place, keeping its identity and its
        attributes, with the ones a trainer adds set to their defaults."""
        if isinstance(state, cls):
            return state
        if not isinstance(state, State):
            raise TypeError(
                f"engine.state must be an ignite State (or a hookloop TrainState), got {type(state).__name__}"
            )
        defaults = cls().__dict__
        state.__class__ = cls if type(state) is State else _with_train_state(cls, type(state))
        for key, value in defaults.items():
            state.__dict__.setdefault(key, value)
        return state

    def reset_counters(self) -> None:
        """Zero what a fresh run counts (ignite resets ``iteration`` and ``epoch`` itself)."""
        self.microbatch = 0
        self.microbatches_seen = 0
        self.loss = float("nan")
        self.microbatch_loss = float("nan")
        self.grad_norm = float("nan")
        self.lr = float("nan")
        self.tokens_seen = 0
        self.samples_seen = 0
        self.step_tokens = 0
        self.skipped_steps = 0
        self.validations = 0
        self.checkpoints_saved = 0
        self.rollbacks = 0

    def peek(self, name: str) -> Any:
        """The held value of a step value (``"loss"``, ``"grad_norm"``, ...) without reading a
        tensor to the host: a tensor stays a tensor (use it for device-side checks)."""
        if not isinstance(getattr(type(self), name, None), _StepValue):
            raise AttributeError(f"{name!r} is not a step value; read state.{name} directly")
        return self.__dict__[f"_{name}"]

    @property
    def step(self) -> int:
        return self.iteration

    @step.setter
    def step(self, value: int) -> None:
        self.iteration = value

    def clear_step_flags(self) -> None:
        for name in _PER_STEP_FLAGS:
            setattr(self, name, False)

    def request_stop(self, reason: str, exit_code: int | None = None) -> None:
        """Ask the trainer to stop after the current step (agreed across ranks at STEP_END)."""
        self.should_stop = True
        if self.stop_reason is None:
            self.stop_reason = reason
        if exit_code is not None and not self.exit_code:
            self.exit_code = int(exit_code)

    def counters(self) -> dict[str, Any]:
        """What a checkpoint must hold to continue the run: counters, not flags."""
        return {
            "step": self.iteration,
            "epoch": self.epoch,
            "microbatches_seen": self.microbatches_seen,
            "tokens_seen": self.tokens_seen,
            "samples_seen": self.samples_seen,
            "skipped_steps": self.skipped_steps,
            "validations": self.validations,
            "checkpoints_saved": self.checkpoints_saved,
            "rollbacks": self.rollbacks,
        }

    def load_counters(self, counters: dict[str, Any]) -> None:
        for key, value in counters.items():
            setattr(self, "iteration" if key == "step" else key, value)
