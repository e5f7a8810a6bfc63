"""The trainer's own event registry: order by priority, filters, removal, firing.

The first four tests reproduce dispatch faults of the registry that kept priorities and ``every=``
gates in dicts keyed by ``id()`` of ignite's handler entries: each fails on that design.
"""

import copy
import gc
import pickle
import weakref

import pytest
import torch
from ignite.engine.events import EventEnum, RemovableEventHandle

from hookloop.engine import Events, Place, PlaceError, Priority, Trainer
from hookloop.engine.events import ORDER_LIMIT, PHASES
from hookloop.handlers import Places
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import validate_every
from tests.conftest import tiny_gpt, token_batches


def make_trainer(accum: int = 1) -> Trainer:
    model = tiny_gpt()
    return Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy_loss, grad_accum_steps=accum
    )


def test_priorities_survive_removing_a_handler():
    trainer = make_trainer()
    order = []
    trainer.set_validation(token_batches(2), eval_iters=1)
    validate_every(trainer, 1)
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
    assert list(PHASES) == [*phases, "ENGINE_LAST"]
    values = [getattr(Priority, name) for name in PHASES]
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values)
    assert all(isinstance(v, Place) and v.order == 0 for v in values)
    assert Priority.VALIDATION == Priority.OBSERVE  # the trainer's own place among the observers
    assert Priority.ENGINE_FIRST > Places.RESUME > Priority.VALIDATION > Places.CHECKPOINT
    assert Places.CHECKPOINT > Priority.DEFAULT > Places.LOG_JSONL > Places.ROLLBACK_REQUEST
    assert Places.ROLLBACK_REQUEST > Priority.ENGINE_LAST
    import hookloop
    import hookloop.handlers

    assert hookloop.Priority is Priority is hookloop.handlers.Priority  # one Priority, one object


#: Every shipped place: (phase, order). The order inside a phase is what docs/concepts.md shows.
SHIPPED = {
    "PROFILE": ("CLOCK", 900),
    "ROLLBACK_COUNT": ("CLOCK", 900),
    "TIME": ("CLOCK", 0),
    "TIME_STRAGGLER": ("CLOCK", -100),
    "RESUME": ("RESTORE", 0),
    "HEALTH": ("OBSERVE", 400),
    "EXIT_CHECK": ("OBSERVE", 100),
    "PUBLISH": ("OBSERVE", 50),
    "ALIGN_PHASE": ("OBSERVE", 0),
    "PHASE": ("OBSERVE", -100),
    "DATASET_METRICS": ("OBSERVE", -900),
    "DATASET_METRICS_END": ("DECIDE", 1),
    "SCHEDULE": ("DECIDE", 0),
    "TRACK_END": ("DECIDE", 0),
    "STRAGGLER": ("DECIDE", -500),
    "NAN_CHECK": ("DECIDE", -900),
    "CHECKPOINT": ("ACT", 0),
    "TRACK": ("DEFAULT", -100),
    "ALIGN_AFTER_RESTORE": ("DEFAULT", -900),
    "LOG_JSONL": ("RECORD", 0),
    "LOG_TENSORBOARD": ("RECORD", -1),
    "LOG_WANDB": ("RECORD", -2),
    "LOG_CONSOLE": ("RECORD", -3),
    "LOG": ("RECORD", -500),
    "ROLLBACK_REQUEST": ("RECORD", -900),
    "STAGING_WAIT": ("CLEANUP", 0),
    "CAPTURE": ("CLEANUP", 0),
    "PROFILE_END": ("CLEANUP", -900),
    "ROLLBACK_DONE": ("CLEANUP", -900),
}

