"""ProfilerWindow traces exactly the absolute steps [start, end), also after a resume."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from hookloop.engine import ConfigError, Events, Priority, Trainer
from hookloop.handlers.profiler import ProfilerWindow, ProfilingConfig


def _trainer(resume_at: int | None = None) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)
    if resume_at is not None:

        @trainer.on(Events.TRAIN_START, priority=Priority.RESTORE)
        def resume() -> None:  # restore counters as a checkpointer does, before other handlers
            trainer.state.load_counters({"step": resume_at, "epoch": 0})

    return trainer


def _data() -> list:
    return [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]


def _traced_steps(window: ProfilerWindow) -> list[int]:
    """The ProfilerStep#N regions found in this window's trace files."""
    steps = []
    for path in window.trace_files():
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            trace = json.load(f)
        steps += [
            int(e["name"].split("#")[1])
            for e in trace["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep#")
        ]
    return sorted(steps)


def test_fresh_run_traces_the_window_only(tmp_path):
    trainer = _trainer()
    window = ProfilerWindow(3, 5, output_dir=tmp_path).attach(trainer)
    trainer.run(_data(), max_steps=7)
    assert len(window.trace_files()) == 1
    assert window.trace_files()[0].name.startswith("rank0_steps3-5.")
    assert _traced_steps(window) == [3, 4]
    assert not window.active


def test_window_is_absolute_after_a_resume(tmp_path):
    # resumed at step 4: the run executes steps 5..10; a window counted from process start would
    # trace steps 9 and 10, ours traces 6 and 7
    trainer = _trainer(resume_at=4)
    window = ProfilerWindow(6, 8, output_dir=tmp_path, use_gzip=True).attach(trainer)
    trainer.run(_data(), max_steps=10)
    assert trainer.state.step == 10
    assert _traced_steps(window) == [6, 7]


def test_resume_inside_the_window_traces_the_rest_and_a_past_window_nothing(tmp_path):
    trainer = _trainer(resume_at=5)
    inside = ProfilerWindow(4, 8, output_dir=tmp_path / "inside").attach(trainer)
    past = ProfilerWindow(2, 5, output_dir=tmp_path / "past").attach(trainer)
    trainer.run(_data(), max_steps=9)
    assert _traced_steps(inside) == [6, 7]
    assert past.trace_files() == [] and not (tmp_path / "past").exists()


def test_run_ending_inside_the_window_exports_what_it_traced(tmp_path):
    trainer = _trainer()
    window = ProfilerWindow(3, 10, output_dir=tmp_path).attach(trainer)
    trainer.run(_data(), max_steps=4)
    assert _traced_steps(window) == [3, 4]


def test_other_ranks_do_not_trace(tmp_path):
    trainer = _trainer()
    window = ProfilerWindow(1, 3, ranks=[1], output_dir=tmp_path).attach(trainer)
    trainer.run(_data(), max_steps=3)
    assert window.trace_files() == []


def test_from_config(tmp_path):
    cfg = ProfilingConfig(enabled=True, start_step=2, end_step=4)
    window = ProfilerWindow.from_config(cfg, run_dir=tmp_path)
    assert (window.start_step, window.end_step, window.ranks) == (2, 4, (0,))
    assert window.output_dir == Path(tmp_path) / "profile"


@pytest.mark.parametrize(
    ("start", "end", "field"),
    [
        (5, 5, "end_step"),
        (5, 3, "end_step"),
        (0, 3, "start_step"),
        (-1, 3, "start_step"),
        (2, -1, "end_step"),
    ],
)
def test_bad_windows_are_config_errors(tmp_path, start, end, field):
    with pytest.raises(ConfigError) as info:
        ProfilerWindow(start, end, output_dir=tmp_path)
    assert info.value.field == field
    with pytest.raises(ConfigError) as info:
        ProfilingConfig(start_step=start, end_step=end).validate()
    assert info.value.field.startswith("profiling.")


def test_bad_ranks(tmp_path):
    with pytest.raises(ConfigError, match="ranks"):
        ProfilerWindow(1, 2, ranks=[-1], output_dir=tmp_path)
