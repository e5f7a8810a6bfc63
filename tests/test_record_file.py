"""RecordFile: records come back as whole lines in the order written, reach the file within
``flush_secs`` while the writer does nothing more, at ``flush()``, at ``close()`` and when the
interpreter exits; a record that cannot be encoded is said to the writer."""

from __future__ import annotations

import io
import json
import math
import sys
import time

import pytest

from hookloop.engine import RecordFile
from tests.dist_utils import run_process


def _wait_for(predicate, timeout: float = 10.0) -> float:
    """Seconds until ``predicate()`` held (polled every 10 ms); fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "not within the timeout"
        time.sleep(0.01)
    return time.monotonic() - start


def test_records_reach_the_file_within_flush_secs_while_the_writer_does_nothing(tmp_path):
    path = tmp_path / "deeper" / "r.jsonl"
    records = RecordFile(path, flush_secs=0.2)
    try:
        for step in range(1, 4):
            records.write({"step": step, "loss": 1.0 / step})
        assert path.read_text() == "", "nothing is written on the writer's thread"
        waited = _wait_for(lambda: path.read_text().count("\n") == 3)
        assert waited < 5.0
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    finally:
        records.close()


def test_flush_and_close_write_everything_in_order_and_the_file_is_appended_to(tmp_path):
    path = tmp_path / "r.jsonl"
    records = RecordFile(path, flush_secs=3600)  # only flush() and close() write
    records.write({"step": 1, "x": math.nan})
    records.flush()
    assert json.loads(path.read_text())["step"] == 1 and "NaN" in path.read_text()
    for step in range(2, 2001):
        records.write({"step": step})
    records.close()
    records.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        records.write({"step": 2001})
    again = RecordFile(path, flush_secs=3600)
    again.write({"step": 2001})
    again.close()
    text = path.read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == list(range(1, 2002))


def test_a_stream_gets_its_lines_flushed_and_stays_open():
    class Stream(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1
            super().flush()

    stream = Stream()
    lines = RecordFile(stream, flush_secs=0.05, encode=lambda r: f"step {r}")
    lines.write(1)
    _wait_for(lambda: stream.getvalue() == "step 1\n" and stream.flushes >= 1)
    lines.write(2)
    lines.close()
    assert stream.getvalue() == "step 1\nstep 2\n" and not stream.closed


def test_a_record_that_cannot_be_encoded_is_said_to_the_writer_and_the_others_are_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    records = RecordFile(path, flush_secs=3600)
    records.write({"step": 1})
    records.write({"step": 2, "bad": object()})
    records.write({"step": 3})
    with pytest.raises(ValueError, match="cannot write a record"):
        records.flush()
    records.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]


def test_records_left_open_are_written_when_the_interpreter_exits(tmp_path):
    path = tmp_path / "r.jsonl"
    script = (
        "import sys\n"
        "from hookloop.engine import RecordFile\n"
        "records = RecordFile(sys.argv[1], flush_secs=3600)\n"
        "for step in range(1, 6):\n"
        "    records.write({'step': step})\n"
    )
    cmd = [sys.executable, "-c", script, str(path)]
    proc = run_process(cmd, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
