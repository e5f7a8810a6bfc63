"""A progress watchdog: a bounded exit when the training loop stops making progress.

A rank blocked inside a collective whose peer is stopped (SIGSTOP, a hung GPU, a frozen node) waits
until the process group's own timeout, 10 minutes by default, and a check run between steps never
gets control back. The watchdog is a daemon thread the loop feeds (every event, every microbatch).
When it has not been fed for ``timeout_s`` seconds it writes every thread's stack to
``<dump_dir>/hang-rank<R>-<pid>.txt`` (``faulthandler``), logs where, calls the ``on_expire``
callbacks (no collectives there: the peer is gone) and ends the process with exit code 77
(:attr:`engine.ExitCode.HEALTH_CHECK_FAILED`) through ``os._exit``, the only exit a thread can force
while the main thread is stuck in C++.

Several bounds may be active at once (the trainer's ``hang_timeout_s``, a health check's tighter
``timeout_s``); the smallest wins.

Slow is not hung. ``suspended()`` lifts the bound around a *local* wait that is long by nature and
bounded by its own timeout (a checkpoint write still on disk, verifying a checkpoint on slow
storage); the collectives before and after it stay under the bound. With several ranks the
watchdogs also look at each other through the process group's store (:class:`PeerHeartbeats`):
each beats a counter every quarter bound (at most every 5 s) saying whether its rank is in such a
long wait. A rank held in a collective past the bound looks twice, 1.5 beats apart: when a peer in
a long wait beat meanwhile (and no peer stopped beating), that peer is slow but alive and the bound
starts over. A rank in a long wait looks once a bound: when a peer stopped beating (SIGSTOP, a
dead process, or a store that no longer answers), the wait may hold a collective with it (an
async checkpoint write does), so it ends the process with 77 all the same. So a stopped peer ends
the survivor with 77 about one bound after its last beat, whatever the survivor was waiting in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.checks import check_number
from hookloop.engine.errors import ConfigError
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.files import open_no_link

__all__ = ["PeerHeartbeats", "PeerLook", "ProgressWatchdog", "dump_stacks"]

logger = logging.getLogger(__name__)


class ProgressWatchdog:
    """Ends the process with exit code 77 when :meth:`feed` was not called for the active bound;
    the stacks go to ``dump_dir`` (None: stderr)."""

    exit_code = int(ExitCode.HEALTH_CHECK_FAILED)

    def __init__(self, timeout_s: float, *, rank: int = 0) -> None:
        check_number("timeout_s", timeout_s, positive=True, hint="seconds")
        self.dump_dir: Path | None = None
        self.rank = rank
        self._bounds: dict[str, float] = {"default": float(timeout_s)}
        self._last = time.monotonic()
        self._suspended = 0
        self._suspended_since = self._last
        self._last_look = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_expire: list[Callable[[str], None]] = []
        #: With several ranks: how this rank's long waits show as progress to its peers, and how
        #: theirs show to it (None: one process, or no store).
        self.heartbeats: PeerHeartbeats | None = None

    @property
    def timeout_s(self) -> float:
        """The active bound: the smallest of those set."""
        return min(self._bounds.values())

    def set_bound(self, name: str, timeout_s: float | None) -> None:
        """Add, change (or with None remove) a named bound; the smallest active one applies."""
        if timeout_s is None:
            self._bounds.pop(name, None)
            return
        check_number(f"bound {name!r}", timeout_s, positive=True, hint="seconds")
        self._bounds[name] = float(timeout_s)

    def feed(self) -> None:
        self._last = time.monotonic()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """No bound inside (a local wait that has its own timeout; see the module docstring); fed
        again on the way out."""
        self._suspended += 1
        heartbeats = self.heartbeats
        if self._suspended == 1:
            self._suspended_since = time.monotonic()
            if heartbeats is not None:
                heartbeats.set_busy(True)
        try:
            yield
        finally:
            self._suspended -= 1
            if self._suspended == 0 and heartbeats is not None:
                heartbeats.set_busy(False)
            self.feed()

    def _beat_interval(self) -> float:
        return min(5.0, self.timeout_s / 4)

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self.feed()
            if self.heartbeats is not None:
                self.heartbeats.start(self._beat_interval())
            self._thread = threading.Thread(target=self._watch, name="hookloop-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.heartbeats is not None:
            self.heartbeats.stop()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            heartbeats = self.heartbeats
            now = time.monotonic()
            if self._suspended:
                # a long local wait: only a peer that stopped beating ends it (once a bound)
                if heartbeats is None or now - max(self._suspended_since, self._last_look) <= self.timeout_s:
                    continue
                self._last_look = now
                look = heartbeats.look(self._beat_interval())
                if look.stopped and self._suspended:
                    self._expire(time.monotonic() - self._suspended_since, look.describe())
                    return
                continue
            idle = now - self._last
            if idle <= self.timeout_s:
                continue
            look = heartbeats.look(self._beat_interval()) if heartbeats is not None else None
            if look is not None and look.busy and not look.stopped:
                self.feed()  # a peer's long wait holds this rank in a collective: slow, not hung
                continue
            idle = time.monotonic() - self._last  # the loop may have moved on meanwhile
            if self._suspended or idle <= self.timeout_s:
                continue
            self._expire(idle, look.describe() if look is not None else "")
            return

    def _expire(self, idle: float, peers: str = "") -> None:
        reason = (
            f"no progress for {idle:.1f}s (bound {self.timeout_s:g}s) on rank {self.rank}: "
            "a peer is hung or gone, or a step blocked"
        ) + (f" ({peers})" if peers else "")
        path = dump_stacks(self.dump_dir, self.rank, reason)
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


@dataclasses.dataclass
class PeerLook:
    """What :meth:`PeerHeartbeats.look` saw: peers in a long wait that beat (``busy``), peers that
    did not beat at all (``stopped``), and whether the store answered."""

    busy: list[int]
    stopped: list[int]
    answered: bool = True

    def describe(self) -> str:
        if not self.answered:
            return "the process group's store does not answer: the rank hosting it is stopped or gone"
        if self.stopped:
            return f"no heartbeat from rank {', '.join(map(str, self.stopped))}"
        return "no peer is in a long wait"


class PeerHeartbeats:
    """Each rank's beat under ``hookloop/heartbeat/<rank>`` in the process group's store (see the
    module docstring): ``busy:<n>`` while the rank is in a long local wait, ``idle:<n>`` otherwise,
    from a thread of its own, so a rank blocked in a collective still beats."""

    PREFIX = "hookloop/heartbeat/"

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._busy = False
        self._wake = threading.Event()
        self._stop: threading.Event | None = None

    def _key(self, rank: int) -> str:
        return f"{self.PREFIX}{rank}"

    def start(self, interval_s: float) -> None:
        """Beat every ``interval_s`` seconds until :meth:`stop`."""
        self.stop()
        stop = self._stop = threading.Event()
        thread = threading.Thread(
            target=self._beat, args=(stop, interval_s), name="hookloop-heartbeat", daemon=True
        )
        thread.start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._wake.set()
            self._stop = None

    def set_busy(self, busy: bool) -> None:
        """Say (at the next beat, which comes at once) whether this rank is in a long local wait."""
        self._busy = busy
        self._wake.set()

    def _beat(self, stop: threading.Event, interval_s: float) -> None:
        count = 0
        try:
            while not stop.is_set():
                count += 1
                self.store.set(self._key(self.rank), f"{'busy' if self._busy else 'idle'}:{count}")
                self._wake.wait(interval_s)
                self._wake.clear()
        except Exception as e:  # noqa: BLE001 - a store gone (the run is ending): beat no more
            logger.debug("heartbeat stopped: %r", e)

    def _read(self) -> dict[int, bytes]:
        values = {}
        for peer in range(self.world_size):
            key = self._key(peer)
            if peer != self.rank and self.store.check([key]):
                values[peer] = self.store.get(key)
        return values

    def _read_bounded(self, timeout_s: float) -> dict[int, bytes] | None:
        """The peers' beats, or None when the store did not answer (no evidence of progress)."""
        return parallel.bounded_call(self._read, timeout_s, "hookloop-heartbeat-read")

    def look(self, interval_s: float) -> PeerLook:
        """Read the peers' beats twice, 1.5 beats apart (blocks about that long)."""
        timeout = max(1.0, 2 * interval_s)
        before = self._read_bounded(timeout)
        if before is not None:
            time.sleep(1.5 * interval_s)
        after = self._read_bounded(timeout) if before is not None else None
        if after is None:
            return PeerLook([], [], answered=False)
        beat = {peer for peer, value in after.items() if before.get(peer) != value}
        stopped = sorted(peer for peer in after if peer not in beat)  # a peer not started yet is no evidence
        busy = sorted(peer for peer in beat if after[peer].startswith(b"busy"))
        return PeerLook(busy, stopped)


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
        with os.fdopen(open_no_link(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            f.write(f"{reason}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
    except (OSError, ConfigError):  # not writable, or a link at its name
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return None
    return path
