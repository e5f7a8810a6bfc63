"""``engine.step_decisions``: the step's agreement and its end, in one process without a trainer."""

from types import SimpleNamespace

import pytest
import torch

from hookloop.engine import parallel
from hookloop.engine.agreement import StepAgreement
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.control import StepControl
from hookloop.engine.errors import TrainingAborted
from hookloop.engine.events import Events
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler import Handler
from hookloop.engine.state import TrainState
from hookloop.engine.step_decisions import StepDecisions
from tests.dist_utils import run_distributed


class FakeEvents:
    def __init__(self) -> None:
        self.handlers: dict = {}

    def entries(self, event):
        return [SimpleNamespace(original=f) for f in self.handlers.get(event, [])]


class Owner:
    def own_step_end(self) -> None: ...


def make(*, due: bool = False, fire=None):
    control = StepControl()
    state = TrainState()
    state.__dict__["_control"] = control  # bound as a trainer binds its own
    state.iteration = 4
    events, fired, owner = FakeEvents(), [], Owner()
    decisions = StepDecisions(
        control, StepAgreement(), lambda: state, events, fire or fired.append, lambda: due, owner
    )
    return decisions, control, state, events, fired, owner


def test_the_agreement_turns_requests_into_decisions_and_counts_the_step():
    decisions, control, state, _, _, _ = make()
    agreed = []
    decisions._agreement.add("test.vote", fill=lambda: torch.tensor(2.0), on_agreed=agreed.append)
    control.request_skip()
    control.request_save()
    state.step_tokens = 12  # one process: the trainer set this rank's values, the agreement counts them
    decisions.agree(torch.tensor(1.5), torch.tensor(0.5), 12, 3, None)
    assert control.decided.skip and control.decided.save and not control.decided.stop
    assert agreed == [2.0]
    assert (state.tokens_seen, state.samples_seen, state.grad_scaler_overflow) == (12, 3, False)
    assert decisions.late is False  # nothing could ask after it


def test_an_overflow_skips_and_a_stop_is_decided_with_its_exit_code():
    decisions, control, state, _, _, _ = make()
    control.request_stop("enough", ExitCode.STOPPED)
    decisions.agree(torch.tensor(1.0), torch.tensor(float("inf")), 0, 1, torch.tensor(True))
    assert state.grad_scaler_overflow and control.decided.skip
    assert control.decided.stop and control.decided.exit_code == ExitCode.STOPPED
    assert decisions.end_step() is True


def test_who_could_ask_late():
    decisions, _, _, events, _, owner = make()
    assert not decisions.late_requests_possible()
    events.handlers[Events.STEP_END] = [owner.own_step_end]  # the trainer's own
    quiet = type("Quiet", (), {"asks_after_agreement": False, "on_step_end": lambda self: None})()
    events.handlers[Events.STEP_END].append(quiet.on_step_end)  # says it never asks late
    assert not decisions.late_requests_possible()
    events.handlers[Events.VALIDATION_END] = [lambda: None]  # a user's function may ask
    assert decisions.late_requests_possible()


def test_a_validation_vote_is_decided_in_the_agreement_and_makes_the_end_late():
    decisions, control, _, _, _, _ = make(due=True)  # this rank votes (asked, or on the cadence)
    assert not decisions.late_requests_possible()  # nothing registered that could ask late
    decisions.agree(torch.tensor(1.0), torch.tensor(1.0), 0, 1, None)
    assert control.decided.validate and decisions.late  # its VALIDATION_END handlers may ask
    decisions.end_step()
    assert not control.validate and not control.decided.validate  # reset with the step


def test_a_validation_withdrawn_from_agreed_values_is_not_decided():
    decisions, control, _, _, _, _ = make(due=True)
    decisions._agreement.add("test.stop", fill=lambda: 1, on_agreed=lambda n: control.withdraw_validate())
    decisions.agree(torch.tensor(1.0), torch.tensor(1.0), 0, 1, None)
    assert not control.decided.validate and not decisions.late


def test_a_validation_asked_after_the_agreement_carries_over_to_the_next_step():
    decisions, control, _, _, _, _ = make()
    decisions.agree(torch.tensor(1.0), torch.tensor(1.0), 0, 1, None)
    control.request_validate()  # e.g. a STEP_END handler: too late for this step's agreement
    assert not control.decided.validate
    decisions.end_step()
    assert control.validate  # still asked: the next step's agreement decides it


class Silent(Handler):  # says nothing about asking late
    def on_step_end(self) -> None: ...


class Asks(Handler):
    asks_after_agreement = True

    def on_step_end(self) -> None: ...


