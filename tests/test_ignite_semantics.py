"""Where ignite defines a behaviour, the Trainer keeps it: continuing runs, resuming after
``load_state_dict``, ``set_data``, ``state.dataloader``, one-shot iterators, EXCEPTION handlers
that handle the error (and runs that end although every step raises), ``terminate()``, and ignite
metrics and handlers on validation."""

import itertools
import json
import time
import warnings

import pytest
import torch
from ignite.engine import Engine, State
from ignite.engine import Events as IgniteEvents
from ignite.handlers import BasicTimeProfiler, Checkpoint, DiskSaver, EarlyStopping, HandlersTimeProfiler
from ignite.metrics import Loss

from hookloop.engine import Events, Trainer, TrainState
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import validate_every
from tests.conftest import tiny_gpt, token_batches


def make_trainer(accum: int = 1, **kwargs) -> Trainer:
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Trainer(model, opt, cross_entropy_loss, grad_accum_steps=accum, **kwargs)


def test_a_finished_run_continues_when_given_more_epochs():
    trainer = make_trainer()
    data = token_batches(3)
    trainer.run(data, max_epochs=2)
    assert (trainer.state.epoch, trainer.state.step) == (2, 6)
    trainer.run(data, max_epochs=4)
    assert (trainer.state.epoch, trainer.state.step) == (4, 12)
    trainer.run(data)  # finished, no new limit: a new run, one epoch (ignite's default)
    assert (trainer.state.epoch, trainer.state.step) == (1, 3)


def test_a_finished_run_continues_when_given_more_steps():
    trainer = make_trainer()
    data = token_batches(10)
    trainer.run(data, max_steps=4)
    assert trainer.state.step == 4
    trainer.run(data, max_steps=7)
    assert trainer.state.step == 7
    with pytest.raises(
        ValueError, match="Argument max_steps should be greater than or equal to the start iteration"
    ):
        trainer.run(data, max_steps=5)


def test_positional_arguments_mean_what_they_mean_in_ignite():
    trainer = make_trainer()
    trainer.run(token_batches(2), 3)  # max_epochs, as in ignite
    assert (trainer.state.epoch, trainer.state.step) == (3, 6)
    trainer.state.max_epochs = None
    trainer.run(token_batches(8), max_iters=5)  # ignite's name for max_steps
    assert trainer.state.step == 5


def test_run_after_load_state_dict_resumes(tmp_path):
    data = token_batches(4)
    first = make_trainer()
    saver = Checkpoint({"trainer": first}, DiskSaver(str(tmp_path), require_empty=False), n_saved=None)
    first.add_event_handler(Events.STEP_END(every=6), saver)
    first.run(data, max_epochs=3)
    assert first.state.step == 12
    files = {int(p.stem.rsplit("_", 1)[1]): p for p in tmp_path.glob("*.pt")}
    assert sorted(files) == [6, 12]

    second = make_trainer()
    Checkpoint.load_objects({"trainer": second}, torch.load(files[6], weights_only=False))
    steps = []
    second.add_event_handler(Events.STEP_END, lambda e: steps.append((e.state.epoch, e.state.step)))
    second.run(data)
    # ignite re-enters epoch 2 at its 3rd step and runs to max_epochs=3 from the checkpoint
    assert steps[0] == (2, 7)
    assert steps[-1] == (3, 12)


def test_state_dataloader_is_the_users_data_and_set_data_keeps_grouping():
    trainer = make_trainer(accum=2)
    first, second = token_batches(8, seed=1), token_batches(8, seed=2)
    seen = []

    @trainer.on(Events.STEP_START)
    def record(engine):
        assert engine.state.dataloader is first or engine.state.dataloader is second
        seen.append((engine.state.step, engine.state.dataloader is second, len(engine.state.batch)))

    @trainer.on(Events.STEP_END(once=2))
    def switch(engine):
        engine.set_data(second)

    trainer.run(first, max_epochs=1)
    assert seen == [(1, False, 2), (2, False, 2), (3, True, 2), (4, True, 2)]
    # the microbatches after the switch came from the second data set, grouped in pairs
    assert torch.equal(trainer.state.batch[0][0], second[2][0])


