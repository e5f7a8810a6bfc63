"""torch.compile per block or whole model: clean state-dict keys, checkpoints that load across
compiled and uncompiled runs, the ``train.compile`` setting, and the MetricsTracker keeping a
run's first (compile/warm-up) step out of its averages."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from hookloop.engine import Events, Priority, Trainer
from hookloop.engine.activation_checkpointing import apply_activation_checkpointing
from hookloop.engine.compile import compile_mode, compile_model
from hookloop.engine.config import TrainConfig
from hookloop.engine.errors import ConfigError
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.handlers.metrics import MetricsTracker
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches

SEQ = 16


def _trainer(model: torch.nn.Module) -> Trainer:
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


def _compiled(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def test_compile_in_place_keeps_state_dict_keys():
    keys = list(tiny_gpt().state_dict())
    blocks = compile_model(tiny_gpt(), "blocks")
    assert _compiled(blocks) == ["blocks.0", "blocks.1"]
    whole = compile_model(tiny_gpt(), "model")
    assert _compiled(whole) == [""] and type(whole).__name__ == "GPT"
    both = compile_model(apply_activation_checkpointing(tiny_gpt(), "full"), True)
    assert _compiled(both) == ["blocks.0", "blocks.1"]
    for model in (blocks, whole, both):
        assert list(model.state_dict()) == keys
        assert not any("_orig_mod" in k for k in model.state_dict())
    assert _compiled(compile_model(tiny_gpt(), False)) == []


@pytest.mark.parametrize("value", ["yes", "Blocks", None, 1, 0])
def test_config_names_the_field(value):
    with pytest.raises(ConfigError, match=r"train\.compile"):
        TrainConfig(compile=value).validate()


def test_config_modes():
    assert [compile_mode(v) for v in (False, True, "blocks", "model")] == [None, "blocks", "blocks", "model"]
    for value in (False, True, "blocks", "model"):
        TrainConfig(compile=value).validate()


def _restored_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The model's weights right after the checkpointer restored them at TRAIN_START."""
    seen: dict[str, torch.Tensor] = {}

    @trainer.on(Events.TRAIN_START, priority=Priority.CLEANUP + 1)
    def grab() -> None:
        seen.update({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})

    return seen


@pytest.mark.slow
def test_checkpoints_load_across_compiled_and_uncompiled_runs(tmp_path):
    data = token_batches(4)
    # compiled per block (with activation checkpointing) writes; an uncompiled plain model resumes
    compiled = compile_model(apply_activation_checkpointing(tiny_gpt(seed=0), "full"), "blocks")
    first = _trainer(compiled)
    AsyncCheckpointer(tmp_path / "a", mode="sync").attach(first)
    first.run(data, max_steps=2)
    written = {k: v.detach().clone() for k, v in compiled.state_dict().items()}
    plain = tiny_gpt(seed=1)
    second = _trainer(plain)
    AsyncCheckpointer(tmp_path / "a", mode="sync").attach(second)
    restored = _restored_weights(second)
    state = second.run(data, max_steps=3)
    assert state.step == 3 and restored.keys() == written.keys()
    torch.testing.assert_close(restored, written, atol=0, rtol=0)

    # uncompiled writes; a whole-model compiled run resumes and trains on
    whole = compile_model(tiny_gpt(seed=2), "model")
    third = _trainer(whole)
    AsyncCheckpointer(tmp_path / "a", mode="sync").attach(third)
    restored = _restored_weights(third)
    state = third.run(data, max_steps=4)
    assert state.step == 4 and _compiled(whole) == [""]
    assert not any("_orig_mod" in k for k in restored)
    torch.testing.assert_close(
        restored, {k: v.detach() for k, v in plain.state_dict().items()}, atol=0, rtol=0
    )


class _SlowFirstCall(torch.nn.Module):
    """A model whose first forward takes ``delay`` seconds longer, like a step that compiles."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.gpt = tiny_gpt(n_layers=1)
        self.delay = delay
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.delay)
        return self.gpt(x)


def test_metrics_leave_the_first_step_out_of_the_averages(caplog):
    model = _SlowFirstCall(delay=0.5)
    trainer = _trainer(model)
    MetricsTracker(3, flops_per_token=1e6, peak_flops_per_device=1e12).attach(trainer)
    published: dict[int, dict] = {}

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP + 1)
    def grab() -> None:
        if trainer.state.metrics_step == trainer.state.step:
            published[trainer.state.step] = dict(trainer.state.metrics)

    with caplog.at_level(logging.INFO, logger="hookloop.handlers.metrics"):
        trainer.run(token_batches(6), max_steps=6)
    first = trainer.state.times["first_step"]
    assert first >= 0.5
    reports = [r.getMessage() for r in caplog.records if "first step (compile/warm-up)" in r.getMessage()]
    assert reports == [f"first step (compile/warm-up) took {first:.3f} s"]
    m = published[3]
    assert m["step_time_s"] < 0.25, "the slow first step leaked into the average"
    # steps 2 and 3 only: their tokens over their time
    assert m["tokens_per_s"] == pytest.approx(2 * 2 * SEQ / (2 * (m["step_time_s"] + m["data_time_s"])))
    assert m["mfu"] == pytest.approx(1e6 * m["tokens_per_s"] / 1e12)
    assert published[6]["step_time_s"] < 0.25


def test_an_interval_of_the_first_step_alone_publishes_no_timing():
    trainer = _trainer(tiny_gpt())
    MetricsTracker(1).attach(trainer)
    published: dict[int, dict] = {}

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP + 1)
    def grab() -> None:
        published[trainer.state.step] = dict(trainer.state.metrics)

    trainer.run(token_batches(2), max_steps=2)
    assert "step_time_s" not in published[1] and "tokens_per_s" not in published[1]
    assert published[1]["tokens_seen"] == 2 * SEQ and "first_step" in trainer.state.times
    assert published[2]["step_time_s"] > 0 and published[2]["tokens_per_s"] > 0
