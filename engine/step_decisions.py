"""A step's decisions: where the requests on the control point become what every rank does.

Handlers *request* on the trainer's control point (:mod:`engine.control`); the trainer's
:class:`StepDecisions` (``trainer.step_decisions``) decides, twice a step::

    ... fire(BEFORE_OPTIMIZER_STEP)
    agree(loss, norm, tokens, samples, overflow)    ONE all-reduce (engine.agreement): the step's
        state.loss, grad_norm, step_tokens          values summed over ranks, the token and sample
        tokens_seen, samples_seen                   counts, and every vote: skip, stop (with its
        control.skip / save / validate / stop       exit code), save, validate, the slots' values
        agreed, control.decided recorded            (on_agreed), whether anything may still ask late;
                                                    the summed loss, norm and tokens (and the
                                                    slots that may stay there, Slot.on_device)
                                                    stay on the device unless the step decides
                                                    something
    ... optimizer, fire(STEP_END)
        decided.validate: trainer.validate()        at Priority.VALIDATION, on every rank
    end_step() -> stop                              the trainer's last STEP_END handler:
        the late agreement                          a second small all-reduce, only when some rank
                                                    could still ask (or asked for a rollback)
        an agreed rollback: fire(ROLLBACK)          every rank restores the same checkpoint
        step requests and schedule flags reset      a save asked after the agreement carries over

Who could ask after the agreement: a :class:`~engine.Handler` attached to an event of
:data:`AFTER_AGREEMENT` asks there for the next step by default (its stop is agreed at the next
step's agreement, no cost); one that says ``asks_after_agreement = True`` wants an exact stop at this
step, which costs the second all-reduce on every step. A function or another library's object there
(ignite's ``EarlyStopping``) may call ``terminate()`` on one rank and expect it to hold, so it counts
as asking unless it carries ``asks_after_agreement = False`` itself. With the default handlers a step
that does not validate issues the first all-reduce and nothing else. A validation asked for on one
rank only is agreed like a save: every rank validates at that step, and no collective is added for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hookloop.engine import parallel
from hookloop.engine.agreement import (
    N_EXIT_VOTES,
    STEP_VALUES,
    agreed_exit_code,
    exit_code_votes,
    read_now,
    sum_over_ranks,
)
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.control import merge_rollbacks
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events

__all__ = ["AFTER_AGREEMENT", "StepDecisions"]

#: Events whose handlers run after the step's agreement.
AFTER_AGREEMENT = (Events.STEP_END, Events.VALIDATION_END, Events.CHECKPOINT_SAVED, Events.ROLLBACK)


class StepDecisions:
    """The step's agreement and end for one trainer (see the module docstring), from the trainer's
    parts; ``validation_vote``: this rank's vote for a validation at this step
    (:meth:`engine.validation.Validator.vote`); ``owner``: the trainer, whose own handlers never
    ask late."""

    def __init__(
        self,
        control: Any,
        agreement: Any,
        state: Callable[[], Any],
        events: Any,
        fire: Callable[[Any], None],
        validation_vote: Callable[[], bool],
        owner: Any,
    ) -> None:
        self._control = control
        self._agreement = agreement
        self._state = state
        self._events = events
        self._fire = fire
        self._validation_vote = validation_vote
        self._owner = owner
        #: Whether this step's end runs the late agreement (some rank could ask late, or asked).
        self.late = False

    def start_run(self) -> None:
        """TRAIN_START: no step agreed yet."""
        self.late = False

    def agree(self, loss: Any, norm: Any, tokens: Any, samples: int, overflow: Any) -> None:
        """The step's one collective (see the module docstring); the agreed values are applied and
        recorded in ``control.decided``: the only place the control's requests become decisions."""
        state, control = self._state(), self._control
        transport = self._agreement.transport  # who takes part (engine.agreement)
        slots = self._agreement.slots
        # A slot that may stay on the device goes right after the step values, kept unread with them.
        front = [slot.fill() for slot in slots if slot.on_device]
        decisions: list[Any] = [
            samples,
            False if overflow is None else overflow,
            control.skip,
            control.stop,
            control.save,
            self._validation_vote(),
            self.late_requests_possible() or control.rollback is not None,
            *exit_code_votes(int(control.exit_code) if control.stop else 0),
            *(slot.fill() for slot in slots if not slot.on_device),
        ]
        n = len(front)
        if not transport.spans_processes:
            agreed = sum_over_ranks([*front, *decisions], keep=n)
            front, agreed = agreed[:n], agreed[n:]
            if n and any(v > 0 for v in agreed[1:6]):  # a step that decides reads its slots too
                front = read_now(front)
        else:  # the loss, norm and tokens come back unread when they are tensors (engine.agreement)
            keep = STEP_VALUES + n
            values = [loss, norm, tokens, *front, *decisions]
            agreed = transport.agree_step(values, keep=keep) if n else transport.agree_step(values)
            step_values, agreed = agreed[:keep], agreed[keep:]
            # a step that decides reads its values and slots too; one whose end may still ask for a
            # stop (late) reads its values only
            if any(v > 0 for v in agreed[1:6]):
                step_values = read_now(step_values)
            elif agreed[6] > 0:
                step_values = read_now(step_values[:STEP_VALUES]) + step_values[STEP_VALUES:]
            step_values, front = step_values[:STEP_VALUES], step_values[STEP_VALUES:]
            ranks = transport.ranks_summed
            state.loss, state.grad_norm = step_values[0] / ranks, step_values[1] / ranks
            tokens = step_values[2]
            state.step_tokens = tokens.to(torch.int64) if isinstance(tokens, torch.Tensor) else int(tokens)
        samples, overflow_votes, skip, stop, checkpoint, validate, late = agreed[:7]
        votes, slot_values = agreed[7 : 7 + N_EXIT_VOTES], agreed[7 + N_EXIT_VOTES :]
        state.tokens_seen = state.peek("tokens_seen") + state.peek("step_tokens")
        state.samples_seen += int(samples)
        state.grad_scaler_overflow = overflow_votes > 0
        if not transport.committed:  # the agreement did not hold (engine.agreement)
            self.late = False
            control.void_step()
            return
        control.skip = skip > 0 or state.grad_scaler_overflow
        control.save = checkpoint > 0
        control.validate = validate > 0
        if stop > 0:
            control.decide_stop(agreed_exit_code(votes))
        on_device, on_host = iter(front), iter(slot_values)
        for slot in slots:
            value = next(on_device if slot.on_device else on_host)
            if slot.on_agreed is not None:
                slot.on_agreed(value)
        self.late = late > 0 or control.validate  # a validation's handlers may ask late
        control.record_decided()

    def late_requests_possible(self) -> bool:
        """Whether a handler of :data:`AFTER_AGREEMENT` on this rank may still ask for a stop after
        the step's agreement (see the module docstring); agreed across ranks in :meth:`agree`."""
        for event in AFTER_AGREEMENT:
            for entry in self._events.entries(event):
                owner = _owner(entry)
                if owner is not self._owner and getattr(owner, "asks_after_agreement", True) is not False:
                    return True
        return False

    def end_step(self) -> bool:
        """After the step's handlers (see the module docstring): agree on late requests, carry out
        a rollback request (:mod:`engine.control`), reset the step's requests and flags; returns
        whether every rank agreed to stop."""
        state, control = self._state(), self._control
        stop = control.decided.stop
        if self.late:  # stop and rollback requests of any rank, agreed
            code = int(control.exit_code) if control.stop else 0
            asked = [control.stop, control.rollback is not None, *exit_code_votes(code)]
            votes = self._agreement.transport.agree_late(asked)
            if votes[0] > 0:
                control.decide_stop(agreed_exit_code(votes[2:]))
                stop = True
            if votes[1] > 0 and parallel.world_size() > 1:
                control.rollback = merge_rollbacks(parallel.gather_objects(control.rollback))
        rollback, step = control.decide_rollback(), state.step
        if rollback is not None:  # the checkpointer restores what the request says
            try:
                self._fire(Events.ROLLBACK)
            except CheckpointError as e:
                if isinstance(e, ConfigError):  # a setting to change (checkpoint.max_index_mb): exit 2
                    raise
                control.exclude_nodes = tuple(dict.fromkeys((*control.exclude_nodes, *rollback.nodes)))
                raise rollback.failed(step, e) from e
        control.end_step(stop)
        if self._agreement.transport.step_boundary() and not stop:  # a stop every rank shares
            control.decide_stop()
            control.end_step(True)
            stop = True
        return stop


def _owner(entry: Any) -> Any:
    """Who says whether ``entry`` asks late: the object of a bound method, else the callable itself."""
    return getattr(entry.original, "__self__", entry.original)
