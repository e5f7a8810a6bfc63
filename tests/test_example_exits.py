"""The example's exits a job script relies on: 2 and one line for every bad setting (found before
any process group or model exists), 76 when the NaN detector gives up, and ``exit_status.json``."""

from __future__ import annotations

import json
import sys

import pytest

from tests.dist_utils import REPO, run_process

SCRIPT = REPO / "examples" / "train_gpt.py"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("checkpoint.resume=/no/such/step_00000010", "checkpoint.resume"),
        ("checkpoint.finetune_from=/no/such/step_00000010", "checkpoint.finetune_from"),
        ("train.run_dir=/proc/no-such-dir", "train.run_dir"),
        ("data.cache_dir=/proc/no-such-dir", "data.cache_dir"),
        ("data.datasets.docs=/no/such/tokens.u8", "data.datasets.docs"),
        ("train.device=cuda", "train.device"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay"),
        ("lr.min_lr=nan", "lr.min_lr"),
        ("lr.warmup_init=inf", "lr.warmup_init"),
        ("health.timeout_s=inf", "health.timeout_s"),
        ("checkpoint.wait_timeout_s=soon", "checkpoint.wait_timeout_s"),
        ("fault_injection.microbatches=[-1]", "fault_injection.microbatches[0]"),
        ("checkpoint.keep_best=2 checkpoint.metric=val_bleu", "checkpoint.metric"),
    ],
)
def test_bad_settings_exit_2_with_one_line_naming_the_field(tmp_path, override, field):
    run_dir = tmp_path / "run"
    args = [f"train.run_dir={run_dir}", "step_scheduler.max_steps=50", *override.split()]
    if override.startswith("train.run_dir"):
        args = args[1:]
    result = run_process([sys.executable, str(SCRIPT), *args], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"config error: {field}"), lines[0]
    assert not (run_dir / "checkpoints").exists()  # nothing was built


def test_nan_give_up_exits_76_with_one_line_and_records_it(tmp_path):
    run_dir = tmp_path / "run"
    result = run_process(
        [
            sys.executable, str(SCRIPT), f"train.run_dir={run_dir}", "step_scheduler.max_steps=30",
            "checkpoint.enabled=false", "nan.action=raise", "optimizer.lr=1e6", "train.grad_clip_norm=null",
        ],
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 76, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "exit code 76: NAN_ABORT" in result.stderr
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 76 and status["meaning"] == "NAN_ABORT"


def test_a_killed_peer_ends_the_example_with_77_and_one_line(tmp_path):
    """Two ranks of the example with a health check; rank 1 is SIGKILLed mid-run: rank 0 exits 77
    within seconds, says why in one line, and records it in exit_status.json."""
    import os
    import signal
    import time

    from tests.dist_utils import kill_ranks, start_ranks

    run_dir = tmp_path / "run"
    args = [
        f"train.run_dir={run_dir}", "step_scheduler.max_steps=100000", "lr.decay_steps=100000",
        "logging.log_interval=1", "logging.console=false", "health.enabled=true", "health.every_steps=1",
        "health.timeout_s=5", "checkpoint.enabled=false", "nan.action=warn",
    ]  # fmt: skip
    procs = start_ranks([sys.executable, str(SCRIPT), *args], 2)
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no training"
            time.sleep(0.2)
        killed = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        _, err = procs[0].communicate(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        kill_ranks(procs)
    assert procs[0].returncode == 77, err[-3000:]
    assert seconds < 30, seconds
    assert "Traceback" not in err
    assert "exit code 77" in err or "no progress" in err
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 77


def tree_bytes(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def small_run(tmp_path) -> list[str]:
    return [
        f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'data'}", "model.d_model=32",
        "train.seq_len=32", "lr.decay_steps=100", "lr.warmup_steps=0", "logging.console=false",
    ]  # fmt: skip


def assert_refused_in_one_line(result, field: str, what: str, fix: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and "[hookloop]" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr and "ERROR" not in result.stderr, (
        result.stderr
    )
    line = lines[0]
    assert line.startswith(f"config error: {field}: "), line  # the setting that changed, by name
    assert what in line, line
    assert fix in line and "train.run_dir=<new dir>" in line, line


def test_resuming_a_checkpoint_of_another_layer_count_exits_2_and_touches_nothing(tmp_path):
    args = small_run(tmp_path)
    first = run_process(
        [sys.executable, str(SCRIPT), *args, "model.n_layers=1", "step_scheduler.max_steps=4"]
    )
    assert first.returncode == 0, first.stderr[-3000:]
    before = tree_bytes(tmp_path / "run" / "checkpoints")
    second = run_process(
        [sys.executable, str(SCRIPT), *args, "model.n_layers=2", "step_scheduler.max_steps=8"]
    )
    assert_refused_in_one_line(
        second,
        "model.n_layers",
        "blocks: 1 in the checkpoint, 2 in this model",
        "set model.n_layers=1 to resume it",
    )
    assert tree_bytes(tmp_path / "run" / "checkpoints") == before


@pytest.mark.distributed
def test_a_pipeline_run_checkpoint_resumes_in_a_single_process_run(tmp_path):
    """The pipeline run's stage checkpoint, resumed by the single-process example: the parameters
    and their optimizer state load by their names in the whole model, and training goes on from
    the saved step to the end (exit 0)."""
    from tests.dist_utils import run_torchrun

    args = [*small_run(tmp_path), "step_scheduler.max_steps=4"]
    pipe = run_torchrun(SCRIPT, 2, [*args, "distributed.pp_size=2", "pipeline.pp_schedule=1f1b"])
    assert pipe.returncode == 0, pipe.stderr[-3000:]
    single = run_process([sys.executable, str(SCRIPT), *args[:-1], "step_scheduler.max_steps=8"], timeout=180)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "written with pipeline stages: loading its parameters and optimizer state by name" in single.stderr
    assert "(step 4)" in single.stderr and "done: step 8" in single.stdout, single.stderr[-3000:]
