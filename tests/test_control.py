"""The step's one control point: requests on ``trainer.control``, decisions at the agreement.

Checks the reset rules of :mod:`hookloop.engine.control` on a running trainer (what a request
survives, what the agreement records in ``control.decided``), that every way of asking for a stop
ends the run the same way, that the state's flags are views onto the control object, and that the
NaN detector and the checkpointer cooperate through it (no mailboxes on the state).
"""

from __future__ import annotations

import pytest
import torch
from ignite.engine.events import State

from hookloop.engine import Events, ExitCode, StepControl, Trainer, TrainState
from hookloop.engine.control import Decided, Rollback
from tests.cadence import save_every
from tests.conftest import token_batches


def _trainer(**kwargs) -> Trainer:
    from hookloop.models.gpt import cross_entropy_loss
    from tests.conftest import tiny_gpt

    model = tiny_gpt()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss, **kwargs)


# ------------------------------------------------------------------------------ the object alone
def test_requests_keep_the_first_reason_and_the_first_nonzero_exit_code():
    control = StepControl()
    control.request_stop("first")
    control.request_stop("second", ExitCode.STOPPED)
    control.request_stop("third", ExitCode.NAN_ABORT)
    assert (control.stop, control.stop_reason, control.exit_code) == (True, "first", ExitCode.STOPPED)
    control.request_rollback(4, keep_data_position=True)
    assert control.rollback == Rollback(at_or_before=4, keep_data_position=True)
    control.start_run()
    assert (control.stop, control.stop_reason, control.exit_code, control.rollback) == (False, None, 0, None)
    assert control.decided == Decided()


def test_a_save_asked_after_the_agreement_carries_to_the_next_step_and_a_skip_does_not():
    control = StepControl()
    control.request_save()
    control.request_skip()
    control.record_decided()  # the agreement saw both
    assert control.decided == Decided(skip=True, save=True)
    control.end_step(stop=False)
    assert (control.skip, control.save, control.decided) == (False, False, Decided())
    control.record_decided()  # an agreement with nothing asked
    control.request_save()  # then a late request
    control.request_skip()
    control.end_step(stop=False)
    assert (control.skip, control.save) == (False, True)


def test_the_state_has_no_views_onto_the_control_point():
    trainer = _trainer()
    control, state = trainer.control, trainer.state
    assert state.control is control
    for view in ("skip_step", "should_checkpoint", "should_stop", "stop_reason", "exit_code", "request_stop"):
        with pytest.raises(AttributeError):
            getattr(state, view)
    for flag in ("should_validate", "hold_saves", "protected_step", "initial_save"):
        assert not hasattr(state, flag) and not hasattr(control, flag), flag
    control.request_stop("asked", ExitCode.STOPPED)
    trainer.state = State()  # as ignite's docs do: the new state is bound to the same control point
    assert isinstance(trainer.state, TrainState) and trainer.state.control is control
    assert not hasattr(trainer.state, "exit_code")
    assert control.stop and control.exit_code == ExitCode.STOPPED
    for mailbox in (
        "known_good_step",
        "hold_checkpoints",
        "rollback_target_step",
        "rollback_keep_data_position",
        "initial_checkpoint_requested",
    ):
        assert not hasattr(TrainState(), mailbox), mailbox
    assert not hasattr(trainer, "decisions")


def test_a_validation_request_is_agreed_and_resets_with_the_step():
    control = StepControl()
    control.request_validate()
    control.record_decided()
    assert control.decided == Decided(validate=True)
    control.end_step(stop=False)
    assert not control.validate and control.decided == Decided()
    control.record_decided()
    control.request_validate()  # after the agreement: the next step's
    control.end_step(stop=False)
    assert control.validate
    control.withdraw_validate()
    assert not control.validate


# ------------------------------------------------------------------------------ on a running trainer
def test_decided_holds_the_agreed_values_during_the_step_and_only_the_stop_after_it():
    trainer = _trainer()
    seen = {}

    @trainer.on(Events.STEP_START)
    def ask(e):
        if e.state.step == 2:
            e.control.request_save()
        if e.state.step == 3:
            e.control.request_stop("enough", ExitCode.STOPPED)

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def veto(e):
        if e.state.step == 2:
            e.control.request_skip()
        seen[("before", e.state.step)] = e.control.decided

    @trainer.on(Events.STEP_END)
    def record(e):
        seen[("end", e.state.step)] = (e.control.decided, e.control.skip, e.control.save)

    state = trainer.run(token_batches(20), max_steps=10)
    assert (state.step, state.control.exit_code, state.control.stop_reason, state.skipped_steps) == (
        3,
        ExitCode.STOPPED,
        "enough",
        1,
    )
    # before the agreement, the previous step's end: nothing decided (no stop)
    assert seen[("before", 2)] == Decided()
    assert seen[("end", 1)] == (Decided(), False, False)
    assert seen[("end", 2)] == (Decided(skip=True, save=True), True, True)
    assert seen[("end", 3)] == (Decided(stop=True, exit_code=ExitCode.STOPPED), False, False)
    assert trainer.control.decided == Decided(stop=True, exit_code=ExitCode.STOPPED)
    # a new run starts with nothing requested or decided
    trainer.state.max_iters = trainer.state.max_epochs = None
    state = trainer.run(token_batches(8), max_steps=2)
    assert (state.step, state.control.exit_code, state.control.stop_reason) == (2, 0, None)


