"""Loggers write real files read back here: JSONL lines, TensorBoard event files, W&B offline runs."""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hookloop.engine import Events, Priority, TokenAccuracy, Trainer
from hookloop.handlers.console import ConsoleLogger
from hookloop.handlers.jsonl_logger import JSONLLogger
from hookloop.handlers.loggers import metric_tag
from hookloop.handlers.metrics import MetricsTracker
from hookloop.handlers.tensorboard_logger import TensorBoardLogger
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss
from tests import cadence
from tests.dist_utils import REPO, run_process
from tests.forked import start_forked

SEQ = 16


def _trainer(*, validate_every: int | None = None) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=SEQ, n_layers=1, d_model=32, n_heads=2))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)
    if validate_every:  # val_loss and a validation metric, val_accuracy
        trainer.set_validation(_tokens(2), metrics={"accuracy": TokenAccuracy()})
        cadence.validate_every(trainer, validate_every)
    return trainer


def _tokens(n: int = 8) -> list:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2 * n, SEQ + 1), generator=g)
    return [(x[i : i + 2, :-1], x[i : i + 2, 1:]) for i in range(0, 2 * n, 2)]


def _record_logged(trainer: Trainer) -> dict[int, dict]:
    """What the loggers should have written: published metrics per step (after every logger)."""
    expected: dict[int, dict] = {}
    seen_validations = [0]

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP + 1)
    def grab() -> None:
        state = trainer.state
        out = {}
        if state.metrics_step == state.step:
            out.update({k: v for k, v in state.metrics.items() if not k.startswith("val")})
        if state.validations != seen_validations[0]:
            seen_validations[0] = state.validations
            out.update({k: v for k, v in state.metrics.items() if k.startswith("val")})
        if out:
            expected[state.step] = out

    return expected


def _per_dataset_metric(trainer: Trainer) -> None:
    # what a mixture handler publishes: loss per source dataset on log steps
    trainer.add_event_handler(
        Events.STEP_END, lambda: trainer.state.metrics.__setitem__("loss/docs", trainer.state.loss + 1.0)
    )


def test_metric_tags_are_stable():
    assert metric_tag("loss") == "train/loss"
    assert metric_tag("lr") == "train/lr"
    assert metric_tag("tokens_per_s") == "perf/tokens_per_s"
    assert metric_tag("val_loss") == "val/loss"
    assert metric_tag("loss/docs") == "loss/docs"
    assert metric_tag("val_loss/docs") == "val_loss/docs"
    assert metric_tag("custom") == "train/custom"


def test_jsonl_records_match_published_metrics_and_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    trainer = _trainer(validate_every=3)
    MetricsTracker(2).attach(trainer)
    _per_dataset_metric(trainer)
    logger = JSONLLogger(path).attach(trainer)
    expected = _record_logged(trainer)
    trainer.run(_tokens(), max_steps=6)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]
    assert records[1].keys() == {"step", "time", "val_loss", "val_accuracy"}, (
        "a validation-only step logs validation"
    )
    for r in records:
        want = expected[r["step"]]
        assert {k: r[k] for k in want} == want
    assert "loss/docs" in records[0] and "val_loss" in records[3] and "val_accuracy" in records[3]
    assert logger._file is None, "closed at TRAIN_END"

    # a second run (a job resumed at step 6) appends to the same file
    trainer2 = _trainer()
    MetricsTracker(2).attach(trainer2)
    JSONLLogger(path).attach(trainer2)
    counters = trainer.state.counters()
    trainer2.add_event_handler(
        Events.TRAIN_START, lambda: trainer2.state.load_counters(counters), priority=Priority.RESTORE
    )
    trainer2.run(_tokens(), max_steps=8)
    assert len(path.read_text().splitlines()) == 5

    # a run started again from step 0 (no checkpoint) cuts the steps it logs again: each step once
    trainer3 = _trainer()
    MetricsTracker(2).attach(trainer3)
    JSONLLogger(path).attach(trainer3)
    trainer3.run(_tokens(), max_steps=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [2]


def test_a_run_stopped_between_log_steps_still_logs_its_last_interval(tmp_path):
    path = tmp_path / "metrics.jsonl"
    trainer = _trainer(validate_every=3)
    MetricsTracker(10).attach(trainer)
    JSONLLogger(path).attach(trainer)
    trainer.add_event_handler(Events.STEP_END(once=3), lambda: trainer.control.request_stop("test"))
    trainer.run(_tokens(), max_steps=8)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 3]
    assert "val_loss" in records[0] and records[1]["tokens_seen"] == 3 * 2 * SEQ


