"""StragglerDetector on real gloo process groups: it names the slow rank and can stop the run."""

from __future__ import annotations

import time

import pytest
import torch

from hookloop.engine import ConfigError, Events, ExitCode, Trainer
from hookloop.handlers.straggler import StragglerDetector
from tests.dist_utils import run_distributed


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run(rank: int, slow_rank: int, extra_s: float, threshold: float | None) -> dict:
    from hookloop.engine.parallel import wrap_data_parallel

    torch.manual_seed(0)
    model = wrap_data_parallel(torch.nn.Linear(16, 1), "ddp")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)
    detector = StragglerDetector(every_steps=4, stop_threshold=threshold).attach(trainer)

    # the slow rank does extra work inside the step, before the gradient all-reduce: the fast rank
    # waits for it there, so both have the same wall-clock step time
    @trainer.on(Events.STEP_START, priority=-1)
    def slow_down() -> None:
        if rank == slow_rank:
            _busy(extra_s)

    data = [(torch.randn(4, 16), torch.randn(4, 1)) for _ in range(12)]
    state = trainer.run(data, max_steps=12)
    return {
        "report": detector.last_report,
        "metrics": {k: v for k, v in state.metrics.items() if k.startswith("straggler/")},
        "step": state.step,
        "exit_code": state.control.exit_code,
        "stop_reason": state.control.stop_reason,
    }


def straggler_worker(rank: int, world_size: int) -> dict:
    from hookloop.engine.parallel import init_distributed

    init_distributed("gloo", timeout_s=60)
    # report only (rank 1 slow), then stop over the threshold (rank 0 slow)
    return {"report": _run(rank, 1, 0.03, None), "stop": _run(rank, 0, 0.03, 1.2)}


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_distributed(straggler_worker, 2)


def test_names_the_slow_rank_without_stopping(two_rank_results):
    results = [r["report"] for r in two_rank_results]
    for r in results:
        report = r["report"]
        assert report["slowest_rank"] == 1 and report["fastest_rank"] == 0
        assert report["rank_step_s"][1] > report["rank_step_s"][0]
        assert r["metrics"]["straggler/slowest_rank"] == 1
        assert r["metrics"]["straggler/slowdown"] > 1.2
        assert r["step"] == 12 and r["exit_code"] == 0
    # every rank sees the same figures
    assert results[0]["report"] == results[1]["report"]


def test_stops_every_rank_over_threshold(two_rank_results):
    for r in (r["stop"] for r in two_rank_results):
        assert r["step"] == 4, "the stop is agreed at the first report"
        assert r["exit_code"] == ExitCode.STRAGGLER_ABORT
        assert "rank 0" in r["stop_reason"]


def test_single_process_reports_itself():
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    detector = StragglerDetector(every_steps=2, clock="wall").attach(trainer)
    trainer.run([(torch.randn(2, 4), torch.randn(2, 1))] * 4, max_steps=4)
    assert detector.last_report["slowest_rank"] == 0 and detector.last_report["slowdown"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"stop_threshold": 0.9}, "stop_threshold"),
        ({"window": 0}, "window"),
        ({"clock": "gpu"}, "clock"),
    ],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(ConfigError) as info:
        StragglerDetector(**kwargs)
    assert info.value.field == field


def test_from_config():
    from hookloop.handlers.straggler import StragglerConfig

    detector = StragglerDetector.from_config(StragglerConfig(enabled=True, every_steps=9, stop_threshold=1.5))
    assert (detector.every_steps, detector.stop_threshold, detector.window) == (9, 1.5, 9)