def test_reassigning_state_dataloader_like_ignite_users_do():
    trainer = make_trainer()
    first, second = token_batches(2, seed=1), token_batches(3, seed=2)

    @trainer.on(Events.EPOCH_END(once=1))
    def switch(engine):
        engine.state.dataloader = second
        engine.restart_data()

    steps = []
    trainer.add_event_handler(Events.STEP_START, lambda e: steps.append(len(e.state.batch)))
    trainer.run(first, max_epochs=2)
    assert trainer.state.step == 4  # the epoch length stays 2, as in ignite


def test_one_shot_iterator_over_several_epochs_warns_like_ignite():
    trainer = make_trainer()
    data = iter(token_batches(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.run(data, max_epochs=3)
    assert trainer.state.step == 3
    assert trainer.state.epoch == 3
    assert any("can not provide data anymore" in str(w.message) for w in caught)


def test_exception_handler_may_handle_keyboard_interrupt_with_terminate():
    trainer = make_trainer()
    cleaned = []
    trainer.add_event_handler(Events.TRAIN_FAILED, lambda e, err: cleaned.append(err))

    @trainer.on(Events.STEP_END(once=3))
    def interrupt():
        raise KeyboardInterrupt

    @trainer.on(Events.EXCEPTION)
    def handle(engine, e):
        if isinstance(e, KeyboardInterrupt):
            engine.terminate()
        else:
            raise e

    state = trainer.run(token_batches(10), max_epochs=1)
    assert state.step == 3
    assert state.control.stop and "handle" in state.control.stop_reason
    assert cleaned == []  # handled: no failure cleanup


def test_unhandled_errors_run_cleanup_once_and_propagate():
    trainer = make_trainer()
    cleaned = []
    trainer.add_event_handler(Events.TRAIN_FAILED, lambda err: cleaned.append(type(err).__name__))
    trainer.add_event_handler(Events.STEP_END(once=2), lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        trainer.run(token_batches(4))
    assert cleaned == ["ZeroDivisionError"]


def test_terminate_from_a_handler_stops_after_the_step_with_a_reason():
    trainer = make_trainer()
    after = []

    @trainer.on(Events.STEP_START(once=2))
    def stop_early(engine):
        engine.terminate()

    trainer.add_event_handler(Events.STEP_END, lambda e: after.append(e.state.step))
    state = trainer.run(token_batches(6))
    assert state.step == 2 and after == [1, 2]  # the step that asked still completes
    assert state.control.stop_reason.startswith("terminate() called by ")
    assert state.control.stop_reason.endswith("<locals>.stop_early")
    assert state.control.exit_code == 0


def test_ignite_metrics_attach_to_the_validation_evaluator_and_early_stopping_works():
    trainer = make_trainer()
    trainer.set_validation(token_batches(3, seed=7))
    validate_every(trainer, 1)
    Loss(lambda y_pred, y: cross_entropy_loss(y_pred, y)).attach(trainer.evaluator, "ignite_loss")
    # score never improves: EarlyStopping(patience=2) stops after the third validation
    stopper = EarlyStopping(patience=2, score_function=lambda _e: 0.0, trainer=trainer)
    trainer.evaluator.add_event_handler(IgniteEvents.COMPLETED, stopper)
    state = trainer.run(token_batches(20))
    assert state.step == 3
    assert state.metrics["ignite_loss"] == pytest.approx(state.metrics["val_loss"], rel=1e-6)
    assert "EarlyStopping" in state.control.stop_reason


def _terminate_on_one_rank(rank: int, world: int) -> tuple:
    from hookloop.engine import init_distributed

    init_distributed("gloo", timeout_s=60)
    trainer = make_trainer()

    @trainer.on(Events.STEP_END(once=3))
    def stop(engine):
        if rank == 1:
            engine.terminate()

    state = trainer.run(token_batches(10))
    return state.step, state.control.stop_reason


@pytest.mark.distributed
def test_terminate_on_one_rank_stops_every_rank_at_the_same_step():
    from tests.dist_utils import run_distributed

    results = run_distributed(_terminate_on_one_rank, 2)
    assert [step for step, _ in results] == [3, 3]
    assert results[1][1].startswith("terminate() called by")
    assert results[0][1] == f"{results[1][1]} (asked on rank 1)"  # the reason of the rank that asked


def _always_failing(trainer: Trainer, errors: list) -> None:
    """Every step raises in its first microbatch; an EXCEPTION handler handles (swallows) it. A
    runaway run is cut off at its 60th epoch so that a regression fails instead of hanging."""
    trainer.prepare_batch = lambda microbatch, device: 1 / 0
    trainer.add_event_handler(Events.EXCEPTION, lambda err: errors.append(type(err).__name__))
    trainer.add_event_handler(Events.EPOCH_START(once=60), lambda e: e.terminate())


@pytest.mark.parametrize(
    "limits, epochs, steps, limit",
    [
        ({}, 1, 1, "max_epochs=1"),  # ignite's default: one epoch
        ({"max_epochs": 3}, 3, 3, "max_epochs=3"),
        ({"max_steps": 5}, 5, 5, "max_steps=5"),
        ({"max_iters": 5}, 5, 5, "max_steps=5"),
        ({"max_steps": 40, "max_epochs": 2}, 2, 2, "max_epochs=2"),
    ],
)
def test_a_run_whose_every_step_raises_into_a_handling_exception_handler_ends(
    tmp_path, limits, epochs, steps, limit
):
    # As in ignite, a handled error ends its epoch and the loop goes on with the next: the failed
    # step counts, so the run ends at its epoch or step limit, and the state says why.
    trainer = make_trainer(run_dir=tmp_path)
    errors = []
    _always_failing(trainer, errors)
    ended = []
    trainer.add_event_handler(Events.TRAIN_END, lambda e: ended.append(e.control.stop_reason))
    state = trainer.run(token_batches(4), **limits)
    assert (state.epoch, state.step) == (epochs, steps)
    assert errors == ["ZeroDivisionError"] * steps
    assert state.control.exit_code == 0
    assert state.control.stop_reason.startswith(
        f"the run ended at {limit} on a handled error: ZeroDivisionError: division by zero at step {steps} "
    )
    assert ended == [state.control.stop_reason]  # TRAIN_END handlers (loggers) see the reason
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert status["code"] == 0 and status["reason"] == state.control.stop_reason


def test_a_step_that_raised_and_was_handled_leaves_no_gradients_for_the_next():
    trainer = make_trainer(accum=2)
    calls = []

    def prepare(microbatch, device):
        calls.append(1)
        if len(calls) == 2:  # the second microbatch of step 1: after the first one's backward
            raise RuntimeError("bad sample")
        return microbatch

    trainer.prepare_batch = prepare
    trainer.add_event_handler(Events.EXCEPTION, lambda err: None)
    grads_at_step_2 = []
    trainer.add_event_handler(
        Events.STEP_START(once=2),
        lambda e: grads_at_step_2.append([p.grad for p in e.model.parameters() if p.grad is not None]),
    )
    state = trainer.run(token_batches(4), max_epochs=2)
    assert state.step == 3  # step 1 failed (ends epoch 1), epoch 2 ran steps 2 and 3
    assert grads_at_step_2 == [[]]


def test_a_step_limited_run_over_used_up_data_with_handled_errors_ends():
    # One-shot data, every step raising into a handling EXCEPTION handler and only max_steps as a
    # limit: each epoch takes one microbatch until the data is used up; then epochs start no step
    # (ignite would repeat them without end), so the run stops and says why.
    trainer = make_trainer()
    errors = []
    _always_failing(trainer, errors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ignite's "Data iterator can not provide data anymore"
        state = trainer.run(iter(token_batches(3)), max_steps=10)
    assert state.step == 3 and state.epoch < 10
    assert errors[:3] == ["ZeroDivisionError"] * 3
    assert "started no step and only max_steps=10 limits the run" in state.control.stop_reason


def _steps_by_epoch(trainer: Trainer) -> list:
    seen = []
    trainer.add_event_handler(Events.STEP_END, lambda e: seen.append((e.state.epoch, e.state.step)))
    return seen


def test_max_iters_is_the_states_max_iters_and_what_state_dict_saves():
    trainer = make_trainer()
    state = trainer.run(token_batches(4), max_iters=6)
    assert (state.max_iters, state.max_epochs, state.step, state.epoch) == (6, None, 6, 2)
    assert trainer.state_dict() == {"epoch_length": 4, "iteration": 6, "max_iters": 6}
    assert trainer.limits == (6, None)


def test_run_after_load_state_dict_with_max_iters_stops_at_max_iters():
    trainer = make_trainer()
    trainer.load_state_dict({"iteration": 7, "max_iters": 11, "epoch_length": 4})
    seen = _steps_by_epoch(trainer)
    state = trainer.run(token_batches(4))
    # ignite re-enters epoch 2 after its 3rd step and ends at max_iters, mid-epoch 3
    assert seen == [(2, 8), (3, 9), (3, 10), (3, 11)]
    assert (state.step, state.max_iters, state.max_epochs) == (11, 11, None)


def test_a_checkpointed_max_iters_run_resumes_to_its_max_iters(tmp_path):
    data = token_batches(4)
    first = make_trainer()
    saver = Checkpoint({"trainer": first}, DiskSaver(str(tmp_path), require_empty=False), n_saved=None)
    first.add_event_handler(Events.STEP_END(once=5), saver)
    first.run(data, max_iters=9)
    (path,) = tmp_path.glob("*.pt")
    second = make_trainer()
    Checkpoint.load_objects({"trainer": second}, torch.load(path, weights_only=False))
    seen = _steps_by_epoch(second)
    second.add_event_handler(Events.STEP_END(once=30), lambda e: e.terminate())  # a runaway fails
    state = second.run(data)
    assert [step for _, step in seen] == [6, 7, 8, 9]
    assert state.step == 9


def test_max_iters_with_max_epochs_is_rejected_as_in_ignite_but_max_steps_combines():
    trainer = make_trainer()
    with pytest.raises(ValueError, match="Arguments max_iters and max_epochs are mutually exclusive"):
        trainer.run(token_batches(4), max_epochs=2, max_iters=5)
    assert trainer.state.max_epochs is None and trainer.state.step == 0  # nothing ran
    state = trainer.run(token_batches(4), max_epochs=2, max_steps=5)  # whichever comes first
    assert (state.step, state.epoch) == (5, 2)
    state = trainer.run(token_batches(4), max_epochs=2, max_steps=50)
    assert (state.step, state.epoch) == (8, 2)


class _Unsized:
    """A re-iterable data source without a length (an iterable dataset's loader)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_both_limits_hold_when_the_epoch_length_is_learnt_from_the_data():
    # ignite sets max_epochs = ceil(max_iters / epoch_length) when it learns the epoch length;
    # a run given its own, smaller max_epochs keeps it
    trainer = make_trainer()
    state = trainer.run(_Unsized(token_batches(3)), max_steps=100, max_epochs=2)
    assert (state.step, state.epoch, state.epoch_length) == (6, 2, 3)
    state = make_trainer().run(_Unsized(token_batches(3)), max_iters=7)  # ignite's own rule
    assert (state.step, state.epoch, state.max_epochs) == (7, 3, 3)


def test_switching_a_run_between_epoch_and_step_limits_needs_a_reset_as_in_ignite():
    trainer = make_trainer()
    data = token_batches(4)
    trainer.run(data, max_epochs=1)
    for limit in ({"max_iters": 6}, {"max_steps": 6}):
        with pytest.raises(ValueError, match="To switch from max_epochs to max_iters mode during resume"):
            trainer.run(data, **limit)
    trainer.state.max_epochs = None
    assert trainer.run(data, max_iters=6).step == 6
    with pytest.raises(ValueError, match="To switch from max_iters to max_epochs mode during resume"):
        trainer.run(data, max_epochs=3)
    trainer.state.max_iters = None
    assert trainer.run(data, max_epochs=3).step == 12
    with pytest.raises(
        ValueError, match="Argument max_epochs should be greater than or equal to the start epoch"
    ):
        trainer.run(data, max_epochs=2)


def test_continuing_a_run_with_another_epoch_length_is_rejected_as_in_ignite():
    trainer = make_trainer()
    data = token_batches(4)
    trainer.load_state_dict({"iteration": 2, "max_epochs": 3, "epoch_length": 4})
    with pytest.raises(
        ValueError, match="Argument epoch_length should be same as in the state, but given 3 vs 4"
    ):
        trainer.run(data, epoch_length=3)
    state = trainer.run(data, epoch_length=4)  # the same length continues
    assert (state.step, state.epoch) == (12, 3)
    state = trainer.run(data, epoch_length=3)  # a finished run starts afresh, one epoch
    assert (state.step, state.epoch_length) == (3, 3)


def test_a_new_run_on_data_without_a_length_keeps_the_last_epoch_length_as_in_ignite():
    trainer = make_trainer()
    trainer.run(token_batches(4))
    state = trainer.run(iter(token_batches(8)))  # finished: a new run, one epoch of 4 steps
    assert (state.step, state.epoch, state.epoch_length) == (4, 1, 4)


def test_run_without_data_steps_over_none_microbatches_that_prepare_batch_fills():
    # ignite's run(None, epoch_length=N): the step makes its own data
    made = itertools.cycle(token_batches(5))
    trainer = make_trainer(accum=2, prepare_batch=lambda microbatch, device: next(made))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    fetched, microbatches = [], []
    trainer.add_event_handler(IgniteEvents.GET_BATCH_STARTED, lambda: fetched.append(1))
    trainer.add_event_handler(Events.MICROBATCH, lambda e: microbatches.append(e.state.microbatch))
    state = trainer.run(None, epoch_length=3, max_epochs=2)
    assert (state.step, state.epoch, state.epoch_length) == (6, 2, 3)
    assert state.batch == [None, None] and state.dataloader is None
    assert microbatches == [0, 1] * 6 and fetched == []  # as in ignite: no GET_BATCH events
    assert all(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))
    assert state.loss == state.loss  # a real, finite loss
    # continuing, as ignite does, needs no epoch_length: the state has it
    trainer.load_state_dict({"iteration": 4, "max_epochs": 3, "epoch_length": 3})
    assert trainer.run(None).step == 9


def test_run_without_data_with_a_step_start_handler_setting_the_batch():
    trainer = make_trainer()
    made = iter(token_batches(4))

    @trainer.on(Events.STEP_START)
    def make_batch(engine):
        engine.state.batch = [next(made)]  # ignite's idiom: the process function gets state.batch

    assert trainer.run(None, epoch_length=4).step == 4


def test_run_without_data_needs_an_epoch_length_and_a_way_to_make_the_batch():
    trainer = make_trainer()
    with pytest.raises(ValueError, match="epoch_length should be provided if data is None"):
        trainer.run(None)
    with pytest.raises(TypeError, match=r"a microbatch is None.*Trainer\(prepare_batch=fn\)"):
        trainer.run(None, epoch_length=2)


def test_assigning_ignites_plain_state_then_running_works():
    trainer = make_trainer()
    plain = State(alpha=0.5)
    trainer.state = plain
    assert trainer.state is plain and isinstance(plain, TrainState) and plain.alpha == 0.5
    state = trainer.run(token_batches(3))
    assert state is plain and (state.step, state.epoch, state.control.exit_code) == (3, 1, 0)
    assert state.alpha == 0.5 and state.loss == state.loss

    # a state positioned inside a run, as ignite's docs build one, continues that run
    trainer.state = State(iteration=2, epoch_length=4, max_epochs=2)
    seen = _steps_by_epoch(trainer)
    assert trainer.run(token_batches(4)).step == 8
    assert seen[0] == (1, 3)


def test_assigning_a_state_subclass_keeps_its_class_and_other_values_are_refused():
    class MyState(State):
        def twice(self) -> int:
            return 2 * self.iteration

    trainer = make_trainer()
    trainer.state = MyState()
    assert isinstance(trainer.state, MyState) and isinstance(trainer.state, TrainState)
    assert trainer.run(token_batches(2)).twice() == 4
    with pytest.raises(TypeError, match="engine.state must be an ignite State"):
        trainer.state = {"iteration": 0}


def _slow(seconds: float):
    def slow_handler():
        time.sleep(seconds)

    return slow_handler


def test_ignites_basic_time_profiler_times_the_trainers_steps_and_handlers():
    trainer = make_trainer(accum=2)
    slow = _slow(0.01)
    trainer.add_event_handler(Events.STEP_END, slow)
    profiler = BasicTimeProfiler()
    profiler.attach(trainer)
    trainer.run(token_batches(8), max_epochs=2)  # 2 epochs x 4 steps
    results = profiler.get_results()
    processing = results["processing_stats"]
    assert processing["total"] > 0 and processing["min/index"][0] > 0  # every step timed
    assert results["dataflow_stats"]["total"] > 0
    step_end = results["event_handlers_stats"]["ITERATION_COMPLETED"]
    assert step_end["total"] >= 8 * 0.01 and step_end["min/index"][0] >= 0.01
    names = results["event_handlers_names"]["ITERATION_COMPLETED_names"]
    assert any(name.endswith("slow_handler") for name in names)
    # the profiler's own handlers are gone after the run; the trainer's and the user's stay
    assert not trainer.has_event_handler(profiler._as_first_iter_completed)
    assert trainer.has_event_handler(slow, Events.STEP_END)


def test_ignites_handlers_time_profiler_times_each_handler_and_restores_them():
    trainer = make_trainer(accum=2)
    slow, every_second = _slow(0.01), _slow(0.005)
    trainer.add_event_handler(Events.STEP_END, slow)
    trainer.add_event_handler(Events.MICROBATCH(every=2), every_second)  # a custom event, filtered
    profiler = HandlersTimeProfiler()
    profiler.attach(trainer)
    trainer.run(token_batches(8))
    rows = {(row[0], row[1]): row for row in profiler.get_results()}
    (slow_row,) = [
        r for (name, ev), r in rows.items() if name.endswith("slow_handler") and ev == "ITERATION_COMPLETED"
    ]
    assert slow_row[2] >= 4 * 0.01 and slow_row[3][0] >= 0.01  # 4 steps, each timed
    assert any(event == "MICROBATCH" and row[2] >= 4 * 0.005 for (_, event), row in rows.items())
    assert rows[("Processing", "None")][2] > 0 and rows[("Dataflow", "None")][2] > 0
    # after the run every handler is the one attached again: a second run calls them unwrapped
    calls = []
    trainer.add_event_handler(Events.STEP_END, lambda: calls.append(1))
    for entry in trainer.events.entries(Events.STEP_END):
        assert not hasattr(entry.func, "_profiler_original")
    trainer.run(token_batches(8))
    assert calls == [1] * 4 and trainer.has_event_handler(slow, Events.STEP_END)


def _no_handler():
    pass


def _three_args(a, b, c):
    pass


def _load(engine):
    engine.load_state_dict({"iteration": 2, "max_epochs": 3, "epoch_length": 4})


def _finished_epochs(engine):
    engine.run(engine.test_data, max_epochs=2)


def _finished_iters(engine):
    engine.run(engine.test_data, max_iters=3)


def _attached(engine):
    engine.add_event_handler(IgniteEvents.STARTED, _no_handler)


# (what, set-up, the call that fails); each runs on a plain ignite Engine and on a Trainer
ARGUMENT_ERRORS = [
    ("data not iterable", None, lambda e: e.run(42)),
    ("empty data", None, lambda e: e.run([])),
    ("no data, no epoch_length", None, lambda e: e.run(None)),
    ("zero epoch_length", None, lambda e: e.run(e.test_data, epoch_length=0)),
    ("max_iters with max_epochs", None, lambda e: e.run(e.test_data, max_epochs=2, max_iters=3)),
    ("max_epochs below the epoch reached", _finished_epochs, lambda e: e.run(e.test_data, max_epochs=1)),
    ("max_iters below the step reached", _finished_iters, lambda e: e.run(e.test_data, max_iters=2)),
    ("max_epochs of 0 when continuing", _load, lambda e: e.run(e.test_data, max_epochs=0)),
    ("from epochs to iters", _finished_epochs, lambda e: e.run(e.test_data, max_iters=9)),
    ("from iters to epochs", _finished_iters, lambda e: e.run(e.test_data, max_epochs=9)),
    ("another epoch_length", _load, lambda e: e.run(e.test_data, epoch_length=3)),
    ("unknown event", None, lambda e: e.add_event_handler("no_such_event", _no_handler)),
    ("not callable", None, lambda e: e.add_event_handler(IgniteEvents.STARTED, 42)),
    ("wrong signature", None, lambda e: e.add_event_handler(IgniteEvents.STARTED, _three_args)),
    (
        "wrong signature, exception",
        None,
        lambda e: e.add_event_handler(IgniteEvents.EXCEPTION_RAISED, _no_handler),
    ),
    (
        "remove from an unused event",
        None,
        lambda e: e.remove_event_handler(_no_handler, IgniteEvents.COMPLETED),
    ),
    ("remove a stranger", _attached, lambda e: e.remove_event_handler(print, IgniteEvents.STARTED)),
]


def _error_of(engine, setup, call) -> BaseException:
    if setup is not None:
        setup(engine)
    with pytest.raises(Exception) as caught:
        call(engine)
    return caught.value


@pytest.mark.parametrize("what, setup, call", ARGUMENT_ERRORS, ids=[case[0] for case in ARGUMENT_ERRORS])
def test_wrong_arguments_raise_ignites_error_types_with_ignites_messages(what, setup, call):
    ignite_engine = Engine(lambda e, b: None)
    ignite_engine.test_data = [0, 1, 2, 3]
    theirs = _error_of(ignite_engine, setup, call)
    trainer = make_trainer()
    trainer.test_data = token_batches(4)
    ours = _error_of(trainer, setup, call)
    assert isinstance(ours, type(theirs)), (what, ours, theirs)
    # ignite's words first or whole; hookloop may add what to do about it
    assert str(theirs).replace("this Engine", "this Trainer") in str(ours), (what, str(ours))


def test_a_handled_error_outside_the_steps_ends_the_run_as_in_ignite():
    trainer = make_trainer()
    trainer.add_event_handler(Events.EXCEPTION, lambda err: None)
    trainer.add_event_handler(Events.EPOCH_END(once=2), lambda: {}["missing"])
    ended = []
    trainer.add_event_handler(Events.TRAIN_END, lambda: ended.append(1))
    state = trainer.run(token_batches(2), max_epochs=5)
    assert (state.epoch, state.step, ended) == (2, 4, [])  # ignite returns at once: no TRAIN_END
    assert state.control.stop_reason.startswith(
        "the run ended there (an error outside an epoch's steps ends the run)"
    )
    assert "KeyError: 'missing' at step 4 (epoch 2)" in state.control.stop_reason
