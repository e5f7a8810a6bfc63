"""How a run ends, for the person at the keyboard and the job script: Ctrl-C and ``exit_status.json``.

The trainer holds one :class:`RunEnd` (``trainer.run_end``), the counterpart of its
:class:`~engine.run_start.RunStart`. During ``run()``:

- **Ctrl-C.** The first SIGINT asks for a stop after the current step with a final checkpoint
  (exit code 75, agreed across ranks like any other stop, see :mod:`engine.control`); a second one
  interrupts at once (``KeyboardInterrupt``, 130). Only in the main thread, and only where SIGINT
  has Python's default handler (a handler or the user who installed their own keeps it).
- **The exit status.** However the run ends, rank 0 records it in ``run_dir/exit_status.json``
  (:mod:`engine.exit_status`): the exit code, the reason, the step, the last checkpoint, and for a
  run ended by one rank's error the ``rank`` that failed. A lost peer or a hang (77) is also
  recorded by the first worker of every other node (torchrun's ``LOCAL_RANK`` 0), unless the file
  changed since the run began (rank 0 recorded the end itself): the node lost may hold rank 0.
  Nothing is written before the run has started (RUN_STARTED): a refused start leaves the record
  of the last run as it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.errors import PeerCrashed, exit_code_of
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.exit_status import exit_status_identity, write_exit_status

__all__ = ["SIGINT_STOP_REASON", "RunEnd", "first_on_node"]

SIGINT_STOP_REASON = (
    "Ctrl-C (SIGINT): stopping after this step with a final checkpoint; press Ctrl-C again to "
    "interrupt at once"
)


def first_on_node() -> bool:
    """Whether this process is its node's first worker: torchrun's ``LOCAL_RANK`` 0 (``RANK`` and
    ``LOCAL_RANK`` differ on every node but the first). Without ``LOCAL_RANK``, only rank 0 is."""
    local = os.environ.get("LOCAL_RANK")
    return local == "0" if local is not None else parallel.rank() == 0


class RunEnd:
    """The Ctrl-C rule and the exit status record of one trainer (see the module docstring).

    ``control``: the trainer's :class:`~engine.control.StepControl` (Ctrl-C asks it for the stop);
    ``run_start``: its :class:`~engine.run_start.RunStart` (whether the run has started);
    ``state``: gives the trainer's state (the step and ``last_checkpoint`` recorded);
    ``run_dir``: where ``exit_status.json`` goes (None: nowhere)."""

    def __init__(
        self,
        control: Any,
        run_start: Any,
        state: Callable[[], Any],
        run_dir: str | os.PathLike | None,
        *,
        graceful_sigint: bool = True,
    ) -> None:
        self._control = control
        self._run_start = run_start
        self._state = state
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.graceful_sigint = bool(graceful_sigint)
        self._status_seen: tuple[int, int, int] | None = None  # exit_status.json when the run began

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The span of one ``run()``: Ctrl-C stops gracefully, the exit status as it is now is
        remembered (to tell whether rank 0 has recorded this run's end since), and an error that
        ends the run is recorded (:meth:`record_error`) before it propagates."""
        previous = self._install_sigint()
        if self.run_dir is not None:
            self._status_seen = exit_status_identity(self.run_dir)
        try:
            yield
        except BaseException as e:
            self.record_error(e)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _install_sigint(self) -> Any:
        """First Ctrl-C: an agreed stop after this step with a final checkpoint; second: interrupt.
        Returns the handler to put back, or None when none was installed."""
        if not self.graceful_sigint or threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None  # someone else (a handler listing SIGINT, the user) handles it

        def on_sigint(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            control = self._control
            control.request_save()
            control.request_stop(SIGINT_STOP_REASON, ExitCode.STOPPED)
            if parallel.rank() == 0:
                print(f"\n{control.stop_reason}", file=sys.stderr, flush=True)

        return signal.signal(signal.SIGINT, on_sigint)

    def record_error(self, error: BaseException) -> None:
        """Record a run ended by ``error``: its exit code, its type and message, and the rank whose
        error it was (a peer's, for :class:`~engine.errors.PeerCrashed`; else this rank)."""
        rank = error.rank if isinstance(error, PeerCrashed) else parallel.rank()
        self.write(exit_code_of(error), f"{type(error).__name__}: {error}", rank=rank)

    def write(self, code: int, reason: str, rank: int | None = None) -> None:
        """Record how the run ended, when this rank is the one to (rank 0; for 77, also the first
        worker of another node while the record is as it was when the run began) and the run has
        started. ``rank``: the rank whose error ended the run (recorded for a crash)."""
        if self.run_dir is None or not self._run_start.started:
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
        )
        self._status_seen = exit_status_identity(self.run_dir)  # this rank's own record may be refined
