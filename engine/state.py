"""The trainer's state: counters and metrics handlers read.

The state holds information, never requests. What handlers ask of the loop (skip, save, validate,
stop, rollback) is requested on the trainer's control point, ``trainer.control``
(:class:`~engine.control.StepControl`, with its reset rules), and decided there in the step's
agreement; how the run ended is ``trainer.control.exit_code`` and ``trainer.control.stop_reason``
(``state.control`` reads the same object: the trainer owns it and binds it to its state).

Whether the current step is the run's last is the run plan's to say (``trainer.at_last_step``,
:mod:`engine.run_limits`), not a flag.

``last_checkpoint`` is a record, not a request: the newest checkpoint published (or resumed from),
for ``exit_status.json``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from ignite.engine.events import State

from hookloop.engine.control import StepControl

__all__ = ["StateAttribute", "TrainState"]


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
        self.last_checkpoint: str | None = None
        #: The step whose metrics a publishing handler put in ``metrics`` last; -1 once one
        #: publishes and before its first; None: nobody publishes (loggers log every step).
        self.metrics_step: int | None = None
        self.grad_scaler_overflow = False
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
    def control(self) -> StepControl | None:
        """``trainer.control``, to read how a run ended from the state ``run()`` returns; None
        before the state is bound to a trainer."""
        return self.__dict__.get("_control")

    @property
    def step(self) -> int:
        return self.iteration

    @step.setter
    def step(self, value: int) -> None:
        self.iteration = value

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


class StateAttribute:
    """The descriptor behind ``trainer.state``: an assigned ignite ``State`` becomes a
    :class:`TrainState` (:meth:`TrainState.adopt`) bound to ``trainer.control``. Only assignment is
    intercepted (no ``__get__``), so reading ``trainer.state`` costs what reading a plain attribute costs."""

    def __set__(self, trainer: Any, value: Any) -> None:
        state = TrainState.adopt(value)
        state.__dict__["_control"] = trainer.control  # created by the trainer before its first state
        trainer.__dict__["state"] = state
