"""The shape every handler has: what a trainer, a run config and a checkpoint expect of it.

A handler is an object that attaches callbacks to a :class:`~engine.Trainer`'s events. The shipped
ones, and a user's own, follow one pattern::

    @dataclass
    class EveryNConfig:                      # the handler's config section, beside it
        enabled: bool = True
        every: int = 10

        def validate(self, prefix: str = "every_n") -> None:
            check_int(f"{prefix}.every", self.every)

    class EveryN(Handler):
        Config = EveryNConfig                # the section's schema
        section = "every_n"                  # its name in a run config (YAML / overrides)

        def __init__(self, every: int = 10) -> None:
            checked_settings(EveryNConfig, locals())   # the section's rules, the only copy
            self.every = every

        def attach(self, trainer):
            trainer.add_event_handler(Events.STEP_END(every=self.every), self._report,
                                      priority=Priority.RECORD)
            return super().attach(trainer)   # registers it: findable, checkpointed if stateful

A handler is *stateful* when it has ``state_dict()`` and ``load_state_dict()``; the trainer's
registry then puts it in every checkpoint under :attr:`Handler.state_key` (the class name unless
the class sets another). Tensors at the model's scale (an average of the weights) go beside the
model instead: ``tensor_state_dict()`` (name -> tensor or DTensor, the live tensors; see
:mod:`engine.run_snapshot` and docs/writing_handlers.md). The section's dataclass is the
handler's field list: the default :meth:`Handler.from_config` passes its fields
(:func:`section_settings`) to the constructor, and the constructor validates its arguments by
building the section from them (:func:`checked_settings`). Handlers find each other through
``trainer.get_handler(Type)``, never by looking for attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from hookloop.engine.events import Events

__all__ = [
    "Handler",
    "HandlerLike",
    "checked_settings",
    "handler_state_key",
    "is_stateful",
    "section_settings",
]

H = TypeVar("H", bound="Handler")

#: The names of :class:`engine.Events` members, whose ``on_<name lowercased>`` methods attach.
EVENT_NAMES = tuple(name for name in vars(Events) if name.isupper())


@runtime_checkable
class HandlerLike(Protocol):
    """What the trainer needs of anything it registers: ``attach(trainer)`` returning the handler."""

    def attach(self, trainer: Any) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` can be saved in and restored from a checkpoint."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def handler_state_key(obj: Any) -> str:
    """The key ``obj``'s state has in a checkpoint: its ``state_key``, else its class name."""
    key = getattr(obj, "state_key", None)
    return key if isinstance(key, str) and key else type(obj).__name__


def section_settings(cfg: Any) -> dict[str, Any]:
    """A config section's settings as constructor keywords: every field but ``enabled``."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "enabled"}


C = TypeVar("C")


def checked_settings(config: type[C], values: Mapping[str, Any], prefix: str = "") -> C:
    """``config`` built from the entries of ``values`` that name its fields (a constructor passes
    its ``locals()``; the others keep their defaults), validated with ``validate(prefix)``, and
    returned. A constructor's arguments then obey the section's rules, written once; ``prefix``
    "" names the argument in errors, a section name the dotted key."""
    names = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    cfg = config(**{k: v for k, v in values.items() if k in names})
    cfg.validate(prefix)  # type: ignore[attr-defined]
    return cfg


class Handler:
    """Base class of hookloop's handlers (optional for a user's: :class:`HandlerLike` is enough).

    A method named after an event, ``on_<event>`` (``on_step_end(self, trainer)``, ``on_train_start``,
    ``on_validation_end``, ... one per :class:`engine.Events` member, lowercased), is attached to it
    when the handler attaches (at ``Priority.DEFAULT``). Subclasses that need another place or a
    filter add their callbacks in :meth:`attach` and end with ``return super().attach(trainer)``,
    which registers them with the trainer (one handler instance per trainer).
    """

    #: The config dataclass of this handler's section (None: the handler has no section).
    Config: ClassVar[type | None] = None
    #: The section's name in a run config (``nan``, ``checkpoint``, ...).
    section: ClassVar[str | None] = None
    #: A shipped handler's page, ``docs/<page>.md``: declaring it in a ``hookloop.handlers`` module
    #: ships the handler (``python -m hookloop.handlers.declarations``; docs/development.md).
    doc: ClassVar[str | None] = None
    #: Key of this handler's state in checkpoints; None means the class name.
    state_key: str | None = None
    #: Whether a rollback restores this handler's state (a detector keeps its own counters).
    restore_on_rollback: bool = True
    #: Whether a stop or a rollback this handler asks for after the step's agreement (from a
    #: callback on STEP_END, VALIDATION_END, CHECKPOINT_SAVED or ROLLBACK), on one rank alone, must
    #: take effect at this very step. False (the default, no cost): it is agreed at the next step's
    #: agreement. True: **a second small all-reduce at the end of every step** while it is attached
    #: (:mod:`engine.step_decisions`).
    asks_after_agreement: ClassVar[bool] = False

    trainer: Any = None

    def attach(self: H, trainer: Any) -> H:
        """Register with ``trainer`` (after adding the event callbacks) and return ``self``."""
        held = getattr(self, "trainer", None)
        if held is not None and held is not trainer:
            raise RuntimeError(
                f"this {type(self).__name__} is already attached to another trainer; build one per trainer"
            )
        self.trainer = trainer
        for name in EVENT_NAMES:  # on_step_end(self, trainer) attaches itself to STEP_END
            method, event = getattr(self, f"on_{name.lower()}", None), getattr(Events, name)
            if callable(method) and not trainer.has_event_handler(method, event):
                trainer.add_event_handler(event, method)
        trainer.register_handler(self)
        return self

    @classmethod
    def from_config(cls: type[H], cfg: Any, **runtime: Any) -> H | None:
        """Build from the handler's config section, or None when ``cfg.enabled`` is false.

        ``runtime`` carries what a config file cannot hold (a sampler, the run directory, the
        data loader). The default passes every field of ``cfg`` except ``enabled`` to the
        constructor; handlers whose section and constructor differ override it.
        """
        if not getattr(cfg, "enabled", True):
            return None
        return cls(**section_settings(cfg), **runtime)
