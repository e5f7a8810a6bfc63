"""Resumes and rollbacks are recorded in progress.jsonl and marked on the plot."""

from __future__ import annotations

import torch

from hookloop.engine import Events, ExitCode, Trainer
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.handlers.jsonl_logger import JSONLLogger
from hookloop.handlers.metrics import MetricsTracker
from hookloop.handlers.plot import load_events, load_records, plot_run
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches


def _run(run_dir, *, stop_at=None, rollback_at=None):
    model = tiny_gpt(0, n_layers=1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cross_entropy_loss)
    AsyncCheckpointer(run_dir / "ckpt", mode="sync").attach(trainer)
    save_every(trainer, 4)
    MetricsTracker(2, run_dir=run_dir).attach(trainer)
    JSONLLogger(run_dir / "metrics.jsonl").attach(trainer)
    fired = []

    @trainer.on(Events.STEP_END, priority=1)
    def _control(engine):
        if engine.state.step == stop_at:
            engine.control.request_stop("test stop", ExitCode.STOPPED)
        if engine.state.step == rollback_at and not fired:
            fired.append(engine.state.step)
            engine.fire_event(Events.ROLLBACK)

    return trainer.run(token_batches(8), max_steps=12)


def test_resume_and_rollback_are_recorded_and_drawn(tmp_path):
    assert _run(tmp_path, stop_at=6).step == 6
    assert _run(tmp_path, rollback_at=10).step == 12
    assert load_events(tmp_path) == {"resume": [6], "rollback": [8]}  # a stop saves its step
    out = plot_run(tmp_path)
    assert out.is_file() and out.stat().st_size > 0
    assert [r["step"] for r in load_records(tmp_path / "metrics.jsonl")][0] == 2  # the first log step