def test_jsonl_without_a_tracker_logs_the_trainer_state_every_step(tmp_path):
    path = tmp_path / "m.jsonl"
    trainer = _trainer()
    JSONLLogger(path).attach(trainer)  # no tracker publishes: nothing decides a cadence, no logger counts
    trainer.run(_tokens(), max_steps=4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"loss", "grad_norm", "lr", "tokens_seen", "skipped_steps"} <= records[-1].keys()
    assert records[-1]["loss"] == trainer.state.loss and records[-1]["tokens_seen"] == 4 * 2 * SEQ


def test_loggers_close_on_the_exception_path(tmp_path):
    trainer = _trainer()
    MetricsTracker(1).attach(trainer)
    jsonl = JSONLLogger(tmp_path / "m.jsonl").attach(trainer)
    tb = TensorBoardLogger(tmp_path / "tb").attach(trainer)

    @trainer.on(Events.STEP_END(once=3))
    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trainer.run(_tokens(), max_steps=6)
    assert jsonl._file is None and tb.writer is None
    # records logged before the error reached the disk
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == [1, 2], "step 3 failed before its log handler ran"


def test_tensorboard_scalars_read_back_equal_published_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _trainer(validate_every=2)
    MetricsTracker(2).attach(trainer)
    _per_dataset_metric(trainer)
    TensorBoardLogger(tmp_path).attach(trainer)
    expected = _record_logged(trainer)
    trainer.run(_tokens(), max_steps=6)

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "val/loss", "loss/docs", "train/loss_avg"} <= tags
    assert "val/accuracy" in tags
    for step, metrics in expected.items():
        for name, value in metrics.items():
            events = [e for e in acc.Scalars(metric_tag(name)) if e.step == step]
            assert len(events) == 1, (name, step)
            assert events[0].value == np.float32(value), (name, step)
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("val/accuracy")] == [2, 4, 6]


