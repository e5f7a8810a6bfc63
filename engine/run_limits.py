"""The limits of one ``Trainer.run()``: ignite's argument checks and state set-up, with steps.

ignite's ``Engine.run`` checks its arguments and sets up the state (a new run, or one to continue)
before its loop. The trainer keeps ignite's rules and words but adds a step limit that combines
with an epoch limit (``max_steps=N, max_epochs=M``: whichever comes first), default limits a
scheduling handler sets (``trainer.max_steps`` / ``trainer.max_epochs``) and microbatches grouped
into steps, so it sets the state up here and then starts ignite's loop
(:meth:`engine.ignite_adapter.IgniteAdapter.start_loop`). Where ignite's own check says the same
(a limit not below the progress reached) it is ignite's check that runs, through the adapter's
``extend_max_epochs`` / ``extend_max_iters``.

Two bounds on a run's epochs are checked at each epoch's end (:class:`EpochBounds`, the trainer's
last EPOCH_END handler): a run given both limits keeps its own ``max_epochs`` once ignite learns
the epoch length, and a run limited by steps alone stops after two epochs in a row start no step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hookloop.engine.errors import ConfigError
from hookloop.engine.step_batches import NO_DATA, StepBatches, data_length

__all__ = ["EpochBounds", "check_limit_kind", "check_run_arguments", "set_up_run"]


def check_run_arguments(
    data: Any,
    max_epochs: int | None,
    max_iters: int | None,
    epoch_length: int | None,
    max_steps: int | None,
) -> tuple[int | None, str]:
    """ignite's checks of ``run()``'s arguments, in ignite's order and words (with what to do in
    hookloop). Returns the step limit and the name it was given under (``max_iters`` is
    ``max_steps`` under ignite's rules: not together with ``max_epochs``)."""
    if data is not None and not isinstance(data, Iterable):
        raise TypeError(
            f"Argument data should be iterable: an iterable of microbatches (or None with epoch_length), "
            f"got {type(data).__name__}"
        )
    if max_epochs is not None and max_iters is not None:
        raise ValueError(
            "Arguments max_iters and max_epochs are mutually exclusive. Please provide only max_epochs "
            "or max_iters. (To end at whichever comes first, pass max_steps=N with max_epochs=M.)"
        )
    steps_name = "max_steps"
    if max_iters is not None:
        if max_steps is not None and max_steps != max_iters:
            raise ConfigError("max_iters", f"({max_iters}) contradicts max_steps ({max_steps}); pass one")
        max_steps, steps_name = max_iters, "max_iters"
    for name, value in ((steps_name, max_steps), ("max_epochs", max_epochs), ("epoch_length", epoch_length)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"must be a positive integer or None, got {value!r}")
        if value < 1 and name == "epoch_length":
            raise ConfigError(
                name, f"Input data has zero size. Please provide non-empty data (epoch_length={value})"
            )
        if value < 1:
            raise ConfigError(
                name, f"Argument {name} is invalid. Please, set a correct {name} positive value"
            )
    if data is not None and data_length(data) == 0:
        raise ValueError(
            "Input data has zero size. Please provide non-empty data (len(data) == 0: pass a non-empty "
            "dataset or loader)"
        )
    return max_steps, steps_name


def check_limit_kind(state: Any, max_steps: int | None, max_epochs: int | None) -> None:
    """ignite's rule: a run started with one kind of limit (epochs or steps) is not switched to
    the other while it exists; a run started with both (``max_steps`` and ``max_epochs``) may
    extend either."""
    if max_steps is not None and state.max_epochs is not None and state.max_iters is None:
        raise ValueError(
            "To switch from max_epochs to max_iters mode during resume, you must first reset by "
            "setting 'engine.state.max_epochs = None' before calling run(). (The run was started "
            f"with max_epochs={state.max_epochs}; a step limit is max_steps or max_iters.)"
        )
    if max_epochs is not None and state.max_iters is not None and state.max_epochs is None:
        raise ValueError(
            "To switch from max_iters to max_epochs mode during resume, you must first reset by "
            "setting 'engine.state.max_iters = None' before calling run(). (The run was started "
            f"with max_steps={state.max_iters}.)"
        )


def _extend_limits(engine: Any, max_steps: int | None, max_epochs: int | None, steps_name: str) -> None:
    """Raise the current run's limits through ignite's own check (not below the epoch or step
    reached); its message names the step limit as the caller gave it."""
    state = engine.state
    check_limit_kind(state, max_steps, max_epochs)
    if max_epochs is not None and state.max_epochs is not None:
        engine.extend_max_epochs(max_epochs)
    if max_steps is not None and state.max_iters is not None:
        try:
            engine.extend_max_iters(max_steps)
        except ValueError as e:
            raise ValueError(str(e).replace("Argument max_iters", f"Argument {steps_name}", 1)) from None


def set_up_run(
    engine: Any,
    data: Iterable | None,
    max_epochs: int | None = None,
    max_iters: int | None = None,
    epoch_length: int | None = None,
    max_steps: int | None = None,
) -> bool:
    """Check ``run()``'s arguments and set ``engine``'s state up for its loop, as ignite's ``run``
    does; returns whether the run continues an unfinished one (else it starts afresh).

    ``engine`` is the :class:`~engine.Trainer`: its ``state``, its default limits (``max_steps`` /
    ``max_epochs``), its ``step_data`` (replaced for a new data source) and the adapter's
    ``extend_max_epochs`` / ``extend_max_iters`` / ``run_finished`` / ``forget_run``."""
    max_steps, steps_name = check_run_arguments(data, max_epochs, max_iters, epoch_length, max_steps)
    state = engine.state
    _extend_limits(engine, max_steps, max_epochs, steps_name)
    new_run = (state.max_epochs is None and state.max_iters is None) or engine.run_finished
    source = NO_DATA if data is None else data
    if new_run:
        if data is None and epoch_length is None and state.epoch_length is None:
            raise ValueError(
                "epoch_length should be provided if data is None: run(None, epoch_length=N) runs N "
                "steps an epoch, each on grad_accum_steps None microbatches that prepare_batch turns "
                "into (inputs, targets)"
            )
        max_steps = engine.max_steps if max_steps is None else max_steps
        max_epochs = engine.max_epochs if max_epochs is None else max_epochs
        if max_epochs is None and max_steps is None:
            max_epochs = 1
        engine.step_data = StepBatches(source, lambda: engine.grad_accum_steps)
        if epoch_length is None:  # the data's steps per pass, else the last run's (ignite's rule)
            epoch_length = engine.step_data.steps_per_pass() or state.epoch_length
        state.iteration = state.epoch = 0
        state.max_epochs, state.max_iters, state.epoch_length = max_epochs, max_steps, epoch_length
        state.reset_counters()
        engine.forget_run()
        return False
    if engine.step_data.data is not source:
        engine.step_data = StepBatches(source, lambda: engine.grad_accum_steps)
    if state.epoch_length is None and data is None and epoch_length is None:
        raise ValueError("epoch_length should be provided if data is None")
    if state.epoch_length is None:
        state.epoch_length = epoch_length or engine.step_data.steps_per_pass()
    elif epoch_length is not None and epoch_length != state.epoch_length:
        raise ValueError(
            "Argument epoch_length should be same as in the state, but given "
            f"{epoch_length} vs {state.epoch_length}. (A run continues with its epoch length; "
            "set engine.state.max_epochs = engine.state.max_iters = None to start a new run.)"
        )
    return True


class EpochBounds:
    """The bounds on a run's epochs that ignite's loop lacks, for one trainer.

    ``state``: gives the trainer's state; ``control``: its :class:`~engine.control.StepControl`
    (the stop after empty epochs is requested there, and agreed like any other)."""

    def __init__(self, state: Callable[[], Any], control: Any) -> None:
        self._state = state
        self._control = control
        self._limit: int | None = None
        self._start_step = 0
        self._empty = 0

    def run_set_up(self) -> None:
        """After :func:`set_up_run`: a run given both limits whose epoch length is not known yet
        remembers its ``max_epochs``."""
        state = self._state()
        both = state.max_iters is not None and state.max_epochs is not None
        self._limit = state.max_epochs if both and state.epoch_length is None else None

    def start_run(self) -> None:
        """TRAIN_START: no epoch seen yet."""
        self._start_step = 0
        self._empty = 0

    def epoch_started(self) -> None:
        self._start_step = self._state().iteration

    def epoch_ended(self) -> None:
        """A run limited by steps alone (no ``max_epochs``) whose epochs stop starting steps (used-up
        data, or every fetch raising into an EXCEPTION handler that handles it) would repeat empty
        epochs without end: after two in a row it asks to stop, saying so."""
        state = self._state()
        if self._limit is not None and state.epoch_length is not None:
            # ignite, learning the epoch length of a run with max_iters, sets max_epochs from
            # max_iters alone; a run given both limits keeps its own max_epochs if that is smaller
            state.max_epochs = min(state.max_epochs or self._limit, self._limit)
            self._limit = None
        if state.iteration != self._start_step or state.max_epochs is not None:
            self._empty = 0
            return
        self._empty += 1
        if self._empty >= 2:
            self._control.request_stop(
                f"epochs {state.epoch - 1} and {state.epoch} started no step and only max_steps="
                f"{state.max_iters} limits the run: the data gives no more steps (a one-shot iterator "
                "used up, or every fetch raising into an EXCEPTION handler that handles it), so the "
                f"run ends at step {state.iteration} instead of repeating empty epochs"
            )
