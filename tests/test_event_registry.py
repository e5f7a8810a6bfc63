"""The trainer's own event registry: order by priority, filters, removal, firing.

The first four tests reproduce dispatch faults of the registry that kept priorities and ``every=``
gates in dicts keyed by ``id()`` of ignite's handler entries: each fails on that design.
"""

import gc
import weakref

import pytest
import torch
from ignite.engine.events import EventEnum, RemovableEventHandle

from hookloop.engine import Events, Priority, Trainer
from hookloop.handlers import Priority as ShippedPriority
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches


def make_trainer(accum: int = 1) -> Trainer:
    model = tiny_gpt()
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy_loss, grad_accum_steps=accum
    )


def test_priorities_survive_removing_a_handler():
    trainer = make_trainer()
    order = []
    trainer.set_validation(token_batches(2), eval_iters=1, every_steps=1)
    trainer.add_event_handler(Events.VALIDATION_END, lambda: order.append("validation"))

    def doomed():
        order.append("doomed")

    trainer.add_event_handler(Events.STEP_END, doomed)
    trainer.remove_event_handler(doomed, Events.STEP_END)
    # Added after the removal: must still run after validation (priority 1e6) ...
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("p50"), priority=50)
    # ... and before the trainer's own end-of-step, which may end the run.
    trainer.add_event_handler(Events.STEP_END, lambda e: order.append(("late", bool(e.should_terminate))))
    trainer.run(token_batches(2), max_steps=2)
    assert order == ["validation", "p50", ("late", False)] * 2


def test_a_new_handler_never_inherits_a_removed_handlers_filter():
    trainer = make_trainer()

    def filtered():
        pass

    for _ in range(20):  # churn so freed entries and ids get reused
        trainer.add_event_handler(Events.STEP_END(every=3), filtered)
        trainer.remove_event_handler(filtered, Events.STEP_END)
        gc.collect()
    counts = [0] * 10

    def counter(i):
        def count():
            counts[i] += 1

        return count

    for i in range(10):
        trainer.add_event_handler(Events.STEP_END, counter(i))
    trainer.run(token_batches(6), max_steps=6)
    assert counts == [6] * 10


def test_a_callable_argument_is_passed_not_called():
    trainer = make_trainer()
    called, received = [], []

    def marker():
        called.append("marker was called")

    def on_error(error, callback):  # no engine parameter: the callable is its first extra argument
        received.append((type(error).__name__, callback))
        raise error

    def boom():
        raise KeyError("boom")

    trainer.add_event_handler(Events.EXCEPTION, on_error, marker)
    trainer.add_event_handler(Events.STEP_END(once=1), boom)
    try:
        trainer.run(token_batches(2))
    except KeyError:
        pass
    assert called == []
    assert received == [("KeyError", marker)]


def test_a_handler_added_while_an_event_fires_runs_in_that_firing():
    trainer = make_trainer()
    seen = []

    def adder(engine):
        if engine.state.step == 2:
            engine.add_event_handler(Events.STEP_END, lambda e: seen.append(e.state.step), priority=-5)

    trainer.add_event_handler(Events.STEP_END, adder)
    trainer.run(token_batches(4), max_steps=4)
    assert seen == [2, 3, 4]


def test_a_handler_removed_while_an_event_fires_does_not_run_in_it():
    trainer = make_trainer()
    seen = []

    def victim():
        seen.append("victim")

    def remover():
        if trainer.has_event_handler(victim, Events.STEP_END):
            trainer.remove_event_handler(victim, Events.STEP_END)

    trainer.add_event_handler(Events.STEP_END, remover, priority=10)
    trainer.add_event_handler(Events.STEP_END, victim)
    trainer.run(token_batches(3), max_steps=3)
    assert seen == []


def test_handles_remove_exactly_their_registration_and_keep_the_rest_in_order():
    trainer = make_trainer()
    order = []
    h1 = trainer.add_event_handler(Events.STEP_END, lambda: order.append("a"), priority=3)
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("b"), priority=2)
    with trainer.add_event_handler(Events.STEP_END(every=2), lambda: order.append("c"), priority=1):
        trainer.run(token_batches(2), max_steps=2)
    assert order == ["a", "b", "a", "b", "c"]
    h1.remove()
    order.clear()
    trainer.run(token_batches(2), max_steps=2)
    assert order == ["b", "b"]


def test_handles_are_ignites_removable_handles():
    trainer = make_trainer()
    both = Events.STEP_START | Events.STEP_END

    def handler():
        pass

    for event in (Events.STEP_END, Events.STEP_END(every=2), both):
        handle = trainer.add_event_handler(event, handler, priority=5)
        assert isinstance(handle, RemovableEventHandle)
        assert handle.event_name is event
        assert handle.engine() is trainer and handle.handler() is handler
        assert handle.priority == 5
        handle.remove()
        assert not trainer.has_event_handler(handler)
        handle.remove()  # again: nothing left to remove, no error


def test_handles_do_not_keep_the_trainer_or_the_handler_alive():
    def attach() -> tuple:
        trainer = make_trainer()
        return (
            trainer.add_event_handler(Events.STEP_END, lambda: None),
            trainer.add_event_handler(Events.STEP_START | Events.STEP_END(every=2), lambda e: None),
            weakref.ref(trainer),
        )

    plain, listed, trainer = attach()
    gc.collect()
    assert trainer() is None
    for handle in (plain, listed):
        assert handle.engine() is None and handle.handler() is None
        handle.remove()  # the trainer is gone: nothing to do, no error


