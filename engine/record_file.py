"""RecordFile: an appended file of JSON lines (``progress.jsonl``, ``metrics.jsonl``), a stream of
lines (the console's) or any writer of records (TensorBoard's event file), cheap per record.

Encoding a record and writing it with one system call per line, right after a training step (with
the caches cold), costs tens of microseconds per line and per file. A RecordFile takes the record
and returns at once; a background thread encodes what has gathered and writes it out at once, at
least every ``flush_secs`` seconds. The promise:

* records reach the file whole and in the order they were written (one thread writes at a time,
  whole lines only);
* a record is in the file (the operating system's: it survives the process being killed) at most
  ``flush_secs`` after it was written, after every :meth:`flush`, after :meth:`close`, and when the
  interpreter exits (an open RecordFile is flushed then). A process killed with SIGKILL (or ended
  by ``os._exit``) loses at most its last ``flush_secs`` of records.

The target is a path (opened for appending, its directory created; a symbolic link there is
refused, see :func:`engine.files.open_no_link`), an open text stream (the
console's ``sys.stdout``: only the flusher thread writes to it, or :meth:`flush` and :meth:`close`
after it; :meth:`close` flushes it and leaves it open) or a function that writes a list of records
and flushes what it wrote (called the same way).

Records hold values that do not change after they are written (numbers, strings); an error in
encoding or writing one is raised by the next :meth:`write`, :meth:`flush` or :meth:`close`.

Each step once: a file of lines that carry a ``"step"`` is cut back with :meth:`RecordFile.cut` (or
:func:`cut_to_step`) to the step a run starts from (at ``RUN_STARTED``), so the lines a killed
run wrote after its last checkpoint are gone before the resumed run writes those steps again. The
cut reads the file backwards from its end, in blocks, and stops at the first whole line of a step
to keep (a start costs the lines cut, not the file's length); a damaged line after it (torn by a
kill mid-write) is cut too, with a warning naming its line.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from hookloop.engine.files import fsync_fd, open_no_link

__all__ = ["FLUSH_SECS", "RecordFile", "cut_to_step", "flush_open"]

logger = logging.getLogger(__name__)

#: How long a written record may stay in memory: a killed run loses at most this many seconds of lines.
FLUSH_SECS = 1.0

_BLOCK = 1 << 16  # bytes read at a time, backwards from a file's end

_open: weakref.WeakSet[RecordFile] = weakref.WeakSet()  # flushed at exit if nobody closed them


def flush_open() -> None:
    """Write out every open RecordFile of this process now. The checkpointer calls it before a
    checkpoint becomes visible, so a run resumed from that checkpoint finds every record written
    before it; an error stays with its file and is raised to that file's writer."""
    for records in list(_open):
        records._drain_noting_error()


@atexit.register
def _flush_at_exit() -> None:
    for records in list(_open):
        try:
            records.flush()
        except Exception:  # noqa: S110 (exiting: nothing is left to tell)
            pass


