"""``engine.error_path``: EXCEPTION's handled rule, TRAIN_FAILED's cleanup and the handled end's
reason, in-process without a trainer."""

import logging
from types import SimpleNamespace

import pytest

from hookloop.engine import parallel
from hookloop.engine.control import StepControl
from hookloop.engine.error_path import ErrorPath
from hookloop.engine.errors import PeerFailure
from hookloop.engine.events import Events
from hookloop.engine.state import TrainState


class FakeEvents:
    """The registry's two calls the error path makes: ``entries`` and ``fire_entry``."""

    def __init__(self) -> None:
        self.handlers: dict = {Events.EXCEPTION: [], Events.TRAIN_FAILED: []}

    def entries(self, event):
        return [SimpleNamespace(original=f, func=f) for f in self.handlers[event]]

    def fire_entry(self, entry, args=()):
        entry.func(*args)


def make(*, at_limit: bool = False):
    state, control = TrainState(), StepControl()
    state.__dict__["_control"] = control  # bound as a trainer binds its own
    state.iteration, state.epoch, state.max_iters = 3, 1, 3
    events = FakeEvents()
    votes, dropped = [], []
    run_start = SimpleNamespace(fail=votes.append)
    drop = lambda: dropped.append(True)  # noqa: E731
    path = ErrorPath(events, run_start, control, lambda: state, drop, lambda: at_limit)
    return path, events, state, votes, dropped


def test_without_exception_handlers_train_failed_cleans_up_and_the_error_propagates():
    path, events, _, votes, dropped = make()
    cleaned = []
    events.handlers[Events.TRAIN_FAILED].append(cleaned.append)
    error = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        path.on_error(error)
    assert cleaned == [error] and votes == [error] and dropped == []
    with pytest.raises(RuntimeError):  # ignite routes it here again: no second cleanup
        path.on_error(error)
    assert cleaned == [error]


def test_an_exception_handler_handles_the_error_and_the_step_is_dropped():
    path, events, state, _, dropped = make()
    seen = []
    events.handlers[Events.EXCEPTION].append(seen.append)
    state.control.request_validate()
    state.control.request_save()
    path.on_error(ValueError("bad batch"))  # handled: returns
    assert len(seen) == 1 and dropped == [True] and path.handled_errors == 1
    assert not (state.control.validate or state.control.save)  # the step's requests went with it
    assert state.control.stop_reason is None  # not at the run's limit


def test_a_handler_that_re_raises_declines_and_a_failing_cleanup_is_logged(caplog):
    path, events, _, _, _ = make()

    def decline(e):
        raise e

    def broken(e):
        raise OSError("disk full")

    cleaned = []
    events.handlers[Events.EXCEPTION].append(decline)
    events.handlers[Events.TRAIN_FAILED] += [broken, cleaned.append]
    with caplog.at_level(logging.ERROR), pytest.raises(KeyError):
        path.on_error(KeyError("x"))
    assert len(cleaned) == 1  # the next handler still ran; the original error won
    assert "TRAIN_FAILED handler" in caplog.text and "disk full" in caplog.text


def test_a_run_at_its_limit_on_a_handled_error_says_so():
    path, events, state, _, _ = make(at_limit=True)
    events.handlers[Events.EXCEPTION].append(lambda e: None)
    path.on_error(ValueError("bad batch\nmore"))
    reason = "the run ended at max_steps=3 on a handled error: ValueError: bad batch at step 3"
    assert state.control.stop_reason.startswith(reason)
    assert "(1 handled in this run)" in state.control.stop_reason
    path.start_run()
    assert path.handled_errors == 0
    state.control.stop_reason = None
    path.explain_handled_end()  # nothing handled in this run: nothing to explain
    assert state.control.stop_reason is None


def test_a_lost_peer_becomes_a_peer_failure(monkeypatch):
    path, events, _, _, _ = make()
    monkeypatch.setattr(parallel, "is_peer_failure", lambda e: True)
    cleaned = []
    events.handlers[Events.TRAIN_FAILED].append(cleaned.append)
    with pytest.raises(PeerFailure, match="a peer is gone or hung: Connection reset") as raised:
        path.on_error(RuntimeError("Connection reset by peer"))
    assert cleaned == [raised.value]