#: The order the shipped handlers have always run in, event by event (docs/concepts.md's table).
SHIPPED_ORDER = {
    "STEP_START": ["PROFILE", "TIME", "TIME_STRAGGLER", "RESUME", "PHASE", "SCHEDULE"],
    "STEP_END": [
        "TIME",
        "TIME_STRAGGLER",
        "HEALTH",
        "EXIT_CHECK",
        "PUBLISH",
        "VALIDATION",
        "PHASE",
        "DATASET_METRICS",
        "STRAGGLER",
        "CHECKPOINT",
        "DEFAULT",
        "LOG_JSONL",
        "LOG_TENSORBOARD",
        "LOG_WANDB",
        "LOG_CONSOLE",
        "LOG",
        "ROLLBACK_REQUEST",
        "CAPTURE",
        "PROFILE_END",
    ],
    "TRAIN_START": [
        "RESUME",
        "ALIGN_PHASE",
        "DATASET_METRICS",
        "SCHEDULE",
        "DEFAULT",
        "TRACK",
        "LOG_JSONL",
        "LOG",
    ],
    "BEFORE_OPTIMIZER_STEP": ["NAN_CHECK", "DEFAULT", "STAGING_WAIT"],
    "ROLLBACK": ["ROLLBACK_COUNT", "TIME", "RESUME", "TRACK", "ALIGN_AFTER_RESTORE", "ROLLBACK_DONE"],
    "TRAIN_END": [
        "RESUME",
        "EXIT_CHECK",
        "DATASET_METRICS_END",
        "TRACK_END",
        "LOG_JSONL",
        "LOG",
        "PROFILE_END",
    ],
}


def test_every_shipped_place_lies_inside_its_phase():
    """Each shipped handler's place is a phase and an order strictly inside that phase's room: above
    every place the next phase can hold and below every place the previous one can."""
    shipped = {k for k in vars(Places) if not k.startswith("_")}
    assert set(SHIPPED) <= shipped  # these keep their phase and order; a new handler's join Places
    for name, (phase, order) in SHIPPED.items():
        place = getattr(Places, name)
        assert isinstance(place, Place) and (place.phase, place.order) == (phase, order), name
    for name in shipped:
        place = getattr(Places, name)
        phase = place.phase
        assert not hasattr(Priority, name), f"the engine's table names a shipped handler's place: {name}"
        i = PHASES.index(phase)
        earlier, later = float(getattr(Priority, PHASES[i - 1])), float(getattr(Priority, PHASES[i + 1]))
        assert later + ORDER_LIMIT < place < earlier - ORDER_LIMIT, f"{name} = {place!r} leaves {phase}"
    for event, names in SHIPPED_ORDER.items():
        places = [getattr(Places, n, None) or getattr(Priority, n) for n in names]
        assert places == sorted(places, reverse=True), event
        assert len(set(places)) == len(places), f"{event}: two shipped places tie"
    with pytest.raises(AttributeError, match=r"named by the handlers package \(hookloop\.handlers\)"):
        Priority.CHECKPOINT  # noqa: B018 -- the lookup itself is what is tested


def test_a_place_cannot_leave_its_phase():
    assert (Priority.ACT + 1).phase == "ACT" and (Priority.ACT + 1).order == 1
    assert Priority.DECIDE - 999 > Priority.ACT + 999 > Priority.ACT + 1 > Priority.ACT > Priority.ACT - 999
    assert Priority.ACT - 999 > Priority.DEFAULT + 999
    assert (
        repr(Places.CHECKPOINT + 1) == "Priority.ACT + 1"
        and repr(Priority.RECORD - 0.5) == "Priority.RECORD - 0.5"
    )
    with pytest.raises(PlaceError, match=r"leaves the ACT phase.*-1000 and \+1000.*DECIDE - n.*DEFAULT \+ n"):
        Priority.ACT + 1e9  # noqa: B018
    with pytest.raises(PlaceError, match="leaves the ACT phase"):
        Places.CHECKPOINT - 1000  # noqa: B018
    with pytest.raises(PlaceError, match="leaves the CLOCK phase.*nothing but the trainer runs before CLOCK"):
        Priority.CLOCK + 1000  # noqa: B018
    with pytest.raises(PlaceError, match=r"ENGINE_FIRST is the trainer's own place.*Priority.CLOCK \+ n"):
        Priority.ENGINE_FIRST + 1  # noqa: B018
    with pytest.raises(TypeError, match="not another place"):
        Priority.ACT + Priority.DEFAULT  # noqa: B018
    with pytest.raises(ValueError, match="not a phase"):
        Place("SOMETIME")
    for place in (Priority.ACT - 3.5, Priority.ENGINE_LAST):
        assert pickle.loads(pickle.dumps(place)) == place and copy.deepcopy(place).phase == place.phase


