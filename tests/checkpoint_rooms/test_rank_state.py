"""A rank's state round trip: what ``capture`` takes of a trainer (counters, LR scheduler, stateful
handlers, RNG, settings) and ``load`` puts back into another one, with the model and optimizer, on
resume and on rollback (where event counters and some handlers keep their live values)."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from hookloop.engine import ConfigError
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.handlers.checkpoint.rank_state import RankState
from hookloop.handlers.checkpoint.resume_settings import ResumeSettings
from tests.checkpoint_rooms import fakes

LOGGER = "hookloop.handlers.checkpoint"


class Tally:
    """A stateful handler; ``restore_on_rollback`` False keeps its live value through a rollback."""

    def __init__(self, restore_on_rollback: bool = True) -> None:
        self.count = 0
        self.restore_on_rollback = restore_on_rollback

    def state_dict(self) -> dict:
        return {"count": self.count, "history": (1, 2), "weights": torch.arange(2.0)}

    def load_state_dict(self, state: dict) -> None:
        if state["history"] != (1, 2) or not torch.equal(state["weights"], torch.arange(2.0)):
            raise ValueError(f"not what was saved: {state}")
        self.count = state["count"]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_state(trainer, sess, tmp_path, load_optimizer: bool = True) -> RankState:
    return RankState(
        trainer,
        fakes.reader(fakes.store(tmp_path, sess), sess),
        ResumeSettings(sess),
        load_optimizer=load_optimizer,
        long_wait=fakes.LongWaits(),
    )


def trained(seed: int, optimizer_kind=torch.optim.AdamW):
    trainer = fakes.bare_trainer(seed)
    if optimizer_kind is not torch.optim.AdamW:
        trainer.optimizer = optimizer_kind(trainer.model.parameters(), lr=1e-2)
    trainer.lr_scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1, gamma=0.5)
    trainer.register_stateful("tally", Tally())
    trainer.register_stateful("detector", Tally(restore_on_rollback=False))
    return trainer


def save_trainer(trainer, step: int, sess, tmp_path) -> str:
    state = trainer.state
    state.iteration, state.epoch, state.microbatches_seen, state.validations = step, 2, 3 * step, 1
    state.loss, state.metrics = 0.75, {"val_loss": torch.tensor(1.25), "note": "text"}
    trainer.optimizer.step()  # no gradients: nothing changes, the scheduler sees the order it expects
    trainer.lr_scheduler.step()
    trainer.stateful["tally"].count = trainer.stateful["detector"].count = 10 * step
    extra = rank_state(trainer, sess, tmp_path).capture(step)
    return fakes.save(tmp_path, step, trainer.model, trainer.optimizer, extra=extra)


def test_capture_takes_the_counters_counting_this_save_and_what_the_run_last_said(tmp_path, sess):
    trainer = trained(0)
    trainer.state.checkpoints_saved = 2
    path = save_trainer(trainer, 6, sess, tmp_path)
    extra = fakes.read_json_file(path, "rank_00000.json")
    assert extra["step"] == 6 and extra["counters"]["step"] == 6
    assert extra["counters"]["checkpoints_saved"] == 3  # a run resumed from it has saved it
    assert extra["last"] == {"loss": 0.75, "metrics": {"val_loss": 1.25}}  # numbers only
    assert set(extra["handlers"]) == {"tally", "detector"}
    assert extra["settings"]["optimizer"]["kind"] == "AdamW"


def test_a_resume_puts_back_model_optimizer_scheduler_counters_handlers_and_rng(tmp_path, sess):
    source = trained(0)
    seed_all(1)
    path = save_trainer(source, 6, sess, tmp_path)
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(2))
    target = trained(7)
    seed_all(99)
    step = rank_state(target, sess, tmp_path).load(path, rollback=False)
    assert step == 6 and target.state.iteration == 6 and target.state.epoch == 2
    assert target.state.microbatches_seen == 18 and target.state.validations == 1
    assert target.state.loss == 0.75 and target.state.metrics["val_loss"] == 1.25
    for a, b in zip(source.model.state_dict().values(), target.model.state_dict().values()):
        assert torch.equal(a, b)
    moments = [s["exp_avg"] for s in target.optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, source.optimizer.state.values()))
    assert target.lr_scheduler.last_epoch == 1 and target.optimizer.param_groups[0]["lr"] == 5e-3
    assert target.state.lr == 5e-3
    assert target.stateful["tally"].count == 60 and target.stateful["detector"].count == 60
    draws = (random.random(), float(np.random.rand()), torch.rand(2))
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])


def test_a_resume_puts_this_runs_hyperparameters_back_and_says_the_change(tmp_path, sess, caplog):
    path = save_trainer(trained(0), 6, sess, tmp_path)  # AdamW's default weight decay, 0.01
    target = trained(7)
    for group in target.optimizer.param_groups:
        group["weight_decay"] = 0.5
    state = rank_state(target, sess, tmp_path)
    state.load(path, rollback=False)
    assert target.optimizer.param_groups[0]["weight_decay"] == 0.5  # the config's, not the checkpoint's
    with caplog.at_level(logging.INFO, logger=LOGGER):
        state.say_resumed()
    assert f"resumed from {path} (step 6)" in caplog.text
    assert "optimizer.weight_decay 0.01 -> 0.5" in caplog.text


def test_a_rollback_keeps_event_counters_and_handlers_that_ask_to_keep_their_state(tmp_path, sess):
    trainer = trained(0)
    path = save_trainer(trainer, 4, sess, tmp_path)
    state = trainer.state
    state.iteration, state.epoch, state.microbatches_seen, state.validations = 9, 3, 50, 4
    trainer.stateful["tally"].count = trainer.stateful["detector"].count = 99
    with torch.no_grad():
        trainer.model[0].weight.fill_(float("nan"))
    step = rank_state(trainer, sess, tmp_path).load(path, rollback=True)
    assert step == 4 and state.iteration == 4
    assert (state.epoch, state.microbatches_seen, state.validations) == (3, 50, 4)  # monotonic
    assert trainer.stateful["tally"].count == 40 and trainer.stateful["detector"].count == 99
    assert torch.isfinite(trainer.model[0].weight).all()


def test_handler_state_missing_on_either_side_is_named(tmp_path, sess, caplog):
    source = trained(0)
    path = save_trainer(source, 2, sess, tmp_path)
    target = fakes.bare_trainer(1)
    target.lr_scheduler = torch.optim.lr_scheduler.StepLR(target.optimizer, step_size=1)
    target.register_stateful("tally", Tally())
    target.register_stateful("newcomer", Tally())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rank_state(target, sess, tmp_path).load(path, rollback=False)
    assert "handler state 'newcomer' is not in the checkpoint; it starts fresh" in caplog.text
    assert "the checkpoint holds state for 'detector', but no handler registered that key" in caplog.text


def test_a_handler_that_cannot_take_its_state_is_a_checkpoint_error_naming_the_path(tmp_path, sess):
    source = trained(0)
    path = save_trainer(source, 2, sess, tmp_path)

    class Picky(Tally):
        def load_state_dict(self, state: dict) -> None:
            raise KeyError("count_v2")

    target = fakes.bare_trainer(1)
    target.lr_scheduler = torch.optim.lr_scheduler.StepLR(target.optimizer, step_size=1)
    target.register_stateful("tally", Picky())  # the same key, a handler of another version
    with pytest.raises(CheckpointError, match=rf"restoring {path} failed \(KeyError: 'count_v2'\)"):
        rank_state(target, sess, tmp_path).load(path, rollback=False)


def test_a_refused_setting_stops_the_resume_before_the_model_loads(tmp_path, sess):
    path = save_trainer(trained(0), 2, sess, tmp_path)
    target = trained(1, optimizer_kind=torch.optim.SGD)
    before = fakes.parameters(target.model)
    with pytest.raises(ConfigError, match=r"optimizer\.name: .*trained with adamw, this run sets sgd"):
        rank_state(target, sess, tmp_path).load(path, rollback=False)
    after = fakes.parameters(target.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_check_finds_a_crafted_state_file_and_passes_an_intact_one(tmp_path, sess):
    trainer = trained(0)
    path = save_trainer(trainer, 3, sess, tmp_path)
    state = rank_state(trainer, sess, tmp_path)
    assert state.check(path) == []
    extra = fakes.read_json_file(path, "rank_00000.json")
    extra["counters"]["step"] = 2
    fakes.write_json_file(path, "rank_00000.json", extra)
    problems = state.check(path)
    assert len(problems) == 1 and "holds counters.step = '2', not the state's step 3" in problems[0]
