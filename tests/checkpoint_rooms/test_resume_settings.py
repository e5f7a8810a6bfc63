"""Resume settings: what a checkpoint records of the run's settings, and what a resume does with a
changed one: honoured (this run's value in force from the resumed step, said in one line) or
refused by name with the way back, before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from hookloop.engine import ConfigError
from hookloop.engine.checkpoint_format.errors import CheckpointError, CheckpointLayoutError
from hookloop.engine.lr import build_lr_scheduler
from hookloop.handlers.checkpoint.resume_settings import (
    NEW_RUN,
    NOT_SET,
    Recorded,
    ResumeSettings,
    same,
    show,
)
from tests.checkpoint_rooms import fakes


def trainer_with(optimizer_kind=torch.optim.AdamW, groups: int = 1, schedule: dict | None = None, **hyper):
    trainer = fakes.bare_trainer()
    params = list(trainer.model.parameters())
    chunks = [params] if groups == 1 else [params[:2], params[2:]]
    trainer.optimizer = optimizer_kind([{"params": chunk} for chunk in chunks], **{"lr": 1e-2, **hyper})
    if schedule is not None:
        trainer.lr_scheduler = build_lr_scheduler(trainer.optimizer, **schedule)
    return trainer


def recorded(sess, trainer, run: dict | None = None) -> dict:
    """The ``settings`` entry a save of ``trainer`` writes, as it reads back from JSON."""
    settings = ResumeSettings(sess)
    settings.record(run or {})
    return json.loads(json.dumps(settings.capture(trainer)))


def plan(sess, trainer, saved, run: dict | None = None, load_optimizer: bool = True, scheduler=None):
    settings = ResumeSettings(sess)
    settings.record(run or {})
    return settings.plan(trainer, saved, scheduler, step=10, load_optimizer=load_optimizer)


def test_the_same_settings_change_nothing_and_say_nothing(sess):
    run = {"train.seq_len": Recorded(16, refuse="the data position counts tokens")}
    saved = recorded(sess, trainer_with(weight_decay=0.1), run)
    p = plan(sess, trainer_with(weight_decay=0.1), saved, run)
    assert p.refusal is None and p.changes == [] and p.unknown == [] and p.line(None) is None


def test_changed_hyperparameters_are_honoured_and_said(sess):
    saved = recorded(sess, trainer_with(weight_decay=0.1))
    trainer = trainer_with(lr=2e-2, weight_decay=0.0)
    p = plan(sess, trainer, saved)
    assert p.refusal is None
    assert p.changes == ["optimizer.lr 0.01 -> 0.02", "optimizer.weight_decay 0.1 -> 0"]
    for group in trainer.optimizer.param_groups:  # the checkpoint's load would put its own back
        group["lr"], group["weight_decay"] = 1e-2, 0.1
    ResumeSettings(sess).honour(trainer, p)
    assert [(g["lr"], g["weight_decay"]) for g in trainer.optimizer.param_groups] == [(2e-2, 0.0)]
    line = p.line(None)
    assert line.startswith("resuming at step 10 with settings from the checkpoint changed")
    assert "in effect from step 11" in line and "optimizer.weight_decay 0.1 -> 0" in line


def test_another_optimizer_kind_is_refused_unless_its_state_starts_fresh(sess):
    saved = recorded(sess, trainer_with(torch.optim.AdamW))
    p = plan(sess, trainer_with(torch.optim.SGD), saved)
    assert isinstance(p.refusal, ConfigError) and p.refusal.field == "optimizer.name"
    message = str(p.refusal)
    assert "trained with adamw, this run sets sgd" in message and "set optimizer.name=adamw" in message
    assert "checkpoint.load_optimizer=false" in message and message.endswith(NEW_RUN)
    fresh = plan(sess, trainer_with(torch.optim.SGD), saved, load_optimizer=False)
    assert fresh.refusal is None and "optimizer.name adamw -> sgd" in fresh.changes
    assert fresh.changes[0] == "checkpoint.load_optimizer=false: the optimizer's state starts fresh"


def test_other_parameter_groups_and_amsgrad_are_refused(sess):
    saved = recorded(sess, trainer_with(groups=1))
    assert plan(sess, trainer_with(groups=2), saved).refusal.field == "optimizer.param_groups"
    p = plan(sess, trainer_with(amsgrad=True), recorded(sess, trainer_with(amsgrad=False)))
    assert p.refusal.field == "optimizer.amsgrad" and "changes what the optimizer's state holds" in str(
        p.refusal
    )


def test_a_recorded_run_setting_is_refused_or_said_as_recorded(sess):
    saved = recorded(
        sess,
        trainer_with(),
        {"train.seq_len": Recorded(16, refuse="the data position counts tokens"), "seed": Recorded(1)},
    )
    run = {"train.seq_len": Recorded(32, refuse="the data position counts tokens"), "seed": Recorded(2)}
    p = plan(sess, trainer_with(), saved, run)
    assert p.refusal.field == "train.seq_len"
    assert "trained with 16, this run sets 32; the data position counts tokens: set train.seq_len=16" in str(
        p.refusal
    )
    assert "seed 1 -> 2" in p.changes


def test_a_model_argument_given_in_one_run_only_is_a_change_and_names_a_layout_error(sess):
    saved = recorded(sess, trainer_with(), {"model.d_model": Recorded(32)})
    p = plan(sess, trainer_with(), saved, {})
    assert p.model_changes == [("model.d_model", 32, NOT_SET)]
    error = p.layout_error(CheckpointLayoutError("checkpoint.resume", "another layout"))
    assert error.field == "model.d_model" and "set model.d_model=32 to resume it" in str(error)


def test_a_checkpoint_without_settings_resumes_with_this_runs_and_says_so(sess):
    p = plan(sess, trainer_with(), None)
    assert p.refusal is None
    assert "not recorded in the checkpoint (an earlier version wrote it)" in p.line(None)


def test_a_scheduler_that_cannot_take_other_base_rates_refuses_them(sess):
    trainer = trainer_with()
    trainer.lr_scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1)
    saved_state = {"base_lrs": [5e-3], "_last_lr": [5e-3]}
    p = plan(sess, trainer, recorded(sess, trainer), scheduler=saved_state)
    assert p.refusal.field == "optimizer.lr" and "StepLR" in str(p.refusal)


def test_a_schedule_is_evaluated_at_the_resumed_step_with_this_runs_peak(sess):
    schedule = dict(warmup_steps=0, decay_steps=20, decay_style="linear", min_lr=0.0)
    old = trainer_with(lr=1e-2, schedule=schedule)
    for _ in range(10):
        old.optimizer.step()
        old.lr_scheduler.step()
    saved, saved_scheduler = recorded(sess, old), old.lr_scheduler.state_dict()
    trainer = trainer_with(lr=2e-2, schedule=schedule)
    p = plan(sess, trainer, saved, scheduler=saved_scheduler)
    assert p.refusal is None and p.old_lr == pytest.approx(5e-3)
    trainer.lr_scheduler.load_state_dict(saved_scheduler)  # what the checkpoint's load puts back
    trainer.optimizer.param_groups[0]["lr"] = 5e-3
    lrs = ResumeSettings(sess).honour(trainer, p)
    assert lrs == pytest.approx([1e-2])  # half-way down a linear decay from this run's 2e-2
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    assert trainer.lr_scheduler.base_lrs == [2e-2]
    assert "learning rate 0.005 -> 0.01" in p.line(lrs)


def test_agree_raises_this_ranks_error_and_nothing_without_one(sess):
    settings = ResumeSettings(sess)
    settings.agree(None)
    with pytest.raises(CheckpointError, match="cannot read"):
        settings.agree(CheckpointError("cannot read"))


def test_recorded_values_compare_by_value_and_show_as_a_config_spells_them():
    assert same(1, 1.0) and not same(True, 1) and not same({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert same([1, (2, 3)], [1, [2, 3]])
    assert [show(v) for v in (True, None, 0.1, [1, "a"], {"k": False})] == [
        "true",
        "null",
        "0.1",
        "[1, a]",
        "{k: false}",
    ]
