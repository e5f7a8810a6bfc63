"""hookloop: a hook-based, event-driven trainer engine for PyTorch.

What a training script attaches and writes handlers with is importable from here::

    from hookloop import Trainer, Events, Priority, Handler

The core lives in :mod:`hookloop.engine` (trainer, events, state, step bodies, parallel set-up,
config), the shipped handlers and their config sections in :mod:`hookloop.handlers`, config-driven
training (the ``hookloop`` command) in :mod:`hookloop.train` and :mod:`hookloop.cli`.

Importing ``hookloop`` itself imports nothing (not even torch): the names above load
:mod:`hookloop.engine` on first use (PEP 562). The ``hookloop`` command relies on this to set the
thread environment before torch starts its thread pools (:mod:`hookloop.threads`). Importing the
engine shows the library's lifecycle lines on stderr until the application configures logging
(:mod:`hookloop.engine.logging_setup`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see; at run time, __getattr__ below
    from hookloop.engine import *  # noqa: F403
    from hookloop.engine import __all__ as _engine_all
    from hookloop.engine import __version__

    __all__ = [*_engine_all, "__version__"]


def __getattr__(name: str) -> Any:
    """A module of the package, or one of the engine's public names (and ``__all__``,
    ``__version__``), imported on first use, then cached."""
    if not name.startswith("_") and importlib.util.find_spec(f"hookloop.{name}") is not None:
        return importlib.import_module(f"hookloop.{name}")  # the engine is not needed to find it
    engine = importlib.import_module("hookloop.engine")
    if name == "__all__":
        value: Any = [*engine.__all__, "__version__"]
    elif name == "__version__" or name in engine.__all__:
        value = getattr(engine, name)
    else:
        raise AttributeError(f"module 'hookloop' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
