"""The run plan: the limits of one ``Trainer.run()`` and where the run is, with one owner.

:class:`RunPlan` (``trainer.plan``) owns the run's limits and position: the default limits a
scheduling handler configures (``max_steps`` / ``max_epochs``), the microbatches per step
(``grad_accum_steps``), the start position after a resume (:meth:`RunPlan.start_at`), the bounds on
a run's epochs and whether the current step is the last (:attr:`RunPlan.is_last_step`). The step
scheduler, the checkpointer and the curriculum read it; none of them writes the trainer's limits
or the state's ``iteration`` / ``epoch``.

ignite's ``Engine.run`` checks its arguments and sets up the state (a new run, or one to continue)
before its loop. The trainer keeps ignite's rules and words but adds a step limit that combines
with an epoch limit (``max_steps=N, max_epochs=M``: whichever comes first) and microbatches grouped
into steps, so the plan sets the state up here and then the trainer starts ignite's loop
(:meth:`engine.ignite_adapter.IgniteAdapter.start_loop`). Where ignite's own check says the same
(a limit not below the progress reached) it is ignite's check that runs, through the adapter's
``extend_max_epochs`` / ``extend_max_iters``. Without any limit a run is one epoch (ignite's
default); a step scheduler always configures both limits (its ``num_epochs`` defaults to NeMo's
10), so under a scheduler that default never applies.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from hookloop.engine.checks import check_int, grad_acc_steps_for
from hookloop.engine.errors import ConfigError
from hookloop.engine.step_batches import NO_DATA, StepBatches, data_length

__all__ = [
    "PlanAttribute",
    "RunPlan",
    "check_limit_kind",
    "check_position",
    "check_run_arguments",
    "derive_limits",
    "grad_acc_steps_for",
    "microbatches_to_skip",
    "read_position",
    "set_up_run",
]

logger = logging.getLogger(__name__)


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
    """Check ``run()``'s arguments and set the :class:`~engine.Trainer` ``engine``'s state up for its
    loop, as ignite's ``run`` does; returns whether the run continues an unfinished one (else it
    starts afresh). A new data source replaces ``engine.step_data``."""
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
        max_steps = engine.plan.max_steps if max_steps is None else max_steps
        max_epochs = engine.plan.max_epochs if max_epochs is None else max_epochs
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


def derive_limits(num_epochs: int | None, max_steps: int | None, epoch_len: int | None) -> tuple[int, int]:
    """``(num_epochs, max_steps)`` with a missing one derived from the other (NeMo's rules: 10
    epochs when unknown; ``max_steps`` required without an epoch length)."""
    if num_epochs is None:
        num_epochs = 10 if max_steps is None or epoch_len is None else math.ceil(max_steps / epoch_len)
    if max_steps is None:
        if epoch_len is None:
            raise ConfigError(
                "max_steps",
                "is required when the dataloader has no length (an iterable dataset): set max_steps",
            )
        max_steps = num_epochs * epoch_len
    return num_epochs, max_steps


def check_position(step: int, epoch: int, epoch_len: int | None, step_name: str, epoch_name: str) -> int:
    """With a known epoch length, ``step`` must lie in epoch ``epoch``; returns the epoch, moved past
    an epoch that ``step`` completes exactly."""
    if epoch_len is None:
        return epoch
    first = epoch * epoch_len
    if step == first + epoch_len:
        return epoch + 1
    if not first <= step < first + epoch_len:
        raise ConfigError(
            step_name,
            f"step {step} is not in epoch {epoch} ({epoch_len} steps per epoch: steps {first} to "
            f"{first + epoch_len}); pass {epoch_name}={step // epoch_len} with it",
        )
    return epoch


def read_position(state: Any, who: str) -> tuple[int, int]:
    """``(step, epoch)`` from a saved position (a mapping with ``step`` and ``epoch``, numbers or
    0-dim tensors), checked; errors say what ``who.state_dict()`` returns."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"a {who} state must be a mapping with 'step' and 'epoch', got {type(state).__name__}: pass "
            f"what {who}.state_dict() returned"
        )
    missing = [key for key in ("step", "epoch") if key not in state]
    if missing:
        raise ValueError(
            f"the {who} state has no {' or '.join(map(repr, missing))} (it has {sorted(map(str, state))}); "
            f"a state needs 'step' and 'epoch': pass what {who}.state_dict() returned"
        )
    step, epoch = (int(v.item() if hasattr(v, "item") else v) for v in (state["step"], state["epoch"]))
    check_int("state_dict['step']", step, low=0)
    check_int("state_dict['epoch']", epoch, low=0)
    return step, epoch


def microbatches_to_skip(
    step: int, epoch: int, epoch_len: int | None, accum: int, data: Any, resume_skip: bool | None
) -> int:
    """The microbatches of epoch ``epoch`` already used at ``step``, to drop when a run starts there:
    none without an epoch length, and none when ``resume_skip`` is False, or is None and the loader
    (or its sampler) has a ``state_dict`` (it restores its own position)."""
    into = step - epoch * epoch_len if epoch_len is not None else 0
    if resume_skip is None:
        resume_skip = not any(
            hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            for obj in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None))
            if obj is not None
        )
    return into * accum if resume_skip and into > 0 else 0


