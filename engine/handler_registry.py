"""The trainer's registry of attached handlers and of what every checkpoint holds.

A handler registers itself when it attaches (:meth:`engine.Handler.attach` calls
``trainer.register_handler(self)``); a stateful one (``state_dict`` / ``load_state_dict``) is then
saved in and restored from every checkpoint under its key, without anyone listing it::

    trainer.register_handler(handler)            # found by get_handler(type or key)
        stateful and handler.checkpointed:       #   (checkpointed: True unless the handler says)
            register_stateful(key or handler_state_key(handler), handler)
    trainer.register_stateful("grad_scaler", s)  # any object with state_dict / load_state_dict
    trainer.stateful                             # key -> object: what a checkpoint holds

A key is an identity (Lightning's ``state_key``): two different objects claiming one key is an
error naming both, never a silent overwrite of one's checkpoint state by the other's.
"""

from __future__ import annotations

from typing import Any, TypeVar

from hookloop.engine.handler import handler_state_key, is_stateful

__all__ = ["HandlerRegistry"]

H = TypeVar("H")


class HandlerRegistry:
    """The attached handlers (in attach order) and the stateful objects by checkpoint key; the
    trainer's methods of the same names (``trainer.register_handler``, ...) say what each does."""

    def __init__(self) -> None:
        self._handlers: list[Any] = []
        self._stateful: dict[str, Any] = {}

    def register(self, handler: Any, key: str | None = None) -> None:
        if handler not in self._handlers:
            self._handlers.append(handler)
        if is_stateful(handler) and getattr(handler, "checkpointed", True):
            self.register_stateful(key or handler_state_key(handler), handler)

    def register_stateful(self, key: str, obj: Any) -> None:
        if not is_stateful(obj):
            raise TypeError(f"{type(obj).__name__} needs state_dict() and load_state_dict() to be registered")
        held = self._stateful.get(key)
        if held is not None and held is not obj:
            raise ValueError(
                f"state key {key!r} is already registered by {type(held).__name__}; give "
                f"{type(obj).__name__} another state_key so its checkpoint state does not overwrite it"
            )
        self._stateful[key] = obj

    @property
    def stateful(self) -> dict[str, Any]:
        return dict(self._stateful)

    @property
    def handlers(self) -> tuple[Any, ...]:
        return tuple(self._handlers)

    def get(self, kind: type[H] | str, default: Any = None) -> H | Any:
        if isinstance(kind, str):
            found = self._stateful.get(kind)
            if found is not None:
                return found
            return next((h for h in self._handlers if handler_state_key(h) == kind), default)
        return next((h for h in self._handlers if isinstance(h, kind)), default)