def test_a_plain_number_is_an_order_inside_default():
    trainer = make_trainer()
    handle = trainer.add_event_handler(Events.STEP_END, lambda: None, priority=5)
    assert handle.priority == Priority.DEFAULT + 5 and handle.priority.phase == "DEFAULT"
    before = trainer.events.entries(Events.STEP_END)
    for number in (5000, 1e6, -1e9, float("inf")):
        with pytest.raises(PlaceError, match=rf"priority={number!r} .*leaves the DEFAULT phase.*ACT - n"):
            trainer.add_event_handler(Events.STEP_END, lambda: None, priority=number)
    assert trainer.events.entries(Events.STEP_END) == before  # nothing was attached
    # A place keeps its phase: ACT + 1 runs before every plain number, RECORD + 1 after every one.
    order = []
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("999"), priority=999)
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("act"), priority=Priority.ACT - 999)
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("-999"), priority=-999)
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("record"), priority=Priority.RECORD + 999)
    trainer.run(token_batches(1), max_steps=1)
    assert order == ["act", "999", "-999", "record"]


def test_bad_priorities_and_handlers_are_refused():
    trainer = make_trainer()
    import pytest

    with pytest.raises(TypeError, match="priority"):
        trainer.add_event_handler(Events.STEP_END, lambda: None, priority="high")
    with pytest.raises(TypeError, match="callable"):
        trainer.add_event_handler(Events.STEP_END, 42)
    with pytest.raises(ValueError, match=r"Error adding .+ takes parameters .+ but will be called with"):
        trainer.add_event_handler(Events.STEP_END, lambda a, b, c: None)


# ------------------------------------------------------------------------------ describe


class Saver:
    def save(self) -> None: ...


def logged(tag: str) -> None: ...


def test_describe_prints_every_events_handlers_in_run_order_with_their_places():
    """``trainer.describe()`` is the order the registry fires: events as the loop fires them,
    handlers by place (ties in attach order), each named and placed; attach order does not matter."""
    import functools

    model = torch.nn.Linear(2, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)

    @functools.wraps(logged)
    def timed(*args) -> None: ...

    trainer.add_event_handler(Events.TRAIN_END, Saver().save, priority=Priority.RESTORE)
    every_10 = Events.STEP_END(every=10)
    trainer.add_event_handler(every_10, functools.partial(logged, "x"), priority=Priority.RECORD - 3)
    trainer.add_event_handler(Events.STEP_END, Saver().save, priority=Places.CHECKPOINT + 1)
    trainer.add_event_handler(Events.STEP_START(once=2), timed)
    trainer.add_event_handler(Events.STEP_END, lambda: None, priority=5)
    assert trainer.describe().splitlines() == [
        "TRAIN_START",
        "  ENGINE_FIRST  Trainer._on_train_start",
        "  ENGINE_LAST   Trainer._agree_start",
        "EPOCH_START",
        "  ENGINE_LAST   Trainer._start_epoch",
        "STEP_START",
        "  DEFAULT       logged (filtered)",
        "STEP_END",
        "  OBSERVE       Trainer._maybe_validate",
        "  ACT + 1       Saver.save",
        "  DEFAULT + 5   test_describe_prints_every_events_handlers_in_run_order_with_their_places.<lambda>",
        "  RECORD - 3    logged (every 10)",
        "  ENGINE_LAST   Trainer._end_step",
        "EPOCH_END",
        "  ENGINE_LAST   Trainer._end_epoch",
        "TRAIN_END",
        "  RESTORE       Saver.save",
    ]
    assert trainer.describe() == trainer.events.describe()
