"""MetricsTracker: what it publishes, when, what step time excludes, and the progress log."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from hookloop.engine import ConfigError, Events, Priority, Trainer
from hookloop.handlers import Places
from hookloop.handlers.metrics import MetricsTracker, estimate_flops_per_token
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss
from tests.cadence import validate_every
from tests.dist_utils import run_distributed

SEQ = 16


def _gpt_trainer(seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(seq_len=SEQ, n_layers=1, d_model=32, n_heads=2))
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)


def _tokens(n_batches: int = 8, batch: int = 2, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n_batches * batch, SEQ + 1), generator=g)
    return [(x[i : i + batch, :-1], x[i : i + batch, 1:]) for i in range(0, n_batches * batch, batch)]


def _snapshots(trainer: Trainer) -> dict[int, dict]:
    """state.metrics as published, keyed by the step it was published at."""
    seen: dict[int, dict] = {}

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP + 1)
    def grab() -> None:
        if trainer.state.metrics_step == trainer.state.step:
            seen[trainer.state.step] = dict(trainer.state.metrics)

    return seen


def test_publishes_every_interval_and_at_the_last_step(tmp_path):
    trainer = _gpt_trainer()
    tracker = MetricsTracker(3, run_dir=tmp_path, peak_flops_per_device=1e12).attach(trainer)
    published = _snapshots(trainer)
    trainer.run(_tokens(), max_steps=7)
    assert sorted(published) == [3, 6, 7]
    m = published[6]
    for key in (
        "loss",
        "loss_avg",
        "grad_norm",
        "lr",
        "step_time_s",
        "data_time_s",
        "tokens_per_s",
        "samples_per_s",
        "skipped_steps",
        "rss_mb",
        "tokens_seen",
        "tflops_per_device",
        "mfu",
    ):
        assert key in m, key
    assert m["tokens_seen"] == 6 * 2 * SEQ
    # throughput is tokens over (step + data) time of the interval; MFU follows from it
    assert m["tokens_per_s"] == pytest.approx(3 * 2 * SEQ / (3 * (m["step_time_s"] + m["data_time_s"])))
    assert m["samples_per_s"] == pytest.approx(m["tokens_per_s"] / SEQ)
    fpt = trainer.model.flops_per_token()
    assert tracker.flops_per_token == fpt
    assert m["mfu"] == pytest.approx(fpt * m["tokens_per_s"] / 1e12)
    assert published[7]["tokens_seen"] == 7 * 2 * SEQ


def test_windowed_loss_average_and_respecting_another_writer():
    trainer = _gpt_trainer()
    MetricsTracker(2).attach(trainer)
    losses: list[float] = []
    trainer.add_event_handler(Events.STEP_END, lambda: losses.append(trainer.state.loss))
    published = _snapshots(trainer)
    trainer.run(_tokens(), max_steps=4)
    assert published[4]["loss_avg"] == pytest.approx((losses[2] + losses[3]) / 2)
    assert published[4]["loss"] == losses[3]

    # a StepScheduler keeps its own average in the same key: the tracker leaves it alone
    trainer = _gpt_trainer()
    MetricsTracker(2).attach(trainer)
    trainer.add_event_handler(Events.STEP_END, lambda: trainer.state.metrics.__setitem__("loss_avg", 42.0))
    published = _snapshots(trainer)
    trainer.run(_tokens(), max_steps=4)
    assert published[4]["loss_avg"] == 42.0


def test_no_mfu_without_a_known_peak_and_no_token_figures_for_float_inputs():
    trainer = _gpt_trainer()
    MetricsTracker(2).attach(trainer)
    published = _snapshots(trainer)
    trainer.run(_tokens(), max_steps=2)
    assert "mfu" not in published[2] and "tflops_per_device" in published[2]

    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    MetricsTracker(2, peak_flops_per_device=1e12).attach(trainer)
    published = _snapshots(trainer)
    trainer.run([(torch.randn(2, 4), torch.randn(2, 1))] * 2, max_steps=2)
    assert "tokens_per_s" not in published[2] and "mfu" not in published[2]
    assert published[2]["samples_per_s"] > 0


def test_step_time_excludes_reported_checkpoint_blocking():
    block_s = 0.15

    def run(report: bool) -> float:
        trainer = _gpt_trainer()
        MetricsTracker(2).attach(trainer)
        published = _snapshots(trainer)

        @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
        def wait_for_staging() -> None:  # what an async checkpointer does before the optimizer step
            start = time.perf_counter()
            time.sleep(block_s)
            if report:
                trainer.state.times["checkpoint"] = trainer.state.times.get("checkpoint", 0.0) + (
                    time.perf_counter() - start
                )

        trainer.run(_tokens(), max_steps=2)
        return published[2]["step_time_s"]

    assert run(report=False) >= block_s
    assert run(report=True) < block_s


def test_step_time_excludes_validation():
    trainer = _gpt_trainer()
    slow = _tokens(2)

    def slow_loss(out, y):
        if not torch.is_grad_enabled():  # validation
            time.sleep(0.1)
        return cross_entropy_loss(out, y)

    trainer.loss_fn = slow_loss
    trainer.set_validation(slow)
    validate_every(trainer, 1)
    MetricsTracker(2).attach(trainer)
    published = _snapshots(trainer)
    trainer.run(_tokens(), max_steps=2)
    assert trainer.state.times["validation"] >= 0.2
    assert published[2]["step_time_s"] < 0.2


def test_progress_log_is_appended_across_a_resume(tmp_path):
    first = _gpt_trainer()
    tracker = MetricsTracker(2, run_dir=tmp_path).attach(first)
    first.run(_tokens(), max_steps=4)
    saved_counters, saved_tracker = first.state.counters(), tracker.state_dict()
    assert saved_tracker["train_time_s"] > 0

    second = _gpt_trainer()
    tracker2 = MetricsTracker(2, run_dir=tmp_path).attach(second)
    assert second.stateful["metrics_tracker"] is tracker2

    @second.on(Events.TRAIN_START, priority=Priority.RESTORE)
    def resume() -> None:  # as a checkpointer restores state at TRAIN_START
        second.state.load_counters(saved_counters)
        tracker2.load_state_dict(saved_tracker)

    second.run(_tokens(), max_steps=8)
    lines = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines] == [
        "start",
        "progress",
        "progress",
        "start",
        "resume",
        "progress",
        "progress",
    ]
    assert [r["step"] for r in lines] == [0, 2, 4, 4, 4, 6, 8]
    progress = [r for r in lines if r["event"] == "progress"]
    fpt = second.model.flops_per_token()
    for r in progress:
        assert r["tokens_seen"] == r["step"] * 2 * SEQ
        assert r["flops"] == pytest.approx(fpt * r["tokens_seen"])
    times = [r["train_time_s"] for r in progress]
    assert times == sorted(times) and times[2] > saved_tracker["train_time_s"]


def test_first_interval_after_a_real_resume_counts_only_this_process_steps(tmp_path):
    """A checkpoint at step 7 (mid-interval), resumed by the checkpointer with a slow load: the
    interval published at step 10 holds steps 9 and 10 only (step 8 is the resumed run's warm-up),
    so its tokens/s is their tokens over their time; neither the load nor the steps trained before
    the restart enter it."""
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    first = _gpt_trainer()
    AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(first)
    MetricsTracker(5, run_dir=tmp_path).attach(first)
    first.run(_tokens(12), max_steps=7)

    load_s = 1.0
    second = _gpt_trainer(seed=3)
    AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(second)
    MetricsTracker(5, run_dir=tmp_path).attach(second)
    published = _snapshots(second)

    @second.on(Events.TRAIN_START, priority=Places.RESUME - 1)
    def slow_load() -> None:  # right after the checkpointer restored step 7
        assert second.state.step == 7
        time.sleep(load_s)

    second.run(_tokens(12), max_steps=10)
    m = published[10]
    step_tokens = 2 * SEQ  # one microbatch of 2 sequences per step
    assert m["tokens_seen"] == 10 * step_tokens
    assert m["tokens_per_s"] == pytest.approx(step_tokens / (m["step_time_s"] + m["data_time_s"]), rel=1e-9)
    assert m["step_time_s"] + m["data_time_s"] < load_s
    rows = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    after = [r for r in rows if r["event"] == "progress" and r["step"] == 10]
    assert after and after[-1]["tokens_per_s"] == pytest.approx(m["tokens_per_s"])


def test_publishes_a_partial_interval_when_the_run_stops_early():
    trainer = _gpt_trainer()
    MetricsTracker(10).attach(trainer)
    trainer.add_event_handler(Events.STEP_END(once=3), lambda: trainer.control.request_stop("test"))
    trainer.run(_tokens(), max_steps=8)
    assert trainer.state.metrics_step == 3 and trainer.state.metrics["tokens_seen"] == 3 * 2 * SEQ


def test_resident_memory_is_read_at_most_once_a_second(monkeypatch):
    """Reading /proc/self/statm costs a system call as dear as the rest of a publication: a tracker
    publishing every step reads it about once a second and publishes the last reading between."""
    from hookloop.handlers import metrics

    reads: list[float] = []

    def read() -> float:
        reads.append(time.monotonic())
        return 100.0 + len(reads)

    monkeypatch.setattr(metrics, "_read_rss_mb", read)
    monkeypatch.setattr(metrics, "_rss_read", (-1.0, 0.0))
    trainer = _gpt_trainer()
    MetricsTracker(1).attach(trainer)
    published = _snapshots(trainer)
    start = time.monotonic()
    trainer.run(_tokens(20), max_steps=20)
    elapsed = time.monotonic() - start
    assert len(published) == 20 and 1 <= len(reads) <= elapsed + 1
    assert all(b - a >= 1.0 for a, b in zip(reads, reads[1:]))
    assert {m["rss_mb"] for m in published.values()} == {100.0 + i for i in range(1, len(reads) + 1)}


def test_flops_per_token_estimates():
    gpt = GPT(GPTConfig(seq_len=SEQ, n_layers=2, d_model=32, n_heads=2))
    assert estimate_flops_per_token(gpt) == gpt.flops_per_token()

    mlp = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    assert estimate_flops_per_token(mlp) == 6 * (8 * 8 + 8)

    class Shaped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"num_layers": 2, "hidden_size": 8, "max_seq_len": 4})()
            self.lin = torch.nn.Linear(8, 8, bias=False)

    assert estimate_flops_per_token(Shaped()) == 6 * 64 + 12 * 2 * 8 * 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"log_interval": 0}, "log_interval"),
        ({"flops_per_token": -1.0}, "flops_per_token"),
        ({"peak_flops_per_device": math.inf}, "peak_flops_per_device"),
    ],
)
def test_bad_arguments(kwargs, field):
    kwargs = {"log_interval": 1, **kwargs}
    with pytest.raises(ConfigError) as info:
        MetricsTracker(kwargs.pop("log_interval"), **kwargs)
    assert info.value.field == field


def two_rank_worker(rank: int, world_size: int, run_dir: str) -> dict:
    from hookloop.engine.parallel import init_distributed, wrap_data_parallel
    from hookloop.handlers.jsonl_logger import JSONLLogger

    init_distributed("gloo", timeout_s=60)
    torch.manual_seed(0)
    model = wrap_data_parallel(GPT(GPTConfig(seq_len=SEQ, n_layers=1, d_model=32, n_heads=2)), "ddp")
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)
    MetricsTracker(2, run_dir=run_dir).attach(trainer)
    JSONLLogger(f"{run_dir}/metrics.jsonl").attach(trainer)

    @trainer.on(Events.STEP_END, priority=-10)
    def uneven() -> None:  # rank 1 reports a long blocking stretch: MAX keeps the slow rank's view
        if rank == 1:
            time.sleep(0.05)

    published = _snapshots(trainer)
    trainer.run(_tokens(seed=1 + rank), max_steps=4)
    return published


def test_two_ranks_agree_on_reduced_metrics_and_only_rank0_logs(tmp_path):
    results = run_distributed(two_rank_worker, 2, str(tmp_path))
    r0, r1 = results
    assert sorted(r0) == sorted(r1) == [2, 4]
    for step in (2, 4):
        for key in ("step_time_s", "data_time_s", "tokens_per_s", "rss_mb", "loss", "tokens_seen"):
            assert r0[step][key] == r1[step][key], key
        assert r0[step]["tokens_seen"] == step * 2 * 2 * SEQ, "tokens are summed over ranks"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "progress.jsonl"]


def test_from_config(tmp_path):
    from hookloop.handlers.metrics import MetricsConfig

    tracker = MetricsTracker.from_config(
        MetricsConfig(peak_flops_per_device=2e12), log_interval=7, run_dir=tmp_path
    )
    assert (tracker.log_interval, tracker.peak_flops_per_device, tracker.run_dir) == (7, 2e12, tmp_path)
