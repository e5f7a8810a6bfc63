"""The save policy: what a handler that judges the state tells a handler that saves it."""

from __future__ import annotations

import pytest

from hookloop.engine import Trainer
from hookloop.engine.save_policy import SavePolicy
from tests.cadence import save_every


def test_a_fresh_policy_holds_nothing_protects_nothing_and_wants_no_initial_save():
    policy = SavePolicy()
    assert not policy.saves_held and policy.holders == ()
    assert policy.protected_step is None
    assert not policy.initial_save_wanted and not policy.initial_save_due(0)


def test_saves_are_held_while_any_judge_holds_them():
    policy = SavePolicy()
    policy.hold_saves(by="nan")
    policy.hold_saves(by="spike")
    policy.hold_saves(by="nan")  # holding twice is one hold
    assert policy.saves_held and policy.holders == ("nan", "spike")
    policy.release_saves(by="nan")
    assert policy.saves_held  # one judge releasing never releases another's hold
    policy.release_saves(by="spike")
    policy.release_saves(by="never_held")  # no change, no error
    assert not policy.saves_held


def test_the_protected_step_is_the_oldest_any_judge_protects_and_may_go_back():
    policy = SavePolicy()
    policy.protect(7, by="nan")
    assert policy.protected_step == 7
    policy.protect(3, by="nan")  # after a rollback the newest good step is lower: replaced
    assert policy.protected_step == 3
    policy.protect(5, by="spike")
    assert policy.protected_step == 3  # every judge's trusted step is kept
    policy.protect(None, by="nan")  # withdrawn
    assert policy.protected_step == 5
    policy.protect(0, by="spike")
    assert policy.protected_step == 0


@pytest.mark.parametrize("step", [-1, 2.5, True, "3"])
def test_protect_refuses_what_is_not_a_step(step):
    with pytest.raises(ValueError, match="step number"):
        SavePolicy().protect(step, by="nan")


@pytest.mark.parametrize("by", ["", None, 3])
def test_a_judge_names_itself(by):
    policy = SavePolicy()
    for call in (policy.hold_saves, policy.release_saves, lambda b: policy.protect(1, b)):
        with pytest.raises(ValueError, match="name the judge"):
            call(by)


def test_the_initial_save_is_due_only_when_wanted_and_the_run_starts_fresh():
    policy = SavePolicy()
    policy.want_initial_save()
    assert policy.initial_save_wanted
    assert policy.initial_save_due(0)
    assert not policy.initial_save_due(12)  # a resumed run has its checkpoint already


def test_every_trainer_owns_one_policy_both_kinds_of_handler_receive(tmp_path):
    import torch

    from hookloop.handlers import AsyncCheckpointer, NaNDetector
    from hookloop.models.gpt import cross_entropy_loss
    from tests.conftest import tiny_gpt

    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    other = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    assert isinstance(trainer.save_policy, SavePolicy) and trainer.save_policy is not other.save_policy
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    NaNDetector(action="rollback").attach(trainer)
    assert trainer.save_policy.initial_save_wanted and not other.save_policy.initial_save_wanted
    NaNDetector(action="warn").attach(other)  # warns only: nothing to roll back to
    assert not other.save_policy.initial_save_wanted


def test_the_checkpointer_saves_nothing_while_held_and_publishes_once_released(tmp_path):
    import torch

    from hookloop.engine import Events
    from hookloop.handlers import AsyncCheckpointer
    from hookloop.models.gpt import cross_entropy_loss
    from tests.conftest import tiny_gpt, token_batches

    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    AsyncCheckpointer(tmp_path, mode="sync", keep_last=10).attach(trainer)
    save_every(trainer, 1)
    saved = []
    trainer.add_event_handler(Events.CHECKPOINT_SAVED, lambda _e, step=None, path=None: saved.append(step))

    @trainer.on(Events.STEP_START)
    def judge(e):  # distrust steps 2 and 3
        if e.state.step in (2, 3):
            e.save_policy.hold_saves(by="test")
        else:
            e.save_policy.release_saves(by="test")

    trainer.run(token_batches(10), max_steps=5)
    assert saved == [1, 4, 5]


def test_a_hold_waits_while_a_saver_publishes_under_unheld():
    """A saver publishing on its own thread makes a checkpoint visible inside ``unheld()``: a hold
    asked meanwhile returns only after the block, and the next block sees it."""
    import threading

    policy = SavePolicy()
    held = threading.Event()
    with policy.unheld() as allowed:
        assert allowed
        judge = threading.Thread(target=lambda: (policy.hold_saves("nan"), held.set()))
        judge.start()
        assert not held.wait(0.2)  # the hold waits for the publish in progress
    assert held.wait(10)
    judge.join(10)
    with policy.unheld() as allowed:
        assert not allowed
