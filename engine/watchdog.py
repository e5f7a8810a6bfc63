"""A progress watchdog: a bounded exit when the training loop stops making progress.

A rank blocked inside a collective whose peer is stopped (SIGSTOP, a hung GPU, a frozen node) waits
until the process group's own timeout, 10 minutes by default, and a check run between steps never
gets control back. The watchdog is a daemon thread the loop feeds (every event, every microbatch).
When it has not been fed for ``timeout_s`` seconds it writes every thread's stack to
``<dump_dir>/hang-rank<R>-<pid>.txt`` (``faulthandler``), logs where, calls the ``on_expire``
callbacks (no collectives there: the peer is gone) and ends the process with exit code 77
(:attr:`engine.ExitCode.HEALTH_CHECK_FAILED`) through ``os._exit``, the only exit a thread can force
while the main thread is stuck in C++.

Several bounds may be active at once (the trainer's ``hang_timeout_s``, a HealthCheck's tighter
``timeout_s``); the smallest wins. ``suspended()`` lifts them around waits that are long by nature
and bounded elsewhere.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hookloop.engine.exit_codes import ExitCode

__all__ = ["ProgressWatchdog", "dump_stacks"]

logger = logging.getLogger(__name__)


class ProgressWatchdog:
    """Ends the process with ``exit_code`` when :meth:`feed` was not called for the active bound."""

    def __init__(
        self,
        timeout_s: float,
        *,
        dump_dir: str | os.PathLike | None = None,
        exit_code: int = ExitCode.HEALTH_CHECK_FAILED,
        rank: int = 0,
        poll_s: float | None = None,
    ) -> None:
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s < float("inf")
        ):
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.exit_code = int(exit_code)
        self.rank = rank
        self._bounds: dict[str, float] = {"default": float(timeout_s)}
        self._poll_s = poll_s
        self._last = time.monotonic()
        self._suspended = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_expire: list[Callable[[str], None]] = []
        self.expired_path: Path | None = None

    # ------------------------------------------------------------------ bounds
    @property
    def timeout_s(self) -> float:
        """The active bound: the smallest of those set."""
        return min(self._bounds.values())

    def set_bound(self, name: str, timeout_s: float | None) -> None:
        """Add, change (or with None remove) a named bound; the smallest active one applies."""
        if timeout_s is None:
            self._bounds.pop(name, None)
            return
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"bound {name!r} must be a positive finite number of seconds, got {timeout_s!r}")
        self._bounds[name] = float(timeout_s)

    # ------------------------------------------------------------------ feeding
    def feed(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No bound inside (a wait that has its own timeout); fed again on the way out."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1
            self.feed()

    # ------------------------------------------------------------------ thread
    def start(self) -> ProgressWatchdog:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self.feed()
            self._thread = threading.Thread(target=self._watch, name="hookloop-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s or min(1.0, self.timeout_s / 10)):
            if self._suspended:
                continue
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._expire(idle)
                return

    def _expire(self, idle: float) -> None:
        reason = (
            f"no progress for {idle:.1f}s (bound {self.timeout_s:g}s) on rank {self.rank}: "
            "a peer is hung or gone, or a step blocked"
        )
        path = self._dump(reason)
        where = f"; stacks of every thread in {path}" if path else ""
        logger.critical("%s%s; exiting with code %d", reason, where, self.exit_code)
        for callback in list(self.on_expire):
            try:
                callback(reason)
            except BaseException as e:  # noqa: BLE001 - nothing may stop the exit
                logger.error("watchdog callback %r failed: %r", callback, e)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.exit_code)

    def _dump(self, reason: str) -> Path | None:
        path = dump_stacks(self.dump_dir, self.rank, reason)
        if path is not None:
            self.expired_path = path
        return path


def dump_stacks(dump_dir: str | os.PathLike | None, rank: int, reason: str) -> Path | None:
    """Write ``reason`` and every thread's stack to ``<dump_dir>/hang-rank<R>-<pid>.txt`` and
    return its path; to stderr (returning None) without a directory or when it cannot be written."""
    if dump_dir is None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return None
    directory = Path(dump_dir)
    path = directory / f"hang-rank{rank}-{os.getpid()}.txt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{reason}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return None
    return path
