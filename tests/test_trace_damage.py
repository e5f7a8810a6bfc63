"""Sample traces survive damage and scale: a torn or garbage line is cut at resume with a warning
naming the file and line, the cut reads a long trace from its end (memory bounded whatever its
length), and under tensor and pipeline parallelism each data-parallel rank's file is written by one
process (real ``torchrun`` runs: each step read once)."""

from __future__ import annotations

import json
import logging
import tracemalloc
from pathlib import Path

import pytest

from hookloop.engine import record_file
from hookloop.engine.data import read_sample_traces
from hookloop.engine.data.trace import _cut
from tests.dist_utils import run_torchrun
from tests.test_sample_trace import make_trainer


def line(step: int, ids: list[str]) -> str:
    return json.dumps({"step": step, "ids": ids}) + "\n"


def test_a_torn_last_line_is_cut_at_resume_with_a_warning(tmp_path, caplog):
    trainer, loader = make_trainer(tmp_path)
    trainer.run(loader, max_steps=6)
    whole = read_sample_traces(tmp_path)[0]
    path = tmp_path / "samples-rank0.jsonl"
    # Killed while writing step 7's line (no newline), after its checkpoint of step 6.
    with open(path, "a") as f:
        f.write('{"step": 7, "ids": ["a:1", "b:')
    trainer, loader = make_trainer(tmp_path, start_step=6)
    with caplog.at_level(logging.WARNING, logger="hookloop"):
        trainer.run(loader, max_steps=8)
    assert (
        f"{path} line 7 is not a whole step's JSON (torn or garbage): cut at resume to step 6" in caplog.text
    )
    traces = read_sample_traces(tmp_path)[0]
    assert sorted(traces) == list(range(1, 9))
    assert {s: traces[s] for s in range(1, 7)} == whole


def test_garbage_among_the_lines_after_the_checkpoint_is_cut_with_the_rest(tmp_path, caplog):
    path = tmp_path / "samples-rank0.jsonl"
    rows = [line(s, [f"a:{s}"]) for s in range(1, 6)]
    path.write_text("".join(rows) + "\x00\x00garbage\n" + line(6, ["a:6"]) + "{not json}\n")
    with caplog.at_level(logging.WARNING, logger="hookloop"):
        _cut(path, 4)
    assert path.read_text() == "".join(rows[:4])
    assert "line 6 is not a whole step's JSON" in caplog.text and "line 8 is not" in caplog.text
    # Damage before the kept steps' end stays in the file (a start never reads it) and the reader
    # skips it, naming it.
    path.write_text(line(1, ["a:1"]) + '{"step": 2, "ids"\n' + line(3, ["a:3"]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hookloop"):
        _cut(path, 3)
        assert read_sample_traces(tmp_path) == {0: {1: ["a:1"], 3: ["a:3"]}}
    assert f"{path} line 2 is not a whole step's JSON (torn or garbage): skipped" in caplog.text


class CountingFile:
    """A file opened by the trace module, counting the bytes its reads return."""

    def __init__(self, f, counter: list[int]) -> None:
        self._f, self._counter = f, counter

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._counter[0] += len(data)
        return data

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __iter__(self):
        for data in self._f:
            self._counter[0] += len(data)
            yield data

    def __enter__(self) -> CountingFile:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def test_the_cut_of_a_long_trace_reads_only_its_end(tmp_path, caplog, monkeypatch):
    bytes_read = [0]
    counting = lambda *a, **k: CountingFile(open(*a, **k), bytes_read)  # noqa: E731
    monkeypatch.setattr(record_file, "open", counting, raising=False)
    path = tmp_path / "samples-rank0.jsonl"
    ids = [f"docs:{i * 7919 % 100_000}" for i in range(64)]
    steps = 40_000
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write(line(s, ids))
    size = path.stat().st_size
    assert size > 30_000_000
    for last_step, cut in ((steps, 0), (steps - 2, 2)):  # nothing to cut; the last two steps
        bytes_read[0] = 0
        tracemalloc.start()
        _cut(path, last_step)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert bytes_read[0] <= 2 * record_file._BLOCK, bytes_read  # a block or two of the end
        assert peak < 1_000_000, peak  # not the 36 MB file
        assert path.stat().st_size == size - cut * len(line(steps, ids).encode())
    assert path.read_bytes()[-len(line(steps, ids)) :].decode() == line(steps - 2, ids)
    # A torn tail in a long file: cut, and its line number found in bounded memory too.
    with open(path, "a") as f:
        f.write('{"step": 39999, "ids": ["do')
    tracemalloc.start()
    with caplog.at_level(logging.WARNING, logger="hookloop"):
        _cut(path, steps - 2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3_000_000, peak
    assert f"line {steps - 1} is not a whole step's JSON" in caplog.text
    assert path.stat().st_size == size - 2 * len(line(steps, ids).encode())


# ------------------------------------------------------------------ tensor and pipeline parallel runs

CONFIG = """
model:
  target: hookloop.models.gpt:recipe
  n_layers: 2
  d_model: 32
  n_heads: 2
train:
  seq_len: 16
  local_batch_size: 2
  compile: false
step_scheduler:
  global_batch_size: 4
  max_steps: 4
  ckpt_every_steps: 2
  val_every_steps: null
lr:
  warmup_steps: 0
logging:
  log_interval: 2
data:
  cache_dir: data
  val_samples: 0
  trace_samples: true
"""


def train(project: Path, nproc: int, *overrides: str):
    proc = run_torchrun("hookloop", nproc, ["train", "run.yaml", *overrides], module=True, cwd=project)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_ranks_write_one_trace_and_resume_past_a_torn_line(tmp_path):
    (tmp_path / "run.yaml").write_text(CONFIG)
    train(tmp_path, 2, "distributed.tp_size=2", "train.run_dir=runs/tp")
    run = tmp_path / "runs/tp"
    traces = read_sample_traces(run)
    assert list(traces) == [0] and sorted(traces[0]) == [1, 2, 3, 4]  # both TP ranks share one file
    assert all(len(ids) == 4 for ids in traces[0].values())  # each step once: the global batch
    first = traces[0]
    with open(run / "samples-rank0.jsonl", "a") as f:
        f.write('{"step": 5, "ids": ["docs:')  # killed mid-write after the checkpoint of step 4
    proc = train(tmp_path, 2, "distributed.tp_size=2", "train.run_dir=runs/tp", "step_scheduler.max_steps=6")
    assert "runs/tp/samples-rank0.jsonl line 5 is not a whole step's JSON" in proc.stderr, proc.stderr[-3000:]
    traces = read_sample_traces(run)
    assert list(traces) == [0] and sorted(traces[0]) == list(range(1, 7))
    assert {s: traces[0][s] for s in range(1, 5)} == first


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_and_tensor_parallel_ranks_write_one_trace(tmp_path):
    (tmp_path / "run.yaml").write_text(CONFIG)
    train(tmp_path, 4, "distributed.tp_size=2", "distributed.pp_size=2", "train.run_dir=runs/pptp")
    traces = read_sample_traces(tmp_path / "runs/pptp")
    assert list(traces) == [0] and sorted(traces[0]) == [1, 2, 3, 4]
    assert all(len(ids) == 4 for ids in traces[0].values())
