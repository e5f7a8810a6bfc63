"""hookloop: a hook-based, event-driven trainer engine for PyTorch.

What a training script attaches and writes handlers with is importable from here::

    from hookloop import Trainer, Events, Priority, Handler

The core lives in :mod:`hookloop.engine` (trainer, events, state, step bodies, parallel set-up,
config), the shipped handlers and their config sections in :mod:`hookloop.handlers`, config-driven
training (the ``hookloop`` command) in :mod:`hookloop.train` and :mod:`hookloop.cli`.

Importing hookloop is cheap (no logger backend, no handler module) and shows the library's
lifecycle lines on stderr until the application configures logging (:mod:`hookloop.engine.logging_setup`).
"""

from hookloop.engine import *  # noqa: F403
from hookloop.engine import __all__ as _engine_all
from hookloop.engine import __version__

__all__ = [*_engine_all, "__version__"]
