"""The files a checkpoint writer makes: checksummed as they are written, durable once closed.

DCP's file writer opens every file it writes through its ``FileSystem`` (``create_stream``);
:class:`ChecksummingFileSystem` hands it streams that

- compute the CRC-32 of the bytes as they pass, so a file is never read back to checksum it. A
  large write (a tensor's storage) is checksummed on a helper thread while the same bytes are
  copied into the page cache, and the write returns only once both are done (its buffer is the
  caller's: nothing may read it later). CRC-32 (:func:`crc32`) runs at about 7.7 GB/s here and
  the copy at 2.5-4, so on 2 cores the checksum costs the write almost nothing. Writes under
  64 KiB are gathered into one, the others go to the file as they come: gathering copies while
  holding the interpreter lock, which an async save's writer thread shares with training;
- start the kernel's writeback of every :data:`WRITEBACK_CHUNK` written (``sync_file_range`` on
  Linux, from a thread of its own; elsewhere, or when it fails, the fsync does it all), so that
  the disk writes while the rest is serialized and the fsync at the close has little left: a
  200 MB write + fsync took 190 ms so against 245 ms without (medians of 6, interleaved);
- write a large entry's whole pages straight to the disk (``O_DIRECT``, Linux) instead of copying
  them into the page cache. The writer first pads the file with zeros (under a page) so that the
  entry's offset and its memory's address agree modulo :data:`PAGE` (:meth:`~_ChecksummingFile.place`);
  the part of a page at each end goes through the page cache, which never holds a page a direct
  write also writes. Writing 200 MB and fsyncing it took 9-12 ms of CPU so, against 46-72 ms
  through the page cache (86-131 ms against 116-206 ms on the clock); a save of a 200 MB state
  took 20-28 ms of its writer thread's CPU against 92-102 ms, CPU an async save takes from
  training beside it. A file system that refuses direct writes (as the flag is set, or at a
  write, for a stricter alignment) gets the rest of the bytes through the page cache, and the
  files after it all of them;
- fsync the file when it is closed (once: DCP's own ``sync_files`` fsync is off): for directly
  written pages too, whose data may sit in the disk's own cache until then;
- write over the file of the same name a pruned checkpoint left in ``reuse`` (moved into place,
  cut to its new size at the close) instead of making a new one: its pages are still in the page
  cache and its blocks allocated, so 200 MB took 37-51 ms to write and 108-160 ms to make durable
  against 48-63 and 156-210 ms for a new file, on an idle machine and beside training alike.

``entries`` then maps each closed file's name to ``(size, crc32)``, renames (DCP writes
``.metadata`` under a temporary name) included. Making the *names* durable is the publisher's
directory fsync, which comes before anything can see the files (see the checkpoint store).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import io
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from torch.distributed.checkpoint.filesystem import FileSystem

from hookloop.engine.files import fsync_fd, open_no_link
from hookloop.engine.intra_op import lower_priority

try:  # zlib-ng's CRC-32 gives zlib's values at 7.7 GB/s on this machine's CPU, against 3.4 GB/s
    from zlib_ng.zlib_ng import crc32  # (vector instructions); both release the GIL on large buffers
except ImportError:  # pragma: no cover - zlib-ng is a dependency; a build without it still works
    from zlib import crc32

__all__ = ["WRITEBACK_CHUNK", "ChecksummingFileSystem", "crc32", "write_durable"]

#: How much a stream writes before it asks the kernel to start writing it back.
WRITEBACK_CHUNK = 16 << 20
_HELPED = 1 << 20  # writes from this size on are checksummed beside the copy
_DIRECT = 64 << 10  # smaller writes are gathered (a copy that holds the interpreter lock)
#: Direct writes go in whole pages of this size, page-aligned in memory and in the file (a multiple
#: of every block size and memory alignment a Linux file system asks of ``O_DIRECT``).
PAGE = 4096
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # libc's, once looked up; False: none


def _writeback() -> Any:
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _sync_file_range = fn
            except (OSError, AttributeError):
                pass
    return _sync_file_range


def _timed_crc32(data: Any, crc: int) -> tuple[int, float]:
    start = time.perf_counter()
    return crc32(data, crc), time.perf_counter() - start


def _address(view: memoryview) -> int:
    """Where ``view``'s bytes start in memory."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