class RunPlan:
    """Where a run is and where it ends, for one trainer (``trainer.plan``; see the module
    docstring). ``engine``: the :class:`~engine.Trainer` (its ``state``, ``control``, ``step_data``
    and ignite adapter)."""

    def __init__(self, engine: Any, grad_accum_steps: int = 1) -> None:
        self._engine = engine
        #: The run's default limits (``run()``'s arguments override them for one run).
        self.max_steps: int | None = None
        self.max_epochs: int | None = None
        self._grad_accum_steps = 1
        self.grad_accum_steps = grad_accum_steps
        self._configured_by: str | None = None  # the handler that configured the limits, once
        self._limit: int | None = None
        self._start_step = 0
        self._empty = 0
        self._in_epoch = False

    @property
    def grad_accum_steps(self) -> int:
        """Microbatches per optimizer step (>= 1)."""
        return self._grad_accum_steps

    @grad_accum_steps.setter
    def grad_accum_steps(self, value: int) -> None:
        check_int("grad_accum_steps", value)
        self._grad_accum_steps = value

    def configure(
        self, by: str, max_steps: int, max_epochs: int, grad_accum_steps: int, why: str = ""
    ) -> None:
        """Set the run's default limits and accumulation: the handler named ``by`` (a step
        scheduler), once, at attach; ``why`` says where its accumulation comes from. A trainer built
        with another accumulation than the default 1 is refused (it was asked for), and so is a
        ``run()`` whose limits differ from these (:meth:`set_up`)."""
        if self.grad_accum_steps not in (1, grad_accum_steps):
            raise ConfigError(
                "grad_accum_steps",
                f"the trainer was built with grad_accum_steps={self.grad_accum_steps} but its {by} "
                f"computes {grad_accum_steps}{why}; drop grad_accum_steps from Trainer(...) and set it "
                f"on the {by}",
            )
        self.max_steps, self.max_epochs, self.grad_accum_steps = max_steps, max_epochs, grad_accum_steps
        self._configured_by = by

    @property
    def limits(self) -> tuple[int | None, int | None]:
        """``(max_steps, max_epochs)`` of the current run (the state's; None: no such limit)."""
        state = self._engine.state
        return state.max_iters, state.max_epochs

    @property
    def is_last_step(self) -> bool:
        """Whether the current step is the run's last (the one place that says so): ``max_steps``
        reached, or the last epoch's last step."""
        state = self._engine.state
        max_steps, max_epochs = self.limits
        if max_steps is not None and state.iteration >= max_steps:
            return True
        length = state.epoch_length
        return bool(
            length
            and max_epochs
            and max_epochs < 2**40  # a run limited by steps alone may carry a huge epoch limit
            and state.epoch >= max_epochs
            and self._engine.step_data.steps >= length
        )

    def set_up(self, *run_args: Any) -> bool:
        """``run()``'s set-up (:func:`set_up_run` with ``run()``'s arguments, in its order); returns
        whether the run continues an unfinished one."""
        continuing = set_up_run(self._engine, *run_args)
        self.run_set_up()
        by = self._configured_by
        for name, mine, theirs in zip(
            ("max_steps", "max_epochs"), (self.max_steps, self.max_epochs), self.limits
        ):
            if by is not None and mine != theirs:
                raise ConfigError(
                    name,
                    f"the trainer has {name}={theirs} but its {by} says {mine}; set it on the {by} and call "
                    "trainer.run(data) without it",
                )
        return continuing

    def run_set_up(self) -> None:
        """A run given both limits whose epoch length is not known yet remembers its ``max_epochs``."""
        state = self._engine.state
        both = state.max_iters is not None and state.max_epochs is not None
        self._limit = state.max_epochs if both and state.epoch_length is None else None

    def start_at(self, step: int, epoch: int, skip_microbatches: int = 0) -> None:
        """TRAIN_START, after a checkpoint handler restored (it runs earlier): start the run at
        ``step`` with ``epoch`` epochs completed, dropping ``skip_microbatches`` of the data.

        A fresh trainer is moved there. One a checkpoint restored to the same step keeps its data
        position; only its epoch is set to the epochs *completed*, since the loop adds one when the
        next epoch starts. One at another step keeps its position (with a warning)."""
        engine = self._engine
        state = engine.state
        if state.iteration == step and step > 0:
            state.epoch = epoch
            return
        if state.iteration != 0:
            logger.warning(
                "trainer already at step %d: the start position (step %d, epoch %d) is ignored",
                state.iteration,
                step,
                epoch,
            )
            return
        state.iteration, state.epoch = step, epoch
        engine.step_data.skip_next = skip_microbatches
        logger.info("starting at step %d, epoch %d", step, epoch)

    @property
    def epoch(self) -> int:
        """The 0-based index of the current epoch, which is the number of epochs completed before it
        (ignite's ``state.epoch`` counts the current one from EPOCH_START on)."""
        epoch = self._engine.state.epoch
        return epoch - 1 if self._in_epoch else epoch

    def start_run(self) -> None:
        """TRAIN_START: no epoch seen yet."""
        self._start_step = 0
        self._empty = 0
        self._in_epoch = False

    def epoch_started(self) -> None:
        self._start_step = self._engine.state.iteration
        self._in_epoch = True

    def epoch_ended(self) -> None:
        """The bounds on epochs (the trainer's last EPOCH_END handler): a run given both limits
        keeps its own ``max_epochs`` once ignite learns the epoch length, and a run limited by steps
        alone whose epochs stop starting steps would repeat empty epochs without end, so after two
        in a row it asks to stop, saying so (agreed like any stop)."""
        state = self._engine.state
        self._in_epoch = False
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
            self._engine.control.request_stop(
                f"epochs {state.epoch - 1} and {state.epoch} started no step and only max_steps="
                f"{state.max_iters} limits the run: the data gives no more steps (a one-shot iterator "
                "used up, or every fetch raising into an EXCEPTION handler that handles it), so the "
                f"run ends at step {state.iteration} instead of repeating empty epochs"
            )


class PlanAttribute:
    """A trainer attribute that is the run plan's (``trainer.max_steps``: ``trainer.plan.max_steps``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.plan, self._name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.plan, self._name, value)
