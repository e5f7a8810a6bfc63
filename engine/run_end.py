"""How a run ends, for the person at the keyboard and the job script: stop signals, the time
limit, Ctrl-C and ``exit_status.json``.

The trainer holds one :class:`RunEnd` (``trainer.run_end``), the counterpart of its
:class:`~engine.run_start.RunStart`. During ``run()``:

- **Stop signals, the time limit, Ctrl-C: one path.** A signal handler only notes the signal; at
  the next agreement point :meth:`RunEnd.poll`, on the rank that saw it, asks the control point for
  a final checkpoint and a stop (exit code 75), agreed like any other stop (:mod:`engine.control`).
  Stop signals and the time limit are a scheduling handler's settings (:meth:`RunEnd.stop_on`). A
  second Ctrl-C interrupts at once (``KeyboardInterrupt``, 130); Ctrl-C is handled only in the main
  thread, and only where SIGINT has Python's default handler (one installed by others is kept).
- **The exit status.** However the run ends, rank 0 records it in ``run_dir/exit_status.json``
  (:mod:`engine.exit_status`): the exit code, the reason, the step, the last checkpoint, and for a
  run ended by one rank's error the ``rank`` that failed. A lost peer or a hang (77) is also
  recorded by the first worker of every other node (torchrun's ``LOCAL_RANK`` 0), unless the file
  changed since the run began (rank 0 recorded the end itself): the node lost may hold rank 0.
  Nothing is written before the run has started (RUN_STARTED): a refused start leaves the record
  of the last run as it was; only a start ended by an error with exit code 77 (a lost peer, no
  lighthouse) is recorded, since a job script requeues on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.checks import SignalLike, resolve_signals
from hookloop.engine.control import OTHER_RANK_STOP
from hookloop.engine.errors import PeerCrashed, exit_code_of
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.exit_status import exit_status_identity, write_exit_status

__all__ = [
    "SIGINT_STOP_REASON",
    "RunEnd",
    "StopSignals",
    "exit_after_run",
    "first_on_node",
    "resolve_signals",
]

logger = logging.getLogger(__name__)


SIGINT_STOP_REASON = (
    "Ctrl-C (SIGINT): stopping after this step with a final checkpoint; press Ctrl-C again to "
    "interrupt at once"
)


_exit_after_run = False


def exit_after_run() -> None:
    """Said by ``hookloop train``'s console script: this process leaves once its run ends. A rank
    of a job of several that stopped (a signal, the time limit: exit 75) then keeps its stop
    signals noted until it exits, as a failed rank always does, so the launcher's SIGTERM after a
    peer's exit cannot turn its own code into -15. A Python caller's run puts them back."""
    global _exit_after_run
    _exit_after_run = True


class StopSignals:
    """Signals that ask for a stop (their handlers only note them: nothing else is safe there) and a
    time limit from :meth:`install` on (``exit_duration_in_mins``, None: none)."""

    def __init__(
        self,
        signals: SignalLike | Sequence[SignalLike] | None = (),
        exit_duration_in_mins: float | None = None,
    ) -> None:
        self.signals = resolve_signals(signals)
        self.exit_duration_in_mins = None if exit_duration_in_mins is None else float(exit_duration_in_mins)
        #: The signal noted since :meth:`install` (None: none).
        self.noted: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._start: float | None = None

    def _note(self, signum: int, _frame: Any) -> None:
        self.noted = signal.Signals(signum)

    def install(self) -> None:
        """Start the clock and note the signals from now on (main thread only)."""
        self.noted = None
        self._start = time.monotonic()
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: stop signals %s are not handled", self.signals)
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def minutes(self) -> float:
        """Minutes since :meth:`install` (nan before)."""
        return float("nan") if self._start is None else (time.monotonic() - self._start) / 60.0

    def time_up(self) -> bool:
        return self.exit_duration_in_mins is not None and self.minutes() >= self.exit_duration_in_mins

    def reason(self, kind: str) -> str:
        """Why the run stops: ``kind`` ``"signal"`` (the signal noted here, else the one configured,
        else another rank's) or ``"duration"``."""
        if kind == "duration":
            return (
                f"exit_duration_in_mins={self.exit_duration_in_mins:g} reached ({self.minutes():.2f} min "
                "on this rank)"
            )
        if self.noted is not None:
            return f"signal {self.noted.name}"
        return f"signal {self.signals[0].name}" if len(self.signals) == 1 else "signal on another rank"


def first_on_node() -> bool:
    """Whether this process is its node's first worker: torchrun's ``LOCAL_RANK`` 0 (``RANK`` and
    ``LOCAL_RANK`` differ on every node but the first). Without ``LOCAL_RANK``, only rank 0 is."""
    local = os.environ.get("LOCAL_RANK")
    return local == "0" if local is not None else parallel.rank() == 0


class RunEnd:
    """The Ctrl-C rule and the exit status record of one trainer (see the module docstring), from
    the trainer's parts; ``run_dir``: where ``exit_status.json`` goes (None: nowhere)."""

    def __init__(
        self,
        control: Any,
        run_start: Any,
        state: Callable[[], Any],
        run_dir: str | os.PathLike | None,
        *,
        graceful_sigint: bool = True,
        agreement: Any = None,
        plan: Any = None,
    ) -> None:
        self._control = control
        self._run_start = run_start
        self._state = state
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.graceful_sigint = bool(graceful_sigint)
        self._status_seen: tuple[int, int, int] | None = None  # exit_status.json when the run began
        self._agreement, self._plan = agreement, plan
        #: The stop signals and time limit of :meth:`stop_on` (none until then).
        self.stops = StopSignals()
        self._sigint_noted = False
        #: ``"signal"`` or ``"duration"`` once a stop signal or the time limit asked for this run's stop.
        self.stop_kind: str | None = None

    def stop_on(
        self, signals: SignalLike | Sequence[SignalLike] | None, exit_duration_in_mins: float | None
    ) -> None:
        """Stop (final checkpoint, exit code 75, no validation at that step) on ``signals`` and after
        ``exit_duration_in_mins`` on any rank; a slot of the step's agreement tells every rank why."""
        self.stops = StopSignals(signals, exit_duration_in_mins)
        if self.stops.signals:
            self._agreement.add(
                "stop.signal", lambda: self.stop_kind == "signal", lambda n: self._agreed("signal", n)
            )
        if self.stops.exit_duration_in_mins is not None:
            self._agreement.add(
                "stop.duration", lambda: self.stop_kind == "duration", lambda n: self._agreed("duration", n)
            )

    def poll(self, in_step: bool = True) -> None:
        """On the rank that saw it: a noted Ctrl-C (at every agreement point), stop signal or reached
        time limit (``in_step``, before the step's agreement) becomes a save and a stop request."""
        control = self._control
        if self._sigint_noted:
            self._sigint_noted = False
            control.request_save("stop: signal SIGINT")
            control.request_stop(SIGINT_STOP_REASON, ExitCode.STOPPED)
            if parallel.rank() == 0:
                print(f"\n{control.stop_reason}", file=sys.stderr, flush=True)
        if self.stop_kind is not None or not in_step:
            return
        stops = self.stops
        kind = "signal" if stops.noted is not None else "duration" if stops.time_up() else None
        if kind is not None:
            self.stop_kind = kind
            self._request(stops.reason(kind))

    def _request(self, reason: str) -> None:
        logger.info("stop requested at step %d: %s", self._state().iteration, reason)
        self._control.request_save(f"stop: {reason}")
        if self._plan is None or not self._plan.is_last_step:  # a run ending here ends as finished
            self._control.request_stop(reason, ExitCode.STOPPED)

    def _agreed(self, kind: str, ranks: float) -> None:
        """After the step's agreement, on every rank alike: the validation is withdrawn (time is
        short), and a rank that did not see the signal or limit asks for the same stop, naming it."""
        if not ranks:
            return
        control = self._control
        control.withdraw_validate()  # agreed values: every rank withdraws alike
        if self.stop_kind is None:
            self.stop_kind = kind
            reason = self.stops.reason(kind)
            if control.stop_reason == OTHER_RANK_STOP:  # the slot says why every rank stops
                control.stop_reason = reason
            self._request(reason)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The span of one ``run()``: Ctrl-C stops gracefully, and an error that ends the run is
        recorded (:meth:`record_error`) before it propagates."""
        self._sigint_noted, self.stop_kind = False, None
        previous = self._install_sigint()
        self.stops.install()
        if self.run_dir is not None:
            self._status_seen = exit_status_identity(self.run_dir)
        failed = False
        try:
            yield
        except BaseException as e:
            failed = True
            self.record_error(e)
            raise
        finally:
            # A failed rank of a job of several is on its way out with its exit code decided: the stop
            # signals stay noted, so the launcher's SIGTERM to a node's other workers (torchrun sends
            # one once a worker exits non-zero) cannot turn this rank's own code into -15. So is one
            # that stopped, when the process leaves after the run (exit_after_run): a stopped peer
            # may exit first, and the launcher's SIGTERM follows.
            leaving = failed or (_exit_after_run and self.stop_kind is not None)
            if not (leaving and parallel.world_size() > 1):
                self.stops.restore()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _install_sigint(self) -> Any:
        """First Ctrl-C: an agreed stop after this step with a final checkpoint; second: interrupt.
        Returns the handler to put back, or None when none was installed."""
        if not self.graceful_sigint or threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None  # someone else (a handler listing SIGINT, the user) handles it

        def on_sigint(signum: int, frame: Any) -> None:  # noted; asked for at the next poll()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._sigint_noted = True

        return signal.signal(signal.SIGINT, on_sigint)

    def record_error(self, error: BaseException) -> None:
        """Record a run ended by ``error``: its exit code, its type and message, and the rank whose
        error it was (a peer's, for :class:`~engine.errors.PeerCrashed`; else this rank)."""
        rank = error.rank if isinstance(error, PeerCrashed) else parallel.rank()
        code = exit_code_of(error)
        at_start = code == ExitCode.HEALTH_CHECK_FAILED  # recorded at the start too (see above)
        self.write(code, f"{type(error).__name__}: {error}", rank=rank, at_start=at_start)

    def write(self, code: int, reason: str, rank: int | None = None, at_start: bool = False) -> None:
        """Record how the run ended, when this rank is the one to (see the module docstring) and the
        run has started (or ``at_start``). ``rank``: the rank whose error ended the run."""
        if self.run_dir is None or not (self._run_start.started or at_start):
            return  # a start that failed leaves the record as it was
        if parallel.rank() != 0:
            if code != ExitCode.HEALTH_CHECK_FAILED or not first_on_node():
                return
            if exit_status_identity(self.run_dir) != self._status_seen:
                return
        state = self._state()
        write_exit_status(
            self.run_dir,
            code=code,
            reason=reason,
            step=state.iteration,
            checkpoint=getattr(state, "last_checkpoint", None),
            rank=rank,
            nodes=self._control.exclude_nodes,
        )
        self._status_seen = exit_status_identity(self.run_dir)  # this rank's own record may be refined
