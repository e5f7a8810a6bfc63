"""The example scripts run end to end (single process and under torchrun) and fail cleanly."""

import json
import sys

import pytest

from tests.dist_utils import REPO, run_process, run_torchrun

SCRIPT = REPO / "examples" / "train_gpt.py"


def common(tmp_path) -> list[str]:
    return [
        f"train.run_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'data'}",
        "model.d_model=32",
        "train.seq_len=32",
        "logging.log_interval=5",
        "lr.warmup_steps=2",
    ]


def read_metrics(tmp_path) -> list[dict]:
    """The training rows of the run's metrics.jsonl (validation rows carry only val_loss)."""
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def val_losses(tmp_path) -> dict[int, float]:
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def test_train_gpt_loss_falls(tmp_path):
    proc = run_process(
        [sys.executable, str(SCRIPT), *common(tmp_path), "step_scheduler.max_steps=30"], timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows][-1] == 30
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, rows
    assert "done: step 30" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000030").is_dir()  # the final checkpoint


@pytest.mark.distributed
def test_train_gpt_under_torchrun_ddp_and_pipeline_match_single_process(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    args = ["step_scheduler.max_steps=10", "train.deterministic=true", "step_scheduler.val_every_steps=5"]
    p1 = run_process([sys.executable, str(SCRIPT), *common(single), *args], timeout=180)
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = run_torchrun(SCRIPT, 2, [*common(multi), *args])
    assert p2.returncode == 0, p2.stderr[-3000:]
    # Global batch 16 = 2 microbatches of 8 on one process, or 1 of 8 on each of 2 ranks: the
    # mixture sampler splits one global stream between ranks, so both runs see the same data.
    pipe = tmp_path / "pipe"
    p3 = run_torchrun(SCRIPT, 2, [*common(pipe), *args, "distributed.pp_size=2", "pipeline.pp_schedule=1f1b"])
    assert p3.returncode == 0, p3.stderr[-3000:]
    # The pipeline run (two stages, its 2 microbatches through 1F1B) trains the same model on the
    # same data: the same losses as well.
    a, b, c = read_metrics(single), read_metrics(multi), read_metrics(pipe)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [r["step"] for r in c] == [5, 10]
    for ra, rb, rc in zip(a, b, c):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
        assert ra["loss"] == pytest.approx(rc["loss"], rel=1e-4)
        assert ra["tokens_seen"] == rb["tokens_seen"] == rc["tokens_seen"]
    # Validation shares data.val_samples among the data-parallel ranks and weighs every sample
    # once: the same model gives the same val_loss whatever the world size or layout.
    va, vb, vc = (val_losses(d) for d in (single, multi, pipe))
    assert list(va) == list(vb) == list(vc) == [5, 10]
    for step in va:
        assert va[step] == pytest.approx(vb[step], rel=1e-4)
        assert va[step] == pytest.approx(vc[step], rel=1e-4)


def test_bad_config_fails_before_any_work(tmp_path):
    proc = run_process(
        [sys.executable, str(SCRIPT), *common(tmp_path), "step_scheduler.global_batch_size=12"], timeout=60
    )
    assert proc.returncode == 2
    assert "step_scheduler.global_batch_size" in proc.stderr
    assert not (tmp_path / "data").exists()  # nothing was built
    proc = run_process([sys.executable, str(SCRIPT), "model.n_heads=3", "model.d_model=32"], timeout=60)
    assert proc.returncode == 2 and "model.d_model" in proc.stderr


def test_custom_hooks_example_each_hook_acts_and_resumes(tmp_path):
    """The three hooks of examples/custom_hooks.py, attached by the config's handlers: list, each
    do what they are for in the demo run: per-layer gradient norms that add up to state.grad_norm,
    a custom event fired and answered (the learning rate halves), and an early stop before
    max_steps. Run again, it resumes, and the early stop's restored counters stop it at the next
    validation (fresh counters would need three more)."""
    script = REPO / "examples" / "custom_hooks.py"
    run_dir = tmp_path / "run"
    # Clipping on (the config's 1.0): BEFORE_OPTIMIZER_STEP sees the gradients before clipping.
    proc = run_process([sys.executable, str(script), f"train.run_dir={run_dir}"], cwd=REPO, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    # 1. per-layer norms every 25 steps, summing in quadrature to the total norm
    rows = [json.loads(line) for line in (run_dir / "grad_norms.jsonl").read_text().splitlines()]
    assert rows and [r["step"] for r in rows] == list(range(25, 25 * len(rows) + 1, 25))
    for row in rows:
        assert {"tok_emb", "blocks.0", "blocks.1", "head"} <= row["layers"].keys()
        total = sum(n * n for n in row["layers"].values()) ** 0.5
        assert total == pytest.approx(row["grad_norm"], rel=1e-5), row
    assert "grad norms: tok_emb" in out
    # 2. the detector fired its own event and the other handler halved the learning rate
    halvings = [line for line in out.splitlines() if " plateau #" in line]
    assert halvings and "lr 3.00e-03 -> 1.50e-03" in halvings[0], out
    # 3. EarlyStopping ended the run before max_steps, with a final checkpoint
    stop = [line for line in err.splitlines() if "stopping after step" in line]
    assert len(stop) == 1 and "terminate() called by EarlyStopping" in stop[0], err[-2000:]
    step = int(stop[0].split("stopping after step ")[1].split(":")[0])
    assert step < 400 and step % 20 == 0 and (run_dir / f"checkpoints/step_{step:08d}").is_dir()
    assert f"done: step {step}, " in out
    again = run_process([sys.executable, str(script), f"train.run_dir={run_dir}"], cwd=REPO, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_{step:08d} (step {step})" in again.stderr
    assert f"stopping after step {step + 20}: terminate() called by EarlyStopping" in again.stderr


def test_custom_hooks_settings_are_validated(tmp_path):
    script = REPO / "examples" / "custom_hooks.py"
    proc = run_process([sys.executable, str(script), "handlers.1.patience=0"], cwd=REPO, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: handlers[1].patience: must be an integer >= 1"), proc.stderr


def test_distill_example_trains_its_own_step_body_and_resumes_with_nothing_left(tmp_path):
    """examples/distill.py (a frozen teacher through a step body of its own, tests/test_distill.py
    has its DDP kill-and-resume): the documented run trains, validates and checkpoints; run again it
    resumes and has nothing left to train."""
    script = REPO / "examples" / "distill.py"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(script), "--run-dir", str(run_dir)]  # the documented run: 300 steps
    proc = run_process(cmd, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    assert sorted(rows) == list(range(1, 301))
    assert rows[300]["loss"] < rows[1]["loss"] / 5 and rows[300]["val_accuracy"] > 0.9, rows[300]
    assert "done: step 300," in proc.stdout
    assert (run_dir / "checkpoints" / "step_00000300").is_dir() and (run_dir / "exit_status.json").exists()
    again = run_process(cmd, timeout=240)
    assert again.returncode == 0 and "nothing left to train" in again.stderr, again.stderr[-2000:]


@pytest.mark.slow
def test_fault_tolerance_demo_recovers_and_matches_the_uninterrupted_run(tmp_path):
    """The demo SIGKILLs a run once its step-20 checkpoint exists, resumes it through a NaN burst
    and rollback, and declares the final loss bitwise equal to an uninterrupted run's."""
    script = REPO / "examples" / "fault_tolerance_demo.sh"
    proc = run_process(["bash", str(script), str(tmp_path / "demo")], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "killed (exit status 137, SIGKILL)" in out
    resumed = out[out.index("== 3.") : out.index("== 4.")]
    assert "resumed from" in resumed and "step_00000020 (step 20)" in resumed
    # the burst (steps 41-43) meets the resumed run here; a much faster machine might meet it before
    # the kill, so the rollback is looked for in the whole output
    assert "3 bad steps in a row; rolling back" in out and "rolled back from step 43 to step 40" in out
    assert "done: step 80, loss" in resumed
    assert out.strip().endswith("PASS: the final losses are bitwise equal")
    losses = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("final loss")]
    assert len(losses) == 2 and losses[0] == losses[1] and float(losses[0]) < 4.0
    # the killed run really stopped early: its own log ends without a "done" line
    assert "done:" not in (tmp_path / "demo" / "demo_killed.log").read_text()


def test_digits_classifier_through_hookloop_train(tmp_path):
    """examples/configs/digits.yaml: a classifier (not a language model) from a data factory, with
    ignite's Accuracy as a validation metric: above 0.9 at the default length, the best checkpoint by
    it kept beside the last two, and the same command again resumes and has nothing left to train."""
    run_dir = tmp_path / "digits"
    cmd = [
        sys.executable,
        "-m",
        "hookloop",
        "train",
        "examples/configs/digits.yaml",
        f"train.run_dir={run_dir}",
    ]
    proc = run_process(cmd, cwd=REPO, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = {row["step"]: row["val_accuracy"] for row in rows if "val_accuracy" in row}
    assert sorted(accuracy) == [50, 100, 150, 200, 250, 300] and accuracy[300] >= 0.9, accuracy
    assert all(row["tokens_seen"] == 0 for row in rows)  # images: samples, not tokens
    kept = {int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")}
    best = max(accuracy.values())
    assert {250, 300} <= kept and len(kept) <= 3, (kept, accuracy)  # the last two ...
    assert any(accuracy[step] == best for step in kept), (kept, accuracy)  # ... and a best one
    again = run_process(cmd, cwd=REPO, timeout=200)
    assert again.returncode == 0 and "nothing left to train" in again.stderr, again.stderr[-2000:]
