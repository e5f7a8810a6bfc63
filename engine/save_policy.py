"""The save policy: how a handler that judges the training state and a handler that saves it
cooperate without importing each other.

Every trainer owns one :class:`SavePolicy` (``trainer.save_policy``); both kinds of handler receive
it through the trainer. A *judge* (a NaN detector, a loss-spike check, ...) says what it knows about
the state; a *saver* (a checkpointer) reads it before it saves or prunes. Three pieces of
information, each with its rule:

==================  ===========================================  =====================================
information         judge says                                   saver does
==================  ===========================================  =====================================
saves held          :meth:`hold_saves` ``(by)`` while the state  starts and publishes no save while
                    may be poisoned, :meth:`release_saves`       :attr:`saves_held` (any judge holds)
                    ``(by)`` once it is trusted again
protected step      :meth:`protect` ``(step, by)``: the newest   never prunes the newest checkpoint
                    step this judge trusts                       at or before :attr:`protected_step`
                                                                 (the oldest any judge protects)
                                                                 whose saved state is finite
initial save        :meth:`want_initial_save` at attach: it may  saves step 0 when a run starts fresh
                    roll back before the first regular save      (:meth:`initial_save_due`)
==================  ===========================================  =====================================

A judge whose verdicts are still on the device (the NaN detector when the skip is decided there)
says so with :meth:`defer` ``(by, settle)``: whoever reads the policy (:attr:`saves_held`,
:attr:`holders`, :attr:`protected_step`) first has it settle, i.e. read its verdicts and hold,
release or protect as if it had read them at their steps; a step that reads nothing of the policy
costs nothing.

A judge names itself (``by``): one judge releasing its hold never releases another's. The policy
is information, not a request to agree on: judges set it from values every rank shares (a verdict
agreed in the step's agreement), so it is the same on every rank. Nothing here resets when a run
starts: a hold or a protected step belongs to its judge, which clears it (its own state may be
restored from a checkpoint); the initial save is a setting of the trainer. Requests to the loop
itself (skip a step, save, validate, stop, roll back) go to the control point (:mod:`engine.control`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["SavePolicy"]


class SavePolicy:
    """What judges of the state tell savers (see the module docstring)."""

    __slots__ = ("_deferred", "_holders", "_initial_save", "_lock", "_protected")

    def __init__(self) -> None:
        self._deferred: dict[str, Callable[[], None]] = {}
        self._holders: set[str] = set()
        # a saver publishing on a thread of its own makes a checkpoint visible under it (see
        # :meth:`unheld`): a hold either comes before (nothing is published) or after
        self._lock = threading.Lock()
        self._protected: dict[str, int] = {}
        self._initial_save = False

    def __repr__(self) -> str:
        return (
            f"SavePolicy(held_by={sorted(self._holders)}, protected={self._protected}, "
            f"initial_save={self._initial_save}, deferred={sorted(self._deferred)})"
        )

    def hold_saves(self, by: str) -> None:
        """``by`` distrusts the current state: no save starts or is published until it releases.
        Waits while a saver makes a checkpoint visible (:meth:`unheld`), a few milliseconds."""
        by = _name(by)
        with self._lock:
            self._holders.add(by)

    def release_saves(self, by: str) -> None:
        """``by`` trusts the state again (a judge that holds nothing: no change)."""
        by = _name(by)
        with self._lock:
            self._holders.discard(by)

    def protect(self, step: int | None, by: str) -> None:
        """``by`` trusts the state at ``step`` (the newest step it judged good); None: it withdraws
        its protection. A later call replaces the judge's earlier step (after a rollback it may be
        lower)."""
        by = _name(by)
        if step is None:
            self._protected.pop(by, None)
            return
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"protect(step=...) needs a step number >= 0 or None, got {step!r}")
        self._protected[by] = step

    def defer(self, by: str, settle: Callable[[], None] | None) -> None:
        """``by`` has verdicts not yet read: ``settle()`` (which reads them, then holds, releases or
        protects) runs before the policy is next read; None: nothing is pending any more."""
        by = _name(by)
        if settle is None:
            self._deferred.pop(by, None)
        else:
            self._deferred[by] = settle

    def settle(self) -> None:
        """Have every judge with deferred verdicts settle them now (each once)."""
        while self._deferred:
            _, settle = self._deferred.popitem()
            settle()

    def want_initial_save(self) -> None:
        """Ask for a checkpoint of step 0 when a run starts fresh (something to roll back to)."""
        self._initial_save = True

    @property
    def saves_held(self) -> bool:
        """Whether any judge holds saves: start none, publish none."""
        if self._deferred:
            self.settle()
        return bool(self._holders)

    @contextmanager
    def unheld(self) -> Iterator[bool]:
        """For a saver that publishes off the training thread: yields whether no judge holds saves,
        and a :meth:`hold_saves` meanwhile waits until the block is over. Publish inside it only
        when it yields True: a hold then comes either before (nothing published) or after. It does
        not settle deferred verdicts (it runs off the training thread): the saver asked
        :attr:`saves_held` on the training thread when it handed the save over."""
        with self._lock:
            yield not self._holders

    @property
    def holders(self) -> tuple[str, ...]:
        """Who holds saves now (sorted)."""
        if self._deferred:
            self.settle()
        return tuple(sorted(self._holders))

    @property
    def protected_step(self) -> int | None:
        """The newest step every judge trusts (the lowest any protects); None: nobody protects one."""
        if self._deferred:
            self.settle()
        return min(self._protected.values()) if self._protected else None

    @property
    def initial_save_wanted(self) -> bool:
        """Whether a judge asked for a step-0 checkpoint."""
        return self._initial_save

    def initial_save_due(self, step: int) -> bool:
        """Whether a run starting at ``step`` saves step 0 first: asked for, and a fresh start."""
        return self._initial_save and step == 0


def _name(by: str) -> str:
    if not isinstance(by, str) or not by:
        raise ValueError(f"name the judge (by='my_handler'), got {by!r}")
    return by
