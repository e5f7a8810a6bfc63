"""ConsoleLogger's progress bar counts the run's optimizer steps, across epochs, out of the run's
total, and times the rate from the end of the first step."""

from __future__ import annotations

import io
import re
import time

import torch

from hookloop.engine import Events, Priority, Trainer
from hookloop.handlers.console import ConsoleLogger
from hookloop.handlers.metrics import MetricsTracker
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches


def _trainer(grad_accum_steps: int = 1) -> Trainer:
    model = tiny_gpt(0, n_layers=1)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        cross_entropy_loss,
        grad_accum_steps=grad_accum_steps,
    )


def _bar_run(refresh_every: int = 3, **run_kwargs) -> tuple[str, ConsoleLogger]:
    out = io.StringIO()
    trainer = _trainer()
    MetricsTracker(5).attach(trainer)
    logger = ConsoleLogger(stream=out, progress_bar=True, refresh_every=refresh_every).attach(trainer)
    trainer.run(token_batches(8), **run_kwargs)
    return out.getvalue(), logger


def _last_frame(text: str) -> str:
    return re.split(r"[\r\n]", text.rstrip())[-1]


def test_bar_counts_max_steps_across_epochs():
    text, logger = _bar_run(max_steps=20)  # 8 steps per epoch: the run crosses two epochs
    assert "4611686018427387904" not in text and "/?" not in text and "Epoch" not in text
    assert "20/20" in _last_frame(text) and "100%" in _last_frame(text)
    assert (logger.pbar.n, logger.pbar.total) == (20, 20)
    shown = [int(m) for m in re.findall(r"(\d+)/20 ", text)]
    assert shown == sorted(shown) and 9 in shown and 12 in shown  # one bar, on through the epoch end


def test_bar_total_is_epochs_times_steps_per_epoch_when_only_epochs_limit_the_run():
    text, logger = _bar_run(max_epochs=3)
    assert "24/24" in _last_frame(text) and "/?" not in text
    assert (logger.pbar.n, logger.pbar.total) == (24, 24)


def test_bar_total_counts_optimizer_steps_not_microbatches():
    out = io.StringIO()
    trainer = _trainer(grad_accum_steps=2)
    logger = ConsoleLogger(stream=out, progress_bar=True, refresh_every=1).attach(trainer)
    trainer.run(token_batches(8), max_epochs=2)  # 4 steps per epoch
    assert "8/8" in _last_frame(out.getvalue())
    assert (logger.pbar.n, logger.pbar.total) == (8, 8)


def test_rate_leaves_out_the_first_step():
    trainer = _trainer()
    out = io.StringIO()
    logger = ConsoleLogger(stream=out, progress_bar=True, refresh_every=1).attach(trainer)

    @trainer.on(Events.STEP_END, priority=Priority.DECIDE)
    def _slow_first_step():
        if trainer.state.step == 1:
            time.sleep(1.0)  # a compile-sized first step

    trainer.run(token_batches(8), max_steps=6)
    bar = logger.pbar
    assert bar.initial == 1  # the rate counts the 5 steps after the first
    assert time.time() - bar.start_t < 1.0
    assert "6/6" in _last_frame(out.getvalue())
