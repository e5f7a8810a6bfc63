"""One run per run directory: the lock a run holds on its directory for its lifetime.

A run directory is the user's record, so two runs must never write it at once (the second would
take the first's in-flight checkpoint for a crashed run's leftovers and delete it, and both would
append the same steps to ``metrics.jsonl``). A run therefore holds ``<directory>/.hookloop.lock``
from before it writes anything until it ends; a second start finds it held and is refused at once
with a :class:`RunDirInUse` (a :class:`ConfigError`: exit code 2) naming the directory and the
holder::

    config error: train.run_dir: runs/gpt is in use by another run (host node07, pid 41233,
    started 2026-11-23T10:01:02+00:00): wait for it to end, or pick another train.run_dir

Under torchrun one process takes the lock for the whole launch (rank 0, :func:`hold_run_dir`) and
every rank learns the outcome from one agreed collective before anything is written.

**When is a holder dead?** A lock never outlives its run:

- The lock is an ``flock`` on the file, which the kernel drops when the holder's process ends, by
  any means (SIGKILL, the out-of-memory killer): on the same machine a killed run's lock never
  blocks the next start. Processes the holder forks do not keep it.
- The file also names the holder (host, pid, start time, boot id) and its modification time is a
  heartbeat: the holder touches it every :data:`HEARTBEAT_S` seconds. A holder on another host
  (a run directory on a file system shared by several nodes) is alive while its heartbeat is
  younger than :data:`STALE_AFTER_S` seconds, measured on the file system's own clock (the lock's
  modification time against that of a file written now), so node clocks never matter. A node
  that died therefore blocks the directory for at most :data:`STALE_AFTER_S` seconds; a job
  requeued after a node failure starts later than that. Where the file system shares ``flock``
  across nodes (NFSv4, GPFS, Lustre mounted with ``flock``) a live holder's lock is seen directly
  too; where it does not, the heartbeat alone tells a live holder from a dead one.
- A holder on this host is dead when its process is gone (or its pid now belongs to a process
  started at another time, or the machine rebooted since).
- A holder that is an earlier attempt of the same torchrun launch (same ``TORCHELASTIC_RUN_ID``,
  a lower ``TORCHELASTIC_RESTART_COUNT``) is dead: torchrun stops every worker before it restarts.

The lock file is never reached through a symbolic link: a link at its name (to a file of the
user's, a directory, or nowhere) refuses the start in one line naming the link (a
:class:`ConfigError`, exit code 2), and the link's target is left as it was.

A run that ends releases the lock (the file is removed). A run that never started (refused, or
failed before its first step) also removes the run directory it created for the lock, when nothing
else is in it: a refused start leaves no directory behind.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hookloop.engine.errors import ConfigError
from hookloop.engine.files import open_no_link

__all__ = [
    "HEARTBEAT_S",
    "LOCK_FILE",
    "STALE_AFTER_S",
    "Holder",
    "RunDirInUse",
    "RunDirLock",
    "held_lock_covering",
    "hold_for",
    "hold_run_dir",
    "release_for",
    "read_holder",
]

logger = logging.getLogger(__name__)

LOCK_FILE = ".hookloop.lock"
#: How often the holder touches the lock file (its heartbeat), in seconds.
HEARTBEAT_S = 15.0
#: A holder on another host whose heartbeat is older than this (on the file system's clock) is dead.
STALE_AFTER_S = 120.0
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

_held: dict[str, RunDirLock] = {}  # this process's locks by directory (absolute, resolved)
_held_guard = threading.Lock()


class RunDirInUse(ConfigError):
    """The directory is held by another live run (or by this process already); nothing was written."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the lock file records."""

    host: str
    pid: int
    started: str  # ISO 8601, UTC, to the second
    boot_id: str = ""
    proc_start: int | None = None  # the pid's start time in clock ticks since boot (/proc/<pid>/stat)
    launch: str = ""  # TORCHELASTIC_RUN_ID of a torchrun launch ("" without one)
    attempt: int = 0  # TORCHELASTIC_RESTART_COUNT

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"

    @classmethod
    def of_this_process(cls) -> Holder:
        launch = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            boot_id=_boot_id(),
            proc_start=_proc_start(os.getpid()),
            launch="" if launch == "none" else launch,
            attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        )

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            record = json.loads(raw.decode("utf-8"))
            return cls(**{k: record[k] for k in cls.__dataclass_fields__ if k in record})
        except (ValueError, TypeError, KeyError, AttributeError):
            return None  # empty (a holder killed while writing it) or not ours: nobody holds it


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; None when unknown or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return None if fields[0] == "Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int, proc_start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    if not Path("/proc/self/stat").exists():
        return True  # no /proc to tell a reused pid or a zombie from the holder: alive
    now = _proc_start(pid)  # None: a zombie, or gone since
    return now is not None and (proc_start is None or now == proc_start)