class Quiet(Handler):
    asks_after_agreement = False

    def on_step_end(self) -> None: ...


def test_a_handler_after_the_agreement_asks_for_the_next_step_unless_it_opts_in():
    decisions, _, _, events, _, _ = make()
    events.handlers[Events.STEP_END] = [Quiet().on_step_end]
    decisions.start_run()
    assert not decisions.late_requests_possible()  # False: no second all-reduce
    events.handlers[Events.ROLLBACK] = [Silent().on_step_end]
    decisions.start_run()  # a Handler that says nothing starts, and costs nothing
    assert not decisions.late_requests_possible()
    events.handlers[Events.ROLLBACK] = [Asks().on_step_end]
    decisions.start_run()
    assert decisions.late_requests_possible()  # True: it costs the late all-reduce, by its own word

    def said_false() -> None: ...

    said_false.asks_after_agreement = False  # a function may say so too
    events.handlers = {Events.STEP_END: [said_false]}
    assert not decisions.late_requests_possible()
    events.handlers = {Events.STEP_END: [lambda: None]}  # one that does not say counts as asking
    assert decisions.late_requests_possible()


class StopAt(Handler):
    """Asks for a stop from ``on_step_end`` (attached by its name) at step ``at`` on rank ``rank``."""

    def __init__(self, at: int, rank: int = 0) -> None:
        self.at, self.rank, self.seen = at, rank, []

    def on_step_end(self, trainer) -> None:
        self.seen.append(trainer.state.step)
        if trainer.state.step == self.at and parallel.rank() == self.rank:
            trainer.control.request_stop("stop at")


class ExactStopAt(StopAt):
    asks_after_agreement = True  # the opt-in: stop after this very step (the late all-reduce)


def _stopped_after(handler_type, rank: int = 0) -> tuple[int, list[int]]:
    from hookloop.engine.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    handler = handler_type(2, rank).attach(trainer)
    x = torch.randn(8, 4)
    return trainer.run([(x, x.sum(1, keepdim=True))] * 10, max_steps=10).step, handler.seen


def test_on_event_methods_attach_themselves_and_a_late_stop_is_agreed_at_the_next_step():
    assert _stopped_after(StopAt) == (3, [1, 2, 3])  # asked at step 2's end, agreed at step 3
    assert _stopped_after(ExactStopAt) == (2, [1, 2])  # the opt-in: after step 2


def test_an_on_event_method_its_attach_adds_itself_is_attached_once():
    from hookloop.engine.trainer import Trainer

    class Attaching(StopAt):
        def attach(self, trainer):
            trainer.add_event_handler(Events.STEP_END(every=2), self.on_step_end)
            return super().attach(trainer)

    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    handler = Attaching(99).attach(trainer)
    trainer.run([(torch.randn(8, 4), torch.randn(8, 1))] * 4, max_steps=4)
    assert handler.seen == [2, 4] and trainer.get_handler(Attaching) is handler


def _stop_on_rank_one(rank: int, world: int) -> dict:
    from hookloop.engine import init_distributed

    init_distributed()
    return {kind.__name__: _stopped_after(kind, rank=1)[0] for kind in (StopAt, ExactStopAt)}


@pytest.mark.distributed
def test_a_stop_one_rank_asks_for_at_step_end_stops_every_rank_at_the_same_step():
    r0, r1 = run_distributed(_stop_on_rank_one, 2)
    assert r0 == r1 == {"StopAt": 3, "ExactStopAt": 2}


def test_a_stop_asked_after_the_agreement_is_agreed_at_the_end_only_when_late():
    decisions, control, state, _, _, _ = make()
    decisions.agree(torch.tensor(1.0), torch.tensor(1.0), 0, 1, None)
    control.request_stop("late")
    assert decisions.end_step() is False  # no late agreement: the next step's agreement takes it
    decisions.late = True
    assert decisions.end_step() is True and control.decided.stop


def test_an_agreed_rollback_fires_rollback_and_a_failed_restore_aborts():
    decisions, control, _, _, fired, _ = make()
    control.request_rollback(2, reason="test")
    decisions.late = True
    assert decisions.end_step() is False
    assert fired == [Events.ROLLBACK] and control.decided.rollback is None  # the step's end reset it

    def no_checkpoint(event):
        raise CheckpointError("nothing to restore")

    decisions, control, _, _, _, _ = make(fire=no_checkpoint)
    control.request_rollback(2, reason="test", exit_code=76)
    decisions.late = True
    with pytest.raises(TrainingAborted, match="step 4: cannot roll back.*at or before step 2.*test"):
        decisions.end_step()
