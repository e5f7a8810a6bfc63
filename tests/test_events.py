"""Event order, filters and priorities on a real (tiny) training run."""

import pytest
import torch
from ignite.engine import Events as IgniteEvents

from hookloop.engine import Events, Trainer
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches

ALL = [
    "TRAIN_START",
    "EPOCH_START",
    "STEP_START",
    "MICROBATCH",
    "BEFORE_OPTIMIZER_STEP",
    "STEP_END",
    "EPOCH_END",
    "TRAIN_END",
]


def make_trainer(accum: int = 2) -> Trainer:
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, opt, cross_entropy_loss, grad_accum_steps=accum)


def test_event_order_3_steps_x_2_microbatches():
    trainer = make_trainer(accum=2)
    log = []
    for name in ALL:
        trainer.add_event_handler(
            getattr(Events, name), lambda e, name=name: log.append((name, e.state.step, e.state.microbatch))
        )
    trainer.run(token_batches(6), max_epochs=1)
    expected = [("TRAIN_START", 0, 0), ("EPOCH_START", 0, 0)]
    for step in (1, 2, 3):
        expected += [("STEP_START", step, 0 if step == 1 else 1)]
        expected += [("MICROBATCH", step, 0), ("MICROBATCH", step, 1)]
        expected += [("BEFORE_OPTIMIZER_STEP", step, 1), ("STEP_END", step, 1)]
    expected += [("EPOCH_END", 3, 1), ("TRAIN_END", 3, 1)]
    assert log == expected


def test_aliases_do_not_fire_twice():
    assert Events.STEP_END is IgniteEvents.ITERATION_COMPLETED
    assert Events.TRAIN_START is IgniteEvents.STARTED
    assert Events.EXCEPTION is IgniteEvents.EXCEPTION_RAISED
    trainer = make_trainer(accum=1)
    seen = []
    trainer.add_event_handler(Events.STEP_END, lambda: seen.append("ours"))
    trainer.add_event_handler(IgniteEvents.ITERATION_COMPLETED, lambda: seen.append("ignite"))
    trainer.run(token_batches(2))
    assert seen == ["ours", "ignite", "ours", "ignite"]


def test_filters_on_builtin_and_custom_events():
    trainer = make_trainer(accum=2)
    every, once, custom, mb = [], [], [], []
    trainer.add_event_handler(Events.STEP_END(every=2), lambda e: every.append(e.state.step))
    trainer.add_event_handler(Events.STEP_START(once=3), lambda e: once.append(e.state.step))
    trainer.add_event_handler(
        Events.BEFORE_OPTIMIZER_STEP(event_filter=lambda _, s: s % 3 == 0),
        lambda e: custom.append(e.state.step),
    )
    trainer.add_event_handler(Events.MICROBATCH(every=3), lambda e: mb.append(e.state.microbatches_seen))
    trainer.run(token_batches(12), max_epochs=1)
    assert every == [2, 4, 6]
    assert once == [3]
    assert custom == [3, 6]
    assert mb == [3, 6, 9, 12]


def test_priority_orders_handlers_and_ties_keep_attach_order():
    trainer = make_trainer(accum=1)
    order = []
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("a0"))
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("low"), priority=-5)
    trainer.add_event_handler(Events.STEP_END, lambda: order.append("b0"))

    @trainer.on(Events.STEP_END, priority=10)
    def first():
        order.append("high")

    trainer.add_event_handler(Events.STEP_END(every=1), lambda: order.append("high2"), priority=10)
    trainer.run(token_batches(1))
    assert order == ["high", "high2", "a0", "b0", "low"]


def test_removable_handle_and_events_list():
    trainer = make_trainer(accum=1)
    seen = []
    handle = trainer.add_event_handler(
        Events.STEP_START | Events.STEP_END, lambda: seen.append(1), priority=3
    )
    handle.remove()
    trainer.run(token_batches(2))
    assert seen == []


def test_unknown_event_is_rejected():
    trainer = make_trainer()
    with pytest.raises(ValueError, match="not a valid event"):
        trainer.add_event_handler("no_such_event", lambda: None)


def test_every_filters_interleaved_with_plain_handlers_keep_order():
    trainer = make_trainer(accum=1)
    log = []
    trainer.add_event_handler(Events.STEP_END(every=2), lambda e: log.append(("e2", e.state.step)))
    trainer.add_event_handler(Events.STEP_END, lambda e: log.append(("plain", e.state.step)))
    trainer.add_event_handler(Events.STEP_END(every=2), lambda e: log.append(("e2b", e.state.step)))
    trainer.add_event_handler(
        Events.STEP_END(every=3), lambda e: log.append(("e3", e.state.step)), priority=1
    )
    handle = trainer.add_event_handler(Events.STEP_END(every=2), lambda e: log.append(("gone", e.state.step)))
    handle.remove()
    trainer.run(token_batches(6))
    expected = []
    for step in range(1, 7):
        if step % 3 == 0:
            expected.append(("e3", step))
        if step % 2 == 0:
            expected.append(("e2", step))
        expected.append(("plain", step))
        if step % 2 == 0:
            expected.append(("e2b", step))
    assert log == expected