class RecordFile:
    """Records written to ``target`` (a path, a text stream, or a function taking a list of records;
    see the module docstring) by a background thread; ``encode`` turns one record into its line
    for a path or a stream (without the newline; default ``json.dumps``, which writes non-finite
    numbers as ``NaN``)."""

    def __init__(
        self,
        target: str | os.PathLike | IO[str] | Callable[[list[Any]], None],
        *,
        flush_secs: float = FLUSH_SECS,
        encode: Callable[[Any], str] = json.dumps,
    ) -> None:
        self.flush_secs = flush_secs
        self._encode = encode
        self.path: Path | None = None
        self._file: Any = None
        if hasattr(target, "write"):  # a text stream
            self._out, name = self._write_lines, "stream"
            self._file = target
        elif callable(target):
            self._out, name = target, getattr(target, "__name__", "records")
        else:
            self.path = Path(target)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = os.fdopen(open_no_link(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
            self._out, name = self._write_lines, self.path.name
        self._pending: deque[Any] = deque()  # append and popleft are atomic: no lock for write()
        self._lock = threading.Lock()  # one thread encodes and writes at a time
        self._error: BaseException | None = None
        self._done = False  # closed: nothing more is written
        self._closed = threading.Event()  # tells the flusher thread to stop
        self._flusher = threading.Thread(target=self._flush_every, name=f"flush {name}", daemon=True)
        self._flusher.start()
        _open.add(self)

    def write(self, record: Any) -> None:
        """Append ``record`` (encoded and written later, on the flusher thread or at :meth:`flush`)."""
        if self._error is not None or self._done:
            self._raise()
        self._pending.append(record)

    def flush(self) -> None:
        """Encode and write out every record written so far, now."""
        with self._lock:
            self._drain()
        if self._error is not None:
            self._raise()

    def cut(self, last_step: int, row: Callable[[bytes], dict | None] | None = None) -> None:
        """Write out every record, then cut the file back to its lines of steps ``<= last_step``
        (see the module docstring; ``row`` as :func:`cut_to_step` takes it): call it at
        ``RUN_STARTED`` with ``trainer.state.step``."""
        self.flush()
        if self.path is not None:
            with self._lock:
                cut_to_step(self.path, last_step, row=row or step_row)

    def close(self) -> None:
        """Write out every record, stop the flusher thread and close the file (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._flusher.join()
        try:
            self.flush()
        finally:
            self._done = True
            _open.discard(self)
            if self.path is not None:
                self._file.close()

    def _drain(self) -> None:
        pending = self._pending
        if self._done or not pending:
            return
        records = []
        while pending:
            records.append(pending.popleft())
        self._out(records)

    def _write_lines(self, records: list[Any]) -> None:
        encode, lines = self._encode, []
        for record in records:
            try:
                lines.append(encode(record))
            except (TypeError, ValueError) as e:  # left out, and said to the writer
                self._error = e
        if lines:
            lines.append("")
            text = "\n".join(lines)
            self._file.write(text.encode() if self.path is not None else text)
            self._file.flush()

    def _raise(self) -> None:
        error, self._error = self._error, None
        where = self.path or "the records"
        raise ValueError(f"{where}: cannot write a record: {error or 'closed'}") from error

    def _flush_every(self) -> None:
        while not self._closed.wait(self.flush_secs):
            self._drain_noting_error()

    def _drain_noting_error(self) -> None:
        try:
            with self._lock:
                self._drain()
        except Exception as e:  # a full disk, a writer's error: said to the writer
            self._error = e


def step_row(line: bytes) -> dict[str, Any] | None:
    """The JSON object a whole line holds when it has an integer ``"step"``, else None."""
    if not line.endswith(b"\n"):
        return None  # torn: the write that would have ended it never finished
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    if not isinstance(row, dict):
        return None
    step = row.get("step")
    return row if isinstance(step, int) and not isinstance(step, bool) else None


def warn_damaged(path: Path, line_number: int, what: str) -> None:
    logger.warning("%s line %d is not a whole step's JSON (torn or garbage): %s", path, line_number, what)


def _lines_backwards(f: IO[bytes], size: int) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` of each line of ``f`` (``size`` bytes), the last first; a line keeps its
    newline. Memory: one block and the longest line."""
    buf, buf_start, end = b"", size, size
    while end > 0:
        # The newline before the line ending at ``end`` (the byte at end - 1 may be its own newline).
        while True:
            at = buf.rfind(b"\n", 0, max(0, end - 1 - buf_start))
            if at >= 0 or buf_start == 0:
                break
            start = max(0, buf_start - _BLOCK)
            f.seek(start)
            buf, buf_start = f.read(buf_start - start) + buf, start
        line_start = buf_start + at + 1
        yield line_start, buf[line_start - buf_start : end - buf_start]
        buf, end = buf[: line_start - buf_start], line_start


def _line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line starting at byte ``offset`` (counted in blocks: only a
    damaged file pays for it)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, _BLOCK * 16))
            count, offset = count + block.count(b"\n"), offset - len(block)
    return count + 1


def cut_to_step(
    path: str | os.PathLike, last_step: int, *, row: Callable[[bytes], dict | None] = step_row
) -> None:
    """Keep the lines of ``path`` up to the last whole line of a step ``<= last_step``: later steps
    and damaged lines after it are cut (damaged ones with a warning). ``row`` reads a line's record
    (None: damaged). The file is read backwards from its end and truncated in place (a reader sees
    the old or the new length); a missing file is left missing."""
    path = Path(path)
    try:
        f = os.fdopen(open_no_link(path, os.O_RDWR), "rb")
    except FileNotFoundError:
        return
    damaged: list[int] = []
    with f:
        size = keep = f.seek(0, os.SEEK_END)
        for offset, line in _lines_backwards(f, size):
            record = row(line)
            if record is not None and record["step"] <= last_step:
                break
            if record is None and line.strip():
                damaged.append(offset)
            keep = offset
        if keep == size:
            return
        for offset in reversed(damaged):
            warn_damaged(path, _line_number(path, offset), f"cut at resume to step {last_step}")
        os.ftruncate(f.fileno(), keep)
        fsync_fd(f.fileno())
