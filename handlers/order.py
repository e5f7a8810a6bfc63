"""The shipped handlers in their attach order (:data:`HANDLER_ORDER`), where each runs
(:class:`Places`), and building and attaching them from a run config (:func:`attach_handlers`).

Both tables come from the handlers' own declarations, gathered in the generated
:mod:`handlers.shipped` (``python -m hookloop.handlers.declarations`` writes it): nothing here lists
a handler by hand.

The engine's :class:`~hookloop.engine.Priority` names only the phases of an event (``CLOCK``,
``RESTORE``, ``OBSERVE``, ``DECIDE``, ``ACT``, ``DEFAULT``, ``RECORD``, ``CLEANUP``); each shipped
handler's module defines its own places inside one of them (``checkpoint.CHECKPOINT =
Priority.ACT``), each a :class:`~hookloop.engine.Place` that cannot leave its phase. :class:`Places`
gathers those places under their names, so a handler can be placed relative to a shipped one::

    from hookloop.handlers import Places

    trainer.on(Events.STEP_END, priority=Places.CHECKPOINT + 1)   # in ACT, just before the save

The whole order of a run, event by event, is printed by the code: ``trainer.describe()`` (and
``hookloop check CONFIG --order``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Place
from hookloop.handlers.handler_entries import build_handler_entries, check_handler_entries, runtime_arguments
from hookloop.handlers.run_config import run_dir_of
from hookloop.handlers.shipped import HANDLERS

__all__ = ["HANDLER_ORDER", "Places", "attach_handlers"]


def _load(dotted: str) -> type:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


#: The order :func:`attach_handlers` attaches the shipped handlers in (:data:`handlers.shipped.HANDLERS`):
#: the step scheduler first (it sets the trainer's length and accumulation); the checkpointer next
#: (it resumes at TRAIN_START before any other handler reads the state, and answers the NaN
#: detector's ROLLBACK); then the NaN detector, the curriculum, metrics, loggers, profiler, health
#: check and straggler detector; a new shipped handler after them.
HANDLER_ORDER: list[type] = [_load(dotted) for dotted in HANDLERS]


class Places:
    """The place of every shipped handler on the events it attaches to (higher runs first), each
    gathered from its module (and its base classes' modules) under the name it has there."""


for _module in dict.fromkeys(
    sys.modules[base.__module__]
    for cls in HANDLER_ORDER
    for base in cls.__mro__
    if base.__module__.startswith("hookloop.handlers.")
):
    for _name, _place in vars(_module).items():
        if isinstance(_place, Place):
            if getattr(Places, _name, _place) is not _place:  # two handlers' places by one name
                raise ImportError(f"{_module.__name__}.{_name}: Places already has a place of this name")
            setattr(Places, _name, _place)


def attach_handlers(
    trainer: Any,
    cfg: Any,
    *,
    order: Sequence[type] | None = None,
    extra: Sequence[Any] = (),
    **runtime: Any,
) -> list:
    """Build every enabled handler of ``order`` (default :data:`HANDLER_ORDER`) from its section of
    ``cfg`` with ``cls.from_config(getattr(cfg, cls.section), **runtime)``, then the config's own
    ``handlers:`` entries (:mod:`handlers.handler_entries`), then attach them all in that order,
    followed by the ``extra`` handler objects; return the attached handlers. Everything is built
    before anything is attached, so a bad setting fails before the trainer is touched.

    ``runtime`` holds what a config file cannot (``dataloader``, ``dp_size``, ``sampler``,
    ``flops_per_token``, ...); ``run_dir``, ``local_batch_size``, ``log_interval``, ``config`` and
    ``trainer`` default to the run's. Each handler gets the runtime values its ``from_config`` (or
    factory) names (or, when it takes ``**runtime``, those its constructor names). A handler class
    whose section is composed in (:func:`compose_config`) joins with ``order=[*HANDLER_ORDER, MyHook]``.
    """
    runtime = {**_from_run_config(cfg), "trainer": trainer, **runtime}
    built: list[tuple[str, Any]] = []
    for cls in dict.fromkeys(HANDLER_ORDER if order is None else order):  # a class listed twice: once
        section = getattr(cls, "section", None)
        if not isinstance(section, str) or not hasattr(cfg, section):
            raise ConfigError(
                section or cls.__name__,
                f"{cls.__name__}'s config section is not in {type(cfg).__name__}: add it with "
                f"compose_config({section or '<name>'}={cls.__name__}.Config) and set {cls.__name__}.section",
            )
        section_cfg = getattr(cfg, section)
        if getattr(section_cfg, "enabled", True) is False:
            continue
        if not callable(getattr(cls, "from_config", None)):
            raise TypeError(
                f"{cls.__name__} has no from_config(cfg, **runtime): subclass engine.handler.Handler "
                "or define it"
            )
        handler = cls.from_config(section_cfg, **runtime_arguments(cls, section_cfg, runtime))
        if handler is not None:
            built.append((section, handler))
    built += build_handler_entries(check_handler_entries(getattr(cfg, "handlers", None) or []), runtime)
    for i, handler in enumerate(extra):
        if not callable(getattr(handler, "attach", None)):
            raise TypeError(
                f"handlers[{i}] is a {type(handler).__name__}, which has no attach(trainer): pass hookloop "
                "Handlers or objects with attach(trainer)"
            )
        built.append((f"handlers[{i}] (passed in)", handler))
    for where, handler in built:
        attach_one(trainer, handler, where)
    return [handler for _, handler in built]


def attach_one(trainer: Any, handler: Any, where: str) -> None:
    """``handler.attach(trainer)``, then register it with the trainer if its ``attach`` did not (an
    ignite-style object), so a stateful one is checkpointed like a hookloop ``Handler``. What either
    raises (two stateful handlers claiming one checkpoint key, say) is a :class:`ConfigError`
    naming ``where``."""
    try:
        handler.attach(trainer)
        if handler not in trainer.handlers:
            trainer.register_handler(handler)
    except ConfigError:
        raise
    except Exception as e:
        if isinstance(e, ValueError) and "state key" in str(e):
            raise ConfigError(where, str(e)) from None
        raise ConfigError.caused_by(where, f"{type(handler).__name__}.attach(trainer) fails", e) from e


def _from_run_config(cfg: Any) -> dict[str, Any]:
    """Runtime values a run config already knows."""
    out: dict[str, Any] = {}
    train = getattr(cfg, "train", None)
    if train is not None:
        out["run_dir"] = run_dir_of(cfg)
        out["local_batch_size"] = train.local_batch_size
    if getattr(cfg, "logging", None) is not None:
        out["log_interval"] = cfg.logging.log_interval
    if dataclasses.is_dataclass(cfg):
        out["config"] = dataclasses.asdict(cfg)
    return out
