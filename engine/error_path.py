"""The trainer's one error path: every error of a run goes through :class:`ErrorPath`.

ignite routes an error raised in the loop (a handler, the step, fetching data) to the engine's
error hook; the trainer hands it to its :class:`ErrorPath` (``trainer.error_path``)::

    on_error(e):
        a failure at TRAIN_START: every rank hears of it (engine.run_start), none starts
        fire(EXCEPTION, e)          handled when a handler is attached and none raises (ignite's rule)
        handled:   drop the step's gradients and flags; the loop goes on after this epoch
        otherwise: a lost peer becomes PeerFailure (or the peer's own recorded error, PeerCrashed);
                   this rank's own error is recorded for the peers to name;
                   fire(TRAIN_FAILED, e) (cleanup: drain saves, close loggers), then re-raise

A handler that fails while being told of the error is logged; the original error still wins. When a
run ends right after a handled error, :meth:`ErrorPath.explain_handled_end` gives
``control.stop_reason`` that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.errors import PeerCrashed, PeerFailure, StartRefused
from hookloop.engine.events import Events
from hookloop.engine.rank_failure import crashed_peer, record_failure

__all__ = ["ErrorPath"]

logger = logging.getLogger(__name__)


class ErrorPath:
    """The error path of one trainer (see the module docstring), from the trainer's parts;
    ``drop_gradients`` zeroes the optimizer's gradients (a step that raised leaves none behind),
    ``limits_reached`` says whether the state is at its step or epoch limit (ignite's rule)."""

    def __init__(
        self,
        events: Any,
        run_start: Any,
        control: Any,
        state: Callable[[], Any],
        drop_gradients: Callable[[], None],
        limits_reached: Callable[[], bool],
    ) -> None:
        self._events = events
        self._run_start = run_start
        self._control = control
        self._state = state
        self._drop_gradients = drop_gradients
        self._limits_reached = limits_reached
        self._failed: set[int] = set()
        #: Errors EXCEPTION handlers handled in the current run.
        self.handled_errors = 0
        self._last_handled: tuple[int, str] | None = None

    def start_run(self) -> None:
        """A run starts: no error is known yet."""
        self._failed.clear()
        self.handled_errors = 0
        self._last_handled = None

    def on_error(self, e: BaseException) -> None:
        """The one error path (see the module docstring); a handler re-raises to decline."""
        if id(e) in self._failed:  # ignite routes an error here twice (inner and outer loop)
            raise e
        self._run_start.fail(e)  # failed at TRAIN_START: every rank hears of it, none starts
        events = self._events
        entries = events.entries(Events.EXCEPTION)
        handled = bool(entries)
        for entry in entries:
            try:
                events.fire_entry(entry, (e,))
            except BaseException as raised:  # noqa: BLE001 - every handler is told, then we decide
                handled = False
                if raised is not e:
                    logger.error("EXCEPTION handler %r failed: %r", entry.original, raised)
        if handled:
            self._handled(e)
            return
        if parallel.is_peer_failure(e):  # a peer's own error, when it recorded one; else a lost peer
            lost = crashed_peer(e) or PeerFailure(
                f"a collective failed because a peer is gone or hung: {str(e).splitlines()[0][:300]}"
            )
            self._failed.add(id(e))
            self._fail(lost)
            raise lost from e
        if not isinstance(e, PeerFailure | PeerCrashed | StartRefused):
            record_failure(e, f"step {self._state().iteration}")  # the peers name it, not a lost peer
        self._fail(e)
        raise e

    def _handled(self, e: BaseException) -> None:
        """An EXCEPTION handler handled ``e``. As in ignite, the loop goes on after the error's
        epoch (an error in a step ends its epoch; one outside the epochs ends the run), so a run
        whose every step raises still ends at its ``max_epochs`` / ``max_steps``."""
        state = self._state()
        self._drop_gradients()
        self._control.drop_step_requests()
        self.handled_errors += 1
        message = str(e).splitlines()[0][:200] if str(e) else ""
        what = f"{type(e).__name__}: {message}" if message else type(e).__name__
        self._last_handled = (state.iteration, what)
        if self.handled_errors == 1:
            logger.warning(
                "%s at step %d (epoch %d); an EXCEPTION handler handled it, so, as in ignite, the loop "
                "goes on after this epoch up to the run's limits (an error outside the steps ends the run)",
                what,
                state.iteration,
                state.epoch,
            )
        if self._limits_reached():
            self.explain_handled_end()

    def explain_handled_end(self) -> None:
        """Set ``control.stop_reason`` (unless a stop already gave one) when the run ends right after an
        error an EXCEPTION handler handled."""
        state, control = self._state(), self._control
        if control.stop_reason is not None or self._last_handled is None:
            return
        step, what = self._last_handled
        if step != state.iteration:  # a step completed after it: the run ended normally
            return
        max_steps, max_epochs = state.max_iters, state.max_epochs
        if max_steps is not None and state.iteration >= max_steps:
            limit = f"at max_steps={max_steps}"
        elif max_epochs is not None and state.epoch >= max_epochs:
            limit = f"at max_epochs={max_epochs}"
        else:
            limit = "there (an error outside an epoch's steps ends the run)"
        control.stop_reason = (
            f"the run ended {limit} on a handled error: {what} at step {step} (epoch {state.epoch}), "
            "handled by an EXCEPTION handler; as in ignite, a handled error ends its epoch "
            f"({self.handled_errors} handled in this run)"
        )

    def _fail(self, e: BaseException) -> None:
        """TRAIN_FAILED handlers clean up after ``e`` (once per error)."""
        if id(e) in self._failed:
            return
        self._failed.add(id(e))
        for entry in self._events.entries(Events.TRAIN_FAILED):
            try:
                self._events.fire_entry(entry, (e,))
            except BaseException as handler_error:  # keep cleaning up; the original error wins
                logger.error("TRAIN_FAILED handler %r failed: %r", entry.original, handler_error)
