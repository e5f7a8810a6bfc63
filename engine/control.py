"""The step's one control point: handlers *request* on :class:`StepControl`, the trainer *decides*.

``trainer.control`` is the only place a handler asks the loop to do something other than the next
step: skip this step's optimizer update, save a checkpoint, validate, stop the run (with an exit
code and a reason), roll back. A request is this rank's wish; it becomes a decision only in the
step's agreement (:mod:`engine.agreement`: the one packed all-reduce before the optimizer, plus the
small late stop agreement at the end of a step whose handlers may still ask, and the stop agreement
at TRAIN_START / EPOCH_START / EPOCH_END). What every rank agreed is then on
:attr:`StepControl.decided`. There is one way to ask for a stop, :meth:`StepControl.request_stop`
(``trainer.terminate()``, ignite's spelling, is the same request); whoever asks (a handler, a stop
signal, the time limit or Ctrl-C noted by the run end (:mod:`engine.run_end`), a health or
straggler check) takes the same path: a request here, agreed at the next agreement point, carried
out by the trainer's one stop.

What resets when:

======================  ==============================================  ===================================
field                   requested by, when                              reset
======================  ==============================================  ===================================
``skip``                :meth:`request_skip`, up to BEFORE_OPTIMIZER    end of every step (before the next
                        _STEP; the agreement replaces it with the       STEP_START) and when a run starts
                        agreed value (a fp16 overflow skips too)
``device_skip``         ``request_skip(on_device=flag)``, from an       end of every step (before the next
                        agreed device value (a slot's ``on_agreed``     STEP_START) and when a run starts
                        given a tensor); the optimizer skips where it
                        is > 0, on the device (``trainer.skips_on_
                        device``); nothing on the host knows yet
``save``,              :meth:`request_save`, any time, saying who      end of every step; a request made
``save_by``             asked; the agreement replaces ``save`` with     after the agreement carries over
                        the agreed value                                to the next step
``validate``            :meth:`request_validate`, any time; the         end of every step; a request made
                        agreement replaces it with the agreed value;    after the agreement carries over
                        :meth:`withdraw_validate` from agreed values    to the next step
                        only
``stop``,               :meth:`request_stop`, any time                  latch; cleared when a run starts
``stop_reason``,        (the first reason and the first non-zero
``exit_code``,          exit code win, and the nodes it names:
``exclude_nodes``       ``exit_status.json``); agreed at the next agreement
                        point: every rank stops, with the largest
                        exit code any rank asked for
``rollback``            :meth:`request_rollback`, from agreed values    cleared once ROLLBACK has fired
                        (every rank asks alike), in a step; the         (the trainer's, or one a handler
                        trainer carries it out at the step's end        fired itself), and when a run
                        (ROLLBACK handlers read it while it fires)      starts
``decided``             the trainer, at each agreement point, and       replaced at every agreement; at
                        ``decided.rollback`` at the end of the step     the end of a step it keeps only
                        when it carries out a rollback request          the stop; cleared when a run starts
======================  ==============================================  ===================================

A validation asked for on any rank runs on every rank (it is collective: a request on one rank that
the others did not see would leave them waiting), at the step's STEP_END (``Priority.VALIDATION``),
when ``decided.validate`` is true. It travels as one more value in the step's one all-reduce.

How a rollback is carried out: a handler calls :meth:`StepControl.request_rollback` during a step,
from agreed values (e.g. in its agreement slot's ``on_agreed``, or from a counter only agreed values
move), so every rank asks alike and every rank's ROLLBACK restores together (the restore is
collective); the request (a :class:`Rollback`) says what is restored and what to do when nothing
can be. The trainer carries it out at the end of that step, once every STEP_END handler has
seen the step that triggered it (at its own ``Priority.ENGINE_LAST``, before the late stop
agreement): it records the request as ``decided.rollback``, fires ROLLBACK (the checkpointer
restores, then the other ROLLBACK handlers, the requester's own bookkeeping among them, see the
restored state), and clears the request. A ROLLBACK fired while nobody asked restores the newest
checkpoint with its data position.

A request that must be the same on every rank is made from agreed values (in a slot's
``on_agreed``, or from ``decided``) or goes through the agreement (``skip``, ``save``,
``validate``, ``stop``).

What a handler that judges the state tells one that saves it (hold saves, the step to protect from
pruning, an initial save) is not a request to the loop: it is the trainer's save policy
(``trainer.save_policy``, :mod:`engine.save_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hookloop.engine.errors import TrainingAborted
from hookloop.engine.exit_codes import ExitCode

__all__ = ["OTHER_RANK_STOP", "Decided", "Rollback", "StepControl", "merge_rollbacks", "shared_stop_reason"]

#: The stop reason of a rank that did not ask for the stop every rank agreed on.
OTHER_RANK_STOP = "stop requested on another rank"


@dataclass(frozen=True)
class Rollback:
    """A rollback request: restore the newest intact checkpoint at or before ``at_or_before``
    (None: the newest) whose saved state is finite; ``keep_data_position``: keep reading the data
    from where it is (training goes on past the bad window) instead of from the checkpoint's.

    When no checkpoint can be restored (a ``CheckpointError``) the trainer ends the run with
    ``TrainingAborted`` and ``exit_code``, naming ``reason`` (who asked, e.g.
    ``"nan.action='rollback'"``) and ``nodes`` (``exit_status.json``), checkpoints left as they
    are. These three say what happens on failure, not what is restored: two requests for the same
    checkpoint compare equal."""

    at_or_before: int | None = None
    keep_data_position: bool = False
    reason: str | None = field(default=None, compare=False)
    exit_code: int = field(default=int(ExitCode.ERROR), compare=False)
    #: the hosts to leave out when the run ends for want of a checkpoint (``exit_status.json``)
    nodes: tuple[str, ...] = field(default=(), compare=False)

    def failed(self, step: int, error: Exception) -> TrainingAborted:
        """What ends the run when the restore this asks for fails at ``step`` with ``error``."""
        target = "" if self.at_or_before is None else f" at or before step {self.at_or_before}"
        asked_by = f" ({self.reason})" if self.reason else ""
        return TrainingAborted(
            f"step {step}: cannot roll back to a checkpoint{target}: {error}{asked_by}", self.exit_code
        )


@dataclass(frozen=True)
class Decided:
    """What every rank agreed on at the latest agreement point (read it instead of the live
    requests, which a handler on one rank may change after the agreement)."""

    skip: bool = False
    stop: bool = False
    save: bool = False
    #: who asked for the save on this rank (``request_save``'s ``by``); empty: another rank asked.
    #: A record, not a decision: two decisions that differ only here compare equal.
    save_by: tuple[str, ...] = field(default=(), compare=False)
    #: a validation runs at this step's STEP_END, on every rank
    validate: bool = False
    exit_code: int = 0
    #: the rollback the trainer carries out at the end of this step (None: none)
    rollback: Rollback | None = None


_NOTHING_DECIDED = Decided()


class StepControl:
    """Requests handlers make, and the decisions the trainer took from them (module docstring)."""

    __slots__ = (
        "decided",
        "device_skip",
        "exclude_nodes",
        "exit_code",
        "rollback",
        "save",
        "save_by",
        "skip",
        "stop",
        "stop_reason",
        "validate",
    )

    def __init__(self) -> None:
        self.skip = False
        self.device_skip: Any = None
        self.save = False
        self.save_by: tuple[str, ...] = ()
        self.stop = False
        self.stop_reason: str | None = None
        self.exit_code = 0
        self.exclude_nodes: tuple[str, ...] = ()
        self.rollback: Rollback | None = None
        self.validate = False
        self.decided = _NOTHING_DECIDED

    def __repr__(self) -> str:
        asked = [name for name in ("skip", "save", "validate", "stop") if getattr(self, name)]
        return f"StepControl(requested={asked}, exit_code={self.exit_code}, decided={self.decided})"

    def request_skip(self, on_device: Any = None) -> None:
        """Veto this step's optimizer update (on every rank: agreed before the optimizer step).

        ``on_device``: a 0-dim tensor agreed by every rank (a slot's ``on_agreed`` given a tensor,
        ``Slot.on_device``): the update is skipped where it is > 0, decided on the device without a
        read, by an optimizer that can (``trainer.skips_on_device``: a fused Adam, AdamW or SGD
        takes it as its ``found_inf``); ``decided.skip`` and ``state.skipped_steps`` do not see it
        (whoever asked tells the trainer later, ``trainer.count_device_skips``)."""
        if on_device is None:
            self.skip = True
        elif self.device_skip is None:
            self.device_skip = on_device
        else:
            self.device_skip = self.device_skip + on_device

    def request_save(self, by: str = "user") -> None:
        """Ask for a checkpoint at the end of this step (agreed; asked after the agreement: the next).
        ``by`` says who asked and why (e.g. ``"step_scheduler.ckpt_every_steps=100"``, ``"stop:
        signal SIGTERM"``); the checkpointer records it with the save."""
        self.save = True
        if by not in self.save_by:
            self.save_by = (*self.save_by, by)

    def request_validate(self) -> None:
        """Validate at this step's end, on every rank (agreed; asked after the agreement: the next
        step). Needs validation data (``trainer.set_validation``) on every rank."""
        self.validate = True

    def withdraw_validate(self) -> None:
        """Take back this step's validation (asked or on the cadence), from agreed values only (a
        slot's ``on_agreed``), so every rank withdraws alike: e.g. time is short before a stop."""
        self.validate = False

    def request_stop(self, reason: str, exit_code: int | None = None, nodes: tuple[str, ...] = ()) -> None:
        """Stop after the current step (agreed across ranks). The first reason given is kept, and
        the first non-zero exit code (0: the run ends as finished); ``nodes``: hosts the next job
        should leave out (``exit_status.json``'s ``"nodes"``, with exit code 79)."""
        self.stop = True
        self.exclude_nodes = tuple(dict.fromkeys((*self.exclude_nodes, *nodes)))
        if self.stop_reason is None:
            self.stop_reason = reason
        if exit_code is not None and not self.exit_code:
            self.exit_code = int(exit_code)

    def request_rollback(
        self,
        at_or_before: int | None = None,
        *,
        keep_data_position: bool = False,
        reason: str | None = None,
        exit_code: int = ExitCode.ERROR,
        nodes: tuple[str, ...] = (),
    ) -> None:
        """Roll back at the end of this step (see :class:`Rollback` and the module docstring).
        Agreed like a stop: asked on one rank, every rank rolls back at the end of the same step
        (:func:`merge_rollbacks` says what to restore when ranks ask differently)."""
        self.rollback = Rollback(at_or_before, bool(keep_data_position), reason, int(exit_code), tuple(nodes))

    def start_run(self) -> None:
        """A run starts: no stop, no step request, nothing decided."""
        self.stop = False
        self.stop_reason = None
        self.exit_code = 0
        self.exclude_nodes = ()
        self.drop_step_requests()
        self.rollback = None
        self.decided = _NOTHING_DECIDED

    def record_decided(self) -> None:
        """The end of the step's agreement: the agreed values (which replaced the requests, and
        what the slots' ``on_agreed`` asked from agreed values) become :attr:`decided`."""
        self.decided = Decided(self.skip, self.stop, self.save, self.save_by, self.validate, self.exit_code)

    def void_step(self) -> None:
        """The step's agreement did not hold (its :class:`~engine.agreement.AgreementTransport` did
        not commit it, e.g. across a fault-tolerant run's replica groups): the step is skipped and
        nothing else is decided; the requests stay, so a stop, save or validation asked for is
        agreed at the next step."""
        self.skip = True
        self.decided = Decided(skip=True)

    def decide_rollback(self) -> Rollback | None:
        """The end of the step: the pending rollback request (None: none) becomes
        ``decided.rollback``; the trainer then fires ROLLBACK and clears the request."""
        if self.rollback is not None:
            self.decided = replace(self.decided, rollback=self.rollback)
        return self.rollback

    def drop_step_requests(self) -> None:
        """A step that raised leaves no skip, save or validation request behind."""
        self.skip = self.save = self.validate = False
        self.device_skip = None
        self.save_by = ()

    def decide_stop(self, exit_code: int = 0) -> None:
        """Every rank stops (the largest exit code any rank asked for; 0 keeps this rank's); a
        rank that did not ask names the other rank as the reason."""
        self.stop = True
        if self.stop_reason is None:
            self.stop_reason = OTHER_RANK_STOP
        if exit_code:
            self.exit_code = int(exit_code)

    def end_step(self, stop: bool) -> None:
        """The step is over: step requests reset (a save or validation asked after the agreement
        carries over), the decision kept is the stop."""
        decided = self.decided
        self.save = self.save and not decided.save
        if not self.save:
            self.save_by = ()
        self.validate = self.validate and not decided.validate
        self.skip = False
        self.device_skip = None
        self.decided = Decided(stop=True, exit_code=self.exit_code) if stop else _NOTHING_DECIDED


def merge_rollbacks(requests: list[Rollback | None]) -> Rollback:
    """One rollback for every rank from each rank's request (None: that rank did not ask): a
    checkpoint at or before the earliest bound any rank gave, the data position kept only when every
    asking rank keeps it, the largest exit code, each asking rank's reason, every node named."""
    asked = [(rank, r) for rank, r in enumerate(requests) if r is not None]
    bounds = [r.at_or_before for _, r in asked if r.at_or_before is not None]
    reasons = [f"rank {rank}: {r.reason}" for rank, r in asked if r.reason]
    return Rollback(
        min(bounds) if bounds else None,
        all(r.keep_data_position for _, r in asked),
        "; ".join(dict.fromkeys(reasons)) or None,
        max(r.exit_code for _, r in asked),
        tuple(dict.fromkeys(node for _, r in asked for node in r.nodes)),
    )


def shared_stop_reason(reasons: list[str | None], rank: int) -> str | None:
    """The reason a stop every rank agreed on gives on ``rank``: its own, else that of the lowest
    rank that asked (``reasons``: every rank's, in rank order), named."""
    own = reasons[rank]
    if own is not None and own != OTHER_RANK_STOP:
        return own
    for other, reason in enumerate(reasons):
        if reason is not None and reason != OTHER_RANK_STOP:
            return f"{reason} (asked on rank {other})"
    return own