def test_inserting_by_position_runs_there_whatever_the_neighbours_priorities():
    # what ignite's time profilers do to ignite's handler lists: insert first (before +inf too),
    # append last, insert between equal or different priorities, wrap one in place
    class Custom(EventEnum):
        PING = "ping"

    trainer = make_trainer()
    trainer.register_events(*Custom)
    registry, order = trainer.events, []

    def mark(name):
        return lambda: order.append(name)

    trainer.add_event_handler(Custom.PING, mark("top"), priority=Priority.ENGINE_FIRST)
    trainer.add_event_handler(Custom.PING, mark("high"), priority=5)
    trainer.add_event_handler(Custom.PING, mark("a"))
    trainer.add_event_handler(Custom.PING, mark("b"))
    registry.insert_at(Custom.PING, 0, mark("first"), (), {}, False)
    registry.insert_at(Custom.PING, 5, mark("last"), (), {}, False)
    # now: first, top, high, a, b, last
    registry.insert_at(Custom.PING, 4, mark("a<x<b"), (), {}, False)
    registry.insert_at(Custom.PING, 3, mark("high<y<a"), (), {}, False)
    registry.insert_at(Custom.PING, -1, mark("b<z<last"), (), {}, False)
    registry.replace_entry(registry.entries(Custom.PING)[2], mark("high, wrapped"), (), {}, False)
    trainer.fire(Custom.PING)
    assert order == ["first", "top", "high, wrapped", "high<y<a", "a", "a<x<b", "b", "b<z<last", "last"]


def test_every_filter_groups_and_custom_filters_all_hold():
    trainer = make_trainer(accum=2)
    log = []
    trainer.add_event_handler(Events.STEP_END(every=2), lambda e: log.append(("every2", e.state.step)))
    trainer.add_event_handler(Events.STEP_END(every=2), lambda e: log.append(("every2b", e.state.step)))
    trainer.add_event_handler(Events.STEP_END(every=3), lambda e: log.append(("every3", e.state.step)))
    trainer.add_event_handler(
        Events.STEP_END(event_filter=lambda _e, n: n in (1, 5)),
        lambda e: log.append(("custom", e.state.step)),
    )
    trainer.add_event_handler(Events.MICROBATCH(once=3), lambda e: log.append(("mb3", e.state.step)))
    trainer.run(token_batches(12), max_steps=6)
    assert log == [
        ("custom", 1),
        ("mb3", 2),
        ("every2", 2),
        ("every2b", 2),
        ("every3", 3),
        ("every2", 4),
        ("every2b", 4),
        ("custom", 5),
        ("every2", 6),
        ("every2b", 6),
        ("every3", 6),
    ]


def test_priority_table_orders_the_engine_around_users():
    phases = ["ENGINE_FIRST", "CLOCK", "RESTORE", "OBSERVE", "DECIDE", "ACT", "DEFAULT", "RECORD", "CLEANUP"]
    values = [getattr(Priority, name) for name in [*phases, "ENGINE_LAST"]]
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    assert Priority.VALIDATION == Priority.OBSERVE  # the trainer's own place among the observers
    shipped = ShippedPriority
    assert shipped.ENGINE_FIRST > shipped.RESUME > shipped.VALIDATION > shipped.CHECKPOINT
    assert shipped.CHECKPOINT > shipped.DEFAULT > shipped.LOG_JSONL > shipped.ROLLBACK_REQUEST
    assert shipped.ROLLBACK_REQUEST > shipped.ENGINE_LAST


def test_each_shipped_place_keeps_its_value_outside_the_engine_table():
    """The shipped handlers' places are the numbers they always were (user code and old tests pick
    places relative to them); each handler module defines its own from a phase, and the engine's
    table names none of them."""
    expected = {
        "PROFILE": 4e9, "TIME": 3e9, "TIME_STRAGGLER": 2e9, "RESUME": 1e9, "HEALTH": 5e6,
        "EXIT_CHECK": 2e6, "PUBLISH": 1.5e6, "ALIGN_PHASE": 1e6, "PHASE": 9e5, "DATASET_METRICS": 1e5,
        "DATASET_METRICS_END": 1001, "SCHEDULE": 1e3, "TRACK_END": 1000, "STRAGGLER": 500,
        "NAN_CHECK": 100, "CHECKPOINT": 10, "TRACK": -100, "LOG_JSONL": -1000, "LOG_TENSORBOARD": -1001,
        "LOG_WANDB": -1002, "LOG_CONSOLE": -1003, "LOG": -1500, "ROLLBACK_REQUEST": -2000,
        "ALIGN_AFTER_RESTORE": -1e6, "STAGING_WAIT": -1e9, "PROFILE_END": -1e12,
    }  # fmt: skip
    for name, value in expected.items():
        assert getattr(ShippedPriority, name) == value, name
        assert not hasattr(Priority, name), f"the engine's table names a shipped handler's place: {name}"
    with pytest.raises(AttributeError, match=r"hookloop\.handlers\.Priority"):
        Priority.CHECKPOINT  # noqa: B018 -- the lookup itself is what is tested


def test_bad_priorities_and_handlers_are_refused():
    trainer = make_trainer()
    import pytest

    with pytest.raises(TypeError, match="priority"):
        trainer.add_event_handler(Events.STEP_END, lambda: None, priority="high")
    with pytest.raises(TypeError, match="callable"):
        trainer.add_event_handler(Events.STEP_END, 42)
    with pytest.raises(ValueError, match=r"Error adding .+ takes parameters .+ but will be called with"):
        trainer.add_event_handler(Events.STEP_END, lambda a, b, c: None)