class _ChecksummingFile(io.IOBase):
    """A new file opened for writing: small writes gathered into one, the CRC-32 and size of what
    passed, early writeback; at the close, fsync and ``on_close(size, crc)``."""

    def __init__(self, path: str, owner: ChecksummingFileSystem, on_close: Any, reused: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT
        self._fd = open_no_link(path, flags if reused else flags | os.O_TRUNC, field="checkpoint.directory")
        self._reused = reused  # written over from the start, cut to its new size at the close
        self._owner, self._on_close = owner, on_close
        self._pending = bytearray()
        self._writeback: Future | None = None
        self.size = self.crc = self._started = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self.size + len(self._pending)

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if len(view) < _DIRECT:
            self._pending += view
            if len(self._pending) >= _DIRECT:
                self.flush()
            return len(view)
        self.flush()
        if len(view) < _HELPED:  # checksum, then copy: both without the interpreter lock
            self._write_checksummed(view)
            return len(view)
        checksum = self._owner.helper("checksum").submit(_timed_crc32, view, self.crc)
        try:
            self._write_large(view)
        finally:
            written = time.perf_counter()
            self.crc, seconds = checksum.result()
            self._owner.add_timings(seconds, time.perf_counter() - written)
        self._advance(len(view))
        return len(view)

    def place(self, view: memoryview) -> None:
        """Before an entry of ``view``'s bytes: pad the file with zeros so that the entry's offset
        and its memory's address are the same modulo :data:`PAGE` (only for a large ``view`` and
        while this file system writes directly), which lets :meth:`write` hand the disk the
        entry's whole pages without the page cache."""
        if len(view) >= _HELPED and self._owner.direct:
            pad = (_address(view) - self.tell()) % PAGE
            if pad:
                self.write(bytes(pad))

    def _write_large(self, view: memoryview) -> None:
        """Write ``view``: the whole pages of it straight to the disk (``O_DIRECT``) when its
        address and the file's position agree modulo :data:`PAGE` (see :meth:`place`), the rest
        (and all of it otherwise, or where the file system refuses direct writes) through the page
        cache."""
        head = (-_address(view)) % PAGE
        pages = (len(view) - head) // PAGE * PAGE
        if not (self._owner.direct and pages and (self.size + head) % PAGE == 0):
            _write_all(self._fd, view)
            return
        _write_all(self._fd, view[:head])
        written = self._write_direct(view[head : head + pages], self.size + head)
        _write_all(self._fd, view[head + written :])

    def _write_direct(self, view: memoryview, position: int) -> int:
        """Write ``view`` (whole pages, page-aligned in memory and at ``position``, the file's
        position) with ``O_DIRECT``; how much was written, the file's position after it: short of
        all of it only when the file system refused direct writes (its ``direct`` is then off for
        the files still to come)."""
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError:
            self._owner.direct = False
            return 0
        done = 0
        try:
            while done < len(view):
                done += os.write(self._fd, view[done:])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._owner.direct = False  # a constraint beyond whole pages: the page cache takes the rest
        finally:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
        if done % PAGE:  # a short write that ended inside a page: the page cache rewrites that page
            done -= done % PAGE
            os.lseek(self._fd, position + done, os.SEEK_SET)
        return done

    def flush(self) -> None:
        if self._pending:
            self._write_checksummed(memoryview(self._pending))
            self._pending.clear()

    def _write_checksummed(self, view: memoryview) -> None:
        """Checksum ``view``, then write it, both on this thread."""
        self.crc, seconds = _timed_crc32(view, self.crc)
        self._owner.add_timings(seconds, seconds)
        _write_all(self._fd, view)
        self._advance(len(view))

    def _advance(self, n: int) -> None:
        self.size += n
        if self.size - self._started >= WRITEBACK_CHUNK and (writeback := _writeback()):
            # on a thread of its own: submitting the writeback can block, the copying goes on
            start, length = self._started, self.size - self._started
            self._writeback = self._owner.helper("writeback").submit(
                writeback, self._fd, start, length, _SYNC_FILE_RANGE_WRITE
            )
            self._started = self.size

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            if self._owner.on_written is not None:  # every byte has reached the page cache
                self._owner.on_written()
            if self._writeback is not None:  # the file stays open until the last one returned
                self._writeback.result()
            if self._reused:
                os.ftruncate(self._fd, self.size)
            fsync_fd(self._fd)
            self._on_close(self.size, self.crc)
        finally:
            self._pending.clear()
            os.close(self._fd)
            super().close()

    def abandon(self) -> None:
        """Close without writing what is pending, fsync or entry (the write failed)."""
        if not self.closed:
            self._pending.clear()
            if self._writeback is not None:
                with contextlib.suppress(Exception):
                    self._writeback.result()
            os.close(self._fd)
            super().close()


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system whose written files are checksummed, written back early and fsynced
    at the close (see the module docstring); ``entries``: ``{name: (size, crc32)}`` of the files
    closed so far; ``checksum_s`` the seconds spent checksumming, ``exposed_s`` those the writes
    waited for beyond their own copying; ``on_written``, when set, is called as each written file
    is closed, once its bytes are in the page cache and before its fsync. ``close()`` stops the
    helper threads."""

    def __init__(self, reuse: str | os.PathLike | None = None, direct: bool = True) -> None:
        super().__init__()
        self.on_written: Any = None
        self.reuse = reuse
        #: large writes go to the disk directly (Linux; off once a file system refuses)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.entries: dict[str, tuple[int, int]] = {}
        self.checksum_s = self.exposed_s = 0.0
        self._lock = threading.Lock()
        self._helpers: dict[str, ThreadPoolExecutor] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(path)

        def record(size: int, crc: int) -> None:
            with self._lock:
                self.entries[name] = (size, crc)

        stream = _ChecksummingFile(os.fspath(path), self, record, reused=self._take_reused(os.fspath(path)))
        try:
            yield stream
        except BaseException:
            stream.abandon()
            raise
        stream.close()

    def _take_reused(self, path: str) -> bool:
        """Move the file of ``path``'s name out of ``reuse`` (a pruned checkpoint's, see
        :data:`~.directory.REUSE`) to ``path``; whether there was one (a regular file) to write over."""
        if self.reuse is None:
            return False
        old = os.path.join(self.reuse, os.path.basename(path))
        try:
            if not stat.S_ISREG(os.lstat(old).st_mode):
                return False
            os.replace(old, path)
        except OSError:
            return False
        return True

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.entries.pop(os.path.basename(path), None)
            if entry is not None:
                self.entries[os.path.basename(new_path)] = entry

    def add_timings(self, checksum_s: float, exposed_s: float) -> None:
        with self._lock:
            self.checksum_s += checksum_s
            self.exposed_s += exposed_s

    def helper(self, kind: str) -> ThreadPoolExecutor:
        """The thread that checksums large writes beside their copy (``"checksum"``) or starts the
        writeback (``"writeback"``), made on first use."""
        with self._lock:
            if kind not in self._helpers:
                self._helpers[kind] = ThreadPoolExecutor(  # work without the interpreter lock
                    1, thread_name_prefix=f"hookloop-checkpoint-{kind}", initializer=lower_priority
                )
            return self._helpers[kind]

    def close(self) -> None:
        with self._lock:
            helpers, self._helpers = self._helpers, {}
        for helper in helpers.values():
            helper.shutdown(wait=True)


def write_durable(path: str | os.PathLike, data: bytes) -> tuple[int, int]:
    """Write ``data`` to the new file ``path`` and fsync it; ``(size, crc32)``. For files in a
    directory nobody reads before it is published (no temporary name: the directory's own fsync
    and rename make it visible)."""
    with os.fdopen(open_no_link(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(data)
        f.flush()
        fsync_fd(f.fileno())
    return len(data), crc32(data)