def test_console_plain_lines_when_not_a_tty():
    out = io.StringIO()
    trainer = _trainer(validate_every=4)
    MetricsTracker(2).attach(trainer)
    ConsoleLogger(stream=out).attach(trainer)
    trainer.run(_tokens(), max_steps=4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 2/4 | loss ")
    assert "tok/s" in lines[0] and "lr " in lines[0] and "s/step" in lines[0]
    assert "val_loss" in lines[1] and "val_accuracy" in lines[1]


def test_console_progress_bar_when_asked():
    out = io.StringIO()
    trainer = _trainer()
    MetricsTracker(2).attach(trainer)
    logger = ConsoleLogger(stream=out, progress_bar=True, refresh_every=1).attach(trainer)
    trainer.run(_tokens(), max_steps=4)
    text = out.getvalue()
    assert logger.pbar is not None and "loss=" in text and "tok/s=" in text
    assert "step 2" not in text, "no plain lines next to the bar"


# ---------------------------------------------------------------------------- what a kill leaves

KILLED_RUN = """
import sys
import time
from pathlib import Path

import torch

from hookloop import Events, Priority, Trainer
from hookloop.handlers import ConsoleLogger, JSONLLogger, MetricsTracker

run_dir, hang = Path(sys.argv[1]), sys.argv[2] == "hang"
model = torch.nn.Linear(4, 1)
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)
MetricsTracker(1, run_dir=run_dir).attach(trainer)
JSONLLogger(run_dir / "metrics.jsonl").attach(trainer)
ConsoleLogger(stream=open(run_dir / "console.log", "a"), progress_bar=False).attach(trainer)


@trainer.on(Events.STEP_END, priority=Priority.CLEANUP)
def mark():
    if trainer.state.step == 50:  # every logger has recorded step 50
        (run_dir / "at_50").write_text("")
        if hang:
            time.sleep(600)  # blocked, as in a collective whose peer is gone
    elif trainer.state.step > 50:
        time.sleep(0.001)


trainer.run([(torch.randn(8, 4), torch.randn(8, 1))] * 1_000_000, max_steps=1_000_000)
"""


def _steps_on_disk(run_dir: Path) -> dict[str, list[int]]:
    """The steps each record holds; every line on disk must be whole (ends with a newline, parses)."""
    out = {}
    for name in ("metrics.jsonl", "progress.jsonl", "console.log"):
        text = (run_dir / name).read_text()
        assert text.endswith("\n"), f"{name} ends with a partial line: {text[-200:]!r}"
        lines = text.splitlines()
        if name == "console.log":
            out[name] = [int(line.split()[1].split("/")[0]) for line in lines]
        else:
            rows = [json.loads(line) for line in lines]
            out[name] = [r["step"] for r in rows if r.get("event", "progress") == "progress"]
    return out


@pytest.mark.parametrize("hang", [False, True], ids=["training", "hung"])
def test_a_sigkill_leaves_whole_lines_in_step_order_and_loses_at_most_the_last_flush_secs(tmp_path, hang):
    """Logged lines reach the disk at least every FLUSH_SECS (a background thread writes them, also
    while the training thread is blocked): a run killed FLUSH_SECS + 2 s after it logged step 50 has
    every step up to 50 on disk in all three records, each a whole line, in order, none missing."""
    from hookloop.engine.record_file import FLUSH_SECS

    (tmp_path / "run.py").write_text(KILLED_RUN)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [sys.executable, str(tmp_path / "run.py"), str(run_dir), "hang" if hang else "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = start_forked(cmd, cwd=REPO, env=env, stderr=tmp_path / "err.txt")
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "at_50").exists():
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 50"
            time.sleep(0.05)
        time.sleep(FLUSH_SECS + 2.0)
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    for name, steps in _steps_on_disk(run_dir).items():
        assert steps == list(range(1, len(steps) + 1)), f"{name}: steps missing or out of order"
        if hang:
            assert len(steps) == 50, name
        else:
            assert len(steps) >= 50, name


def test_the_records_are_on_disk_when_a_checkpoint_is_published(tmp_path, monkeypatch):
    """A run resumed from a checkpoint finds every record up to its step: the loggers and the
    tracker flush when CHECKPOINT_SAVED fires, however long their flush interval."""
    from hookloop.engine.record_file import RecordFile
    from hookloop.handlers import metrics
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    monkeypatch.setattr(metrics, "RecordFile", functools.partial(RecordFile, flush_secs=3600))
    trainer = _trainer()
    AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(trainer)
    cadence.save_every(trainer, 3)
    MetricsTracker(1, run_dir=tmp_path).attach(trainer)
    JSONLLogger(tmp_path / "metrics.jsonl", flush_secs=3600).attach(trainer)
    TensorBoardLogger(tmp_path / "tb", flush_secs=3600).attach(trainer)
    seen: dict[int, tuple[list[int], ...]] = {}

    @trainer.on(Events.CHECKPOINT_SAVED, priority=Priority.CLEANUP)
    def read_back(_trainer: Trainer, step: int = 0, _path: str = "") -> None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        metrics = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        rows = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
        curves = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
        curves.Reload()
        logged = "train/loss" in curves.Tags()["scalars"]
        tb = [e.step for e in curves.Scalars("train/loss")] if logged else []
        seen[step] = (metrics, [r["step"] for r in rows if r["event"] == "progress"], tb)

    trainer.run(_tokens(), max_steps=6)
    assert seen == {3: ([1, 2, 3],) * 3, 6: ([1, 2, 3, 4, 5, 6],) * 3}


KILLED_AT_PUBLISH = """
import os
import signal
import sys
from pathlib import Path

import torch

from hookloop import Events, Priority, Trainer
from hookloop.handlers import JSONLLogger, MetricsTracker
from hookloop.handlers.checkpoint import AsyncCheckpointer
from tests.cadence import save_every

run_dir = Path(sys.argv[1])
model = torch.nn.Linear(4, 1)
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)
AsyncCheckpointer(run_dir / "ckpt", mode="sync").attach(trainer)
save_every(trainer, 5)
MetricsTracker(1, run_dir=run_dir).attach(trainer)
JSONLLogger(run_dir / "metrics.jsonl", flush_secs=3600).attach(trainer)


@trainer.on(Events.CHECKPOINT_SAVED, priority=Priority.ENGINE_FIRST)
def killed(_trainer, step=0, _path=""):  # published, before any logger has heard of it
    if step == 10:
        os.kill(os.getpid(), signal.SIGKILL)


trainer.run([(torch.randn(8, 4), torch.randn(8, 1))] * 100, max_steps=100)
"""


def test_a_kill_right_after_a_checkpoint_is_published_leaves_every_record_up_to_its_step(tmp_path):
    """The checkpointer writes out every open record file before the rename that publishes a
    checkpoint: killed the moment the step-10 checkpoint is visible (before CHECKPOINT_SAVED reaches
    any logger), with an hour-long flush interval, the run holds every step's line up to 10."""
    (tmp_path / "run.py").write_text(KILLED_AT_PUBLISH)
    run_dir = tmp_path / "run"
    proc = run_process([sys.executable, str(tmp_path / "run.py"), str(run_dir)], timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (run_dir / "ckpt" / "step_00000010").is_dir()
    metrics = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    progress = [json.loads(line) for line in (run_dir / "progress.jsonl").read_text().splitlines()]
    assert metrics == list(range(1, 11))
    assert [r["step"] for r in progress if r["event"] == "progress"] == list(range(1, 11))


# ---------------------------------------------------------------------------- W&B


def _wandb_records(run_file: Path) -> list:
    """Records of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (crc32c, u16 length, type) carry serialised ``Record`` protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _finished_records(tmp_path: Path) -> list:
    """The run's records once its exit record is on disk (wandb-core writes it asynchronously
    after ``finish()`` returns, so allow it a few seconds)."""
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 15
    while True:
        records = _wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _history(records: list) -> dict[int, dict[str, float]]:
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows[int(row["_step"])] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }.items():
        monkeypatch.setenv(key, value)
    import wandb

    return wandb.Settings(x_disable_stats=True, console="off")


def test_wandb_offline_run_holds_config_and_metrics(tmp_path, wandb_offline):
    from hookloop.handlers.wandb_logger import WandBLogger

    trainer = _trainer(validate_every=3)
    MetricsTracker(2).attach(trainer)
    logger = WandBLogger(
        "hookloop-test", dir=tmp_path, config={"model": {"d_model": 32}}, settings=wandb_offline
    )
    logger.attach(trainer)
    expected = _record_logged(trainer)
    trainer.run(_tokens(), max_steps=4)
    assert logger.run is None, "finished at TRAIN_END"

    records = _finished_records(tmp_path)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["model"] == {"d_model": 32}
    history = _history(records)
    assert sorted(history) == [2, 3, 4]
    assert {"val/loss", "val/accuracy"} <= history[3].keys()
    for step, metrics in expected.items():
        assert history[step] == {metric_tag(k): v for k, v in metrics.items()}, step


def test_wandb_follows_the_one_log_cadence_with_a_scheduler(tmp_path, wandb_offline):
    from hookloop.handlers.step_scheduler import StepScheduler
    from hookloop.handlers.wandb_logger import WandBLogger

    trainer = _trainer()
    MetricsTracker(3).attach(trainer)  # logging.log_interval: console, JSONL, TensorBoard and W&B
    data = _tokens()
    StepScheduler(2, 2, 1, data, max_steps=6, ckpt_every_steps=100).attach(trainer)
    WandBLogger("hookloop-test", dir=tmp_path, settings=wandb_offline).attach(trainer)
    published = {}
    trainer.add_event_handler(
        Events.STEP_END, lambda: published.__setitem__(trainer.state.step, trainer.state.metrics.get("loss"))
    )
    trainer.run(data)
    history = _history(_finished_records(tmp_path))
    assert sorted(history) == [3, 6], "the tracker's log steps only"
    assert history[3]["train/loss"] == published[3], "the published loss of the log step"
    assert history[6]["perf/tokens_per_s"] > 0


def test_wandb_marks_the_run_failed_on_an_exception(tmp_path, wandb_offline):
    from hookloop.handlers.wandb_logger import WandBLogger

    trainer = _trainer()
    logger = WandBLogger("hookloop-test", dir=tmp_path, settings=wandb_offline).attach(trainer)
    trainer.add_event_handler(Events.STEP_END(once=2), lambda: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError):
        trainer.run(_tokens(), max_steps=4)
    assert logger.run is None
    exits = [r.exit for r in _finished_records(tmp_path) if r.WhichOneof("record_type") == "exit"]
    assert exits and exits[-1].exit_code == 1


# ---------------------------------------------------------------------------- cheap imports


def test_importing_engine_and_handlers_imports_no_logging_backend():
    code = (
        "import sys, engine, handlers, handlers.metrics, handlers.loggers, handlers.jsonl_logger, "
        "hookloop.handlers.tensorboard_logger, handlers.wandb_logger, handlers.console, handlers.profiler, "
        "hookloop.handlers.health_check, handlers.straggler, handlers.plot\n"
        "bad = [m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard', 'matplotlib') "
        "if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = run_process([sys.executable, "-c", code], env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported at import time: {out.stdout.strip()}"


def test_build_loggers_from_the_logging_section(tmp_path):
    from hookloop.handlers.loggers import LoggingConfig, build_loggers

    cfg = LoggingConfig(
        log_interval=5, jsonl=True, tensorboard=True, wandb=False, console=True, progress_bar=False
    )
    loggers = build_loggers(cfg, tmp_path)
    assert [type(x).__name__ for x in loggers] == ["JSONLLogger", "TensorBoardLogger", "ConsoleLogger"]
    assert loggers[0].path == tmp_path / "metrics.jsonl"
    assert loggers[1].log_dir == tmp_path / "tensorboard"
    assert loggers[2].progress_bar is False


@pytest.mark.parametrize("backend", ["torch.utils.tensorboard", "wandb"])
def test_a_missing_backend_fails_at_attach_and_nothing_is_created(tmp_path, monkeypatch, backend):
    from hookloop.handlers.wandb_logger import WandBLogger

    monkeypatch.setitem(sys.modules, backend, None)  # `import <backend>` raises ImportError
    logger = (
        TensorBoardLogger(tmp_path / "tb")
        if backend.endswith("tensorboard")
        else WandBLogger("hookloop-test", dir=tmp_path / "wb", mode="offline")
    )
    with pytest.raises(ImportError):
        logger.attach(_trainer())
    assert list(tmp_path.iterdir()) == []


def test_a_logger_creates_its_files_only_once_the_run_has_started(tmp_path):
    trainer = _trainer()
    TensorBoardLogger(tmp_path / "tb").attach(trainer)
    JSONLLogger(tmp_path / "metrics.jsonl").attach(trainer)
    seen = {}
    trainer.add_event_handler(
        Events.TRAIN_START, lambda: seen.setdefault("start", sorted(os.listdir(tmp_path)))
    )
    after_loggers = lambda: seen.setdefault("run", sorted(os.listdir(tmp_path)))  # noqa: E731
    trainer.add_event_handler(Events.RUN_STARTED, after_loggers, priority=Priority.CLEANUP + 1)
    assert list(tmp_path.iterdir()) == []  # attached: nothing yet
    trainer.run(_tokens(), max_steps=2)
    assert seen == {"start": [], "run": ["metrics.jsonl", "tb"]}