def read_holder(directory: str | os.PathLike) -> Holder | None:
    """Who the lock file in ``directory`` names (None: no lock file, or an empty one)."""
    try:
        return Holder.parse(Path(directory, LOCK_FILE).read_bytes())
    except OSError:
        return None


class RunDirLock:
    """The lock on one run directory (see the module docstring). ``field`` names the setting a
    refusal points at (``train.run_dir``)."""

    def __init__(self, directory: str | os.PathLike, *, field: str = "train.run_dir") -> None:
        self.directory = Path(directory)
        self.key = os.path.realpath(directory)
        self.path = self.directory / LOCK_FILE
        self.field = field
        self.holder: Holder | None = None  # ours once acquired
        #: Within this process, who writes under the lock (see :func:`hold_for`); None: nobody yet.
        self.user: object | None = None
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._created: list[Path] = []  # directories acquire() made, outermost last
        self._beat_failed = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunDirLock:
        """Take the lock, creating the directory if needed, and return it; :class:`RunDirInUse`
        naming the holder when a live run holds it. Nothing in the directory is changed on a refusal."""
        with _held_guard:
            if self.key in _held:
                raise self._in_use(_held[self.key].holder, "this process")
            self._create_directory()
            try:
                for _ in range(10):  # the file at the path changed under us: a holder just released
                    if self._try_acquire():
                        break
                else:
                    raise RunDirInUse(self.field, f"{self.directory}: could not take {self.path}; try again")
            except BaseException:
                self._remove_created()
                raise
            _held[self.key] = self
        _start_heartbeat()
        return self

    def _create_directory(self) -> None:
        missing, path = [], self.directory.absolute()
        while not path.exists():
            missing.append(path)
            path = path.parent
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:
                continue
            self._created.insert(0, path)

    def _try_acquire(self) -> bool:
        fd = open_no_link(self.path, os.O_RDWR | os.O_CREAT, field=self.field)
        try:
            kernel_lock = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._in_use(Holder.parse(_read_all(fd)), None) from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
                kernel_lock = False  # a file system without flock: the heartbeat decides alone
            st = os.fstat(fd)
            try:
                current = os.lstat(self.path)
            except FileNotFoundError:
                current = None
            if current is None or (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                return False
            previous = Holder.parse(_read_all(fd))
            if previous is not None and self._alive(previous, st.st_mtime, kernel_lock):
                raise self._in_use(previous, None)
            if previous is not None:
                logger.info(
                    "%s: taking over the lock of a run that is gone (%s)", self.directory, previous.describe()
                )
            self.holder = Holder.of_this_process()
            data = json.dumps(asdict(self.holder), indent=1).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._inode = fd, (st.st_dev, st.st_ino)
        return True

    def _alive(self, holder: Holder, heartbeat: float, kernel_lock: bool) -> bool:
        """Whether the run ``holder`` names is alive (we hold the flock, so on this host it is not)."""
        me = Holder.of_this_process()
        if holder.host == me.host:
            if kernel_lock or (holder.boot_id and holder.boot_id != me.boot_id):
                return False
            return _pid_alive(holder.pid, holder.proc_start)
        if holder.launch and holder.launch == me.launch and holder.attempt < me.attempt:
            return False  # an earlier attempt of this torchrun launch: torchrun stopped it
        return self._fs_now() - heartbeat < STALE_AFTER_S

    def _fs_now(self) -> float:
        """Now, on the clock of the file system the directory is on (a new file's modification time)."""
        probe = self.directory / f".hookloop-clock-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            os.unlink(probe)

    def _in_use(self, holder: Holder | None, who: str | None) -> RunDirInUse:
        if who is None:
            who = f"another run ({holder.describe()})" if holder is not None else "another run"
        return RunDirInUse(
            self.field,
            f"{self.directory} is in use by {who}: wait for it to end, or pick another {self.field}",
        )

    def _touch(self) -> None:
        if self._fd is None or self._beat_failed:
            return
        try:
            os.utime(self.path, follow_symlinks=False)
        except OSError as e:  # the directory went away or turned read-only: say so once
            self._beat_failed = True
            logger.warning("cannot refresh the run directory lock %s: %s", self.path, e)

    def release(self, *, remove_created: bool = False) -> None:
        """Give the lock up (the file goes). ``remove_created``: also remove the directories
        :meth:`acquire` created, those left empty (a start that never began leaves none behind)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)
            with _held_guard:
                if _held.get(self.key) is self:
                    del _held[self.key]
        if remove_created:
            self._remove_created()
        self._created = []

    def _remove_created(self) -> None:
        for path in self._created:
            try:
                path.rmdir()
            except OSError:
                return  # not empty (or gone): it stays, and so do its parents

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


_beating: threading.Thread | None = None  # the heartbeat of every lock this process holds


def _start_heartbeat() -> None:
    global _beating
    with _held_guard:
        if _beating is None:
            _beating = threading.Thread(target=_beat, name="hookloop-run-lock", daemon=True)
            _beating.start()


def _beat() -> None:
    """Touch every lock this process holds each :data:`HEARTBEAT_S` seconds. One thread for the
    process's life: locks come and go, no thread starts or ends with them."""
    while True:
        time.sleep(HEARTBEAT_S)
        with _held_guard:
            locks = list(_held.values())
        for lock in locks:
            lock._touch()


def _drop_in_child() -> None:
    """A forked child (a data loader worker) must not keep its parent's locks alive."""
    global _beating
    _beating = None  # the parent's heartbeat thread does not exist here
    for lock in list(_held.values()):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def held_lock_covering(path: str | os.PathLike) -> RunDirLock | None:
    """The lock this process holds on ``path`` or on a directory that contains it (None: none)."""
    target = os.path.realpath(path)
    with _held_guard:
        for key, lock in _held.items():
            if target == key or target.startswith(key.rstrip(os.sep) + os.sep):
                return lock
    return None


def hold_run_dir(directory: str | os.PathLike, *, field: str = "train.run_dir") -> RunDirLock | None:
    """Take the lock on ``directory`` for every rank of this launch (see the module docstring).
    Returns the lock on rank 0 (None elsewhere); raises :class:`RunDirInUse` on every rank when it
    is held (rank 0's names the holder)."""
    return _agreed(lambda: RunDirLock(directory, field=field).acquire(), directory, field)


def hold_for(user: object, directory: str | os.PathLike, *, field: str) -> RunDirLock | None:
    """Hold ``directory`` for ``user``, one writer of it within a run (a checkpoint handler), on
    every rank of the launch: under the lock this process holds on it or on a directory containing
    it (the run directory's, taken by the composition root), claimed for ``user``; else under a
    lock of its own, which is returned (rank 0) for the caller to release. Refused with
    :class:`RunDirInUse` on every rank when another run holds it, or when another user of this
    process (another trainer's) has claimed it. :func:`release_for` gives a claim up."""

    def take() -> RunDirLock | None:
        covering = held_lock_covering(directory)
        if covering is None:
            lock = RunDirLock(directory, field=field).acquire()
            lock.user = user
            return lock
        if covering.user is not None and covering.user is not user:
            raise RunDirInUse(
                field, f"{directory} is in use by this process: wait for it to end, or pick another {field}"
            )
        covering.user = user
        return None

    return _agreed(take, directory, field)


def release_for(user: object, directory: str | os.PathLike) -> None:
    """Give up ``user``'s claim on the lock covering ``directory`` (see :func:`hold_for`)."""
    covering = held_lock_covering(directory)
    if covering is not None and covering.user is user:
        covering.user = None


def _agreed(take: Any, directory: str | os.PathLike, field: str) -> RunDirLock | None:
    """``take()`` on rank 0, its outcome agreed by every rank (one collective) before any raises."""
    from hookloop.engine import parallel

    lock, refusal = None, None
    if parallel.rank() == 0:
        try:
            lock = take()
        except BaseException as e:  # noqa: BLE001 - every rank must hear of it before anyone raises
            lock, refusal = None, e
    if parallel.agree_any(refusal is not None):
        if lock is not None:
            lock.release(remove_created=True)
        if refusal is not None:
            raise refusal
        raise RunDirInUse(field, f"{directory}: rank 0 could not take the run directory's lock")
    return lock
