"""Old config names, resolved lazily to their new homes in ``handlers`` with a DeprecationWarning.

The handlers' config sections moved beside their handlers and the composed run config moved to
:mod:`handlers.run_config`. ``from engine import HookloopConfig`` or ``from engine.config import
StepSchedulerConfig`` keeps working: ``engine.__getattr__`` and ``engine.config.__getattr__``
delegate here, and the name is imported from ``handlers`` only when it is asked for.

This module is the ONLY place engine code may reach ``handlers``, and only through
``importlib.import_module`` at attribute-access time: importing ``engine`` never imports
``handlers``. Remove an entry here when its deprecation period ends.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["MOVED_NAMES", "resolve", "run_config_schema"]

_SECTIONS = {
    "StepSchedulerConfig": ("handlers.step_scheduler", "StepSchedulerConfig"),
    "CheckpointConfig": ("handlers.checkpoint", "CheckpointConfig"),
    "NaNConfig": ("handlers.nan_detector", "NaNConfig"),
    "LoggingConfig": ("handlers.metric_logger", "LoggingConfig"),
    "MetricsConfig": ("handlers.metrics", "MetricsConfig"),
    "ProfilingConfig": ("handlers.profiler", "ProfilingConfig"),
    "HealthConfig": ("handlers.health_check", "HealthConfig"),
    "StragglerConfig": ("handlers.straggler", "StragglerConfig"),
}
_RUN_CONFIG = {
    "HookloopConfig": ("handlers.run_config", "RunConfig"),
    "validate_config": ("handlers.run_config", "validate_run_config"),
}

#: For each engine module, its old names: ``name -> (new module, new name)``.
MOVED_NAMES: dict[str, dict[str, tuple[str, str]]] = {
    "engine": dict(_RUN_CONFIG),
    "engine.config": {**_RUN_CONFIG, **_SECTIONS},
}


def resolve(module: str, name: str) -> Any:
    """The object the old ``module.name`` now is, with a DeprecationWarning naming the new place;
    ``AttributeError`` for a name that never existed there (as a module's ``__getattr__`` must)."""
    try:
        new_module, new_name = MOVED_NAMES[module][name]
    except KeyError:
        raise AttributeError(f"module {module!r} has no attribute {name!r}") from None
    warnings.warn(
        f"{module}.{name} is deprecated: import {new_name} from handlers (it lives in {new_module})",
        DeprecationWarning,
        stacklevel=3,  # the caller of the module's __getattr__
    )
    return getattr(importlib.import_module(new_module), new_name)


def run_config_schema() -> type:
    """:class:`handlers.RunConfig`, the schema a ``load_config`` call without ``schema=`` loads."""
    return importlib.import_module("handlers.run_config").RunConfig
