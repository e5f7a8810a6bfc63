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
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hookloop.engine.files import open_no_link

__all__ = ["FLUSH_SECS", "RecordFile", "flush_open"]

#: How long a written record may stay in memory: a killed run loses at most this many seconds of lines.
FLUSH_SECS = 1.0

_open: weakref.WeakSet[RecordFile] = weakref.WeakSet()  # flushed at exit if nobody closed them


def flush_open() -> None:
    """Write out every open RecordFile of this process now. The checkpointer calls it before a
    checkpoint becomes visible, so a run resumed from that checkpoint finds every record written
    before it; an error stays with its file and is raised to that file's writer."""
    for records in list(_open):
        try:
            with records._lock:
                records._drain()
        except Exception as e:  # a full disk: the checkpoint goes on, the writer hears of it
            records._error = e


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
            try:
                with self._lock:
                    self._drain()
            except Exception as e:  # a full disk, a writer's error: said to the writer
                self._error = e
