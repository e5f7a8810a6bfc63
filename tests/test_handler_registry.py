"""``engine.handler_registry``: attached handlers and checkpoint keys, without a trainer."""

import pytest

from hookloop.engine.handler_registry import HandlerRegistry


class Counter:
    def __init__(self, key=None) -> None:
        self.state_key = key

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class Special(Counter): ...


class Reader:  # no state: registered, never checkpointed
    pass


def test_handlers_are_found_by_type_or_key_and_stateful_ones_are_checkpointed():
    registry = HandlerRegistry()
    counter, reader, special = Counter(), Reader(), Special("special")
    for handler in (counter, reader, special, counter):
        registry.register(handler)
    assert registry.handlers == (counter, reader, special)  # attach order, once each
    assert registry.stateful == {"Counter": counter, "special": special}
    assert registry.get(Counter) is counter and registry.get(Special) is special
    assert registry.get("special") is special and registry.get("Reader") is reader
    assert registry.get(int, default="none") == "none"
    registry.stateful.clear()  # a copy
    assert len(registry.stateful) == 2


def test_a_key_is_an_identity():
    registry = HandlerRegistry()
    registry.register(Counter(), key="mine")
    with pytest.raises(ValueError, match="'mine' is already registered by Counter; give Special"):
        registry.register(Special(), key="mine")
    with pytest.raises(TypeError, match="Reader needs state_dict"):
        registry.register_stateful("reader", Reader())
    unsaved = Counter()
    unsaved.checkpointed = False
    registry.register(unsaved, key="unsaved")
    assert "unsaved" not in registry.stateful and unsaved in registry.handlers