def test_every_way_to_stop_ends_the_run_alike(caplog):
    """A handler's request, terminate() (ignite's spelling of it), and a request outside a step all
    end in the one stop."""
    results = {}
    for how in ("control", "terminate", "epoch_start"):
        trainer = _trainer()

        @trainer.on(Events.STEP_END)
        def stop(e, how=how):
            if e.state.step != 2:
                return
            if how == "control":
                e.control.request_stop("asked", ExitCode.STOPPED)
            elif how == "terminate":
                e.terminate()

        if how == "epoch_start":
            trainer.add_event_handler(
                Events.EPOCH_START(once=2), lambda e: e.control.request_stop("asked", ExitCode.STOPPED)
            )
        caplog.clear()
        with caplog.at_level("INFO", logger="hookloop.engine.trainer"):
            state = trainer.run(token_batches(2), max_epochs=5)  # 2 steps an epoch
        stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping after")]
        results[how] = (state.step, state.control.exit_code, trainer.control.decided.stop, len(stops))
    assert results["control"] == (2, ExitCode.STOPPED, True, 1)
    assert results["terminate"] == (2, 0, True, 1)
    assert results["epoch_start"] == (2, ExitCode.STOPPED, False, 1)  # decided outside a step


def test_nan_detector_and_checkpointer_cooperate_through_the_save_policy(tmp_path):
    from hookloop.handlers import AsyncCheckpointer, NaNDetector
    from hookloop.handlers.nan_detector import NAN_CHECK

    trainer = _trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    save_every(trainer, 2)
    NaNDetector(max_consecutive=2, action="rollback").attach(trainer)
    assert trainer.save_policy.initial_save_wanted  # asked at attach: a step-0 checkpoint to roll back to
    seen, restored = [], []

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP, priority=NAN_CHECK + 1)
    def poison(e):
        if e.state.step in (5, 6) and not restored:  # bad once; after the rollback the steps are fine
            for p in e.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            e.state.loss = torch.tensor(float("nan"))

    @trainer.on(Events.STEP_END)
    def watch(e):
        seen.append((e.state.step, e.save_policy.saves_held, e.save_policy.protected_step))

    trainer.add_event_handler(Events.ROLLBACK, lambda e: restored.append(e.control.rollback), priority=-1)
    trainer.run(token_batches(40), max_steps=8)
    assert (5, True, 4) in seen and (6, True, 4) in seen  # saves held during the bad streak
    assert restored == [Rollback(at_or_before=4, keep_data_position=True)]
    assert trainer.control.rollback is None  # cleared once ROLLBACK has fired
    assert trainer.state.rollbacks == 1 and not trainer.save_policy.saves_held


def test_the_trainer_carries_out_a_rollback_request_after_every_step_end_handler(tmp_path):
    from hookloop.engine import Priority
    from hookloop.handlers import AsyncCheckpointer

    trainer = _trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    save_every(trainer, 2)
    seen = []

    @trainer.on(Events.STEP_END, priority=Priority.OBSERVE)
    def ask(e):  # early at STEP_END: every later handler still sees this step
        if e.state.step == 5 and not e.state.rollbacks:
            e.control.request_rollback(
                4, keep_data_position=True, reason="test", exit_code=ExitCode.NAN_ABORT
            )

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP)
    def late(e):
        seen.append(("step_end", e.state.step, e.control.rollback))

    @trainer.on(Events.ROLLBACK)
    def rolled(e):
        seen.append(("rollback", e.state.step, e.control.decided.rollback, e.control.rollback))

    @trainer.on(Events.STEP_START)
    def started(e):
        seen.append(("step_start", e.state.step, e.control.rollback, e.control.decided))

    trainer.run(token_batches(40), max_steps=7)
    wanted = Rollback(at_or_before=4, keep_data_position=True)
    at = seen.index(("step_end", 5, wanted))  # the last STEP_END handler saw step 5, request pending
    assert seen[at + 1] == ("rollback", 4, wanted, wanted)  # then the trainer fired it: step 4 restored
    assert seen[at + 2] == ("step_start", 5, None, Decided())  # request cleared, nothing decided
    assert [s for s in seen if s[0] == "rollback"] == [seen[at + 1]]  # once
    assert trainer.state.rollbacks == 1 and trainer.state.step == 7 and trainer.control.rollback is None


def test_a_rollback_that_cannot_restore_ends_the_run_with_the_requested_exit_code(tmp_path):
    import pytest

    from hookloop.engine import TrainingAborted
    from hookloop.handlers import AsyncCheckpointer

    trainer = _trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)  # nothing saved
    save_every(trainer, 100)

    @trainer.on(Events.STEP_END)
    def ask(e):
        if e.state.step == 3:
            e.control.request_rollback(2, reason="my check", exit_code=ExitCode.STRAGGLER_ABORT)

    with pytest.raises(TrainingAborted) as info:
        trainer.run(token_batches(40), max_steps=6)
    assert info.value.exit_code == ExitCode.STRAGGLER_ABORT
    assert str(info.value).startswith("step 3: cannot roll back to a checkpoint at or before step 2: ")
    assert str(info.value).endswith("(my check)")
    assert trainer.control.rollback is None and trainer.state.step == 3
