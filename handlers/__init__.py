"""Handlers: everything a run needs beyond the step itself, each attached to a Trainer.

Each shipped handler's config section (``NaNConfig``, ``CheckpointConfig``, ...) lives in
:mod:`hookloop.handlers.sections` (one module each, importing no torch); :class:`RunConfig`
composes them with the engine's sections, :func:`load_run_config` loads and validates one,
:func:`compose_config` adds a user's sections, and :func:`attach_handlers` builds and attaches every
enabled handler in :data:`HANDLER_ORDER`. :class:`Places` is the place of every shipped handler
(``Places.CHECKPOINT``, ``Places.LOG``, ...), each inside one of the engine's phases; ``Priority``
here is the engine's own phase table (``hookloop.Priority``, the same object).

Importing ``handlers`` is cheap: each public name loads its module on first use (PEP 562), so the
config layer (``RunConfig``, ``load_run_config``, the sections) loads without torch, and optional
backends (tensorboard, wandb, matplotlib) are imported only when the handler that needs them is
built.
"""

from hookloop.engine.lazy import lazy_exports
from hookloop.handlers.shipped import HANDLERS, SECTIONS

# Where each public name lives: imported on first use (PEP 562). Every shipped handler class and its
# section's config come from their declarations (handlers/shipped.py, generated, imports no torch).
_MODULES = {
    "hookloop.engine.events": ("Priority",),
    "hookloop.handlers.curriculum": ("Phase",),
    "hookloop.handlers.health_check": ("HealthCheckError",),
    "hookloop.handlers.loggers": ("build_loggers",),
    "hookloop.handlers.metric_logger": ("MetricLogger", "metric_tag"),
    "hookloop.handlers.order": ("HANDLER_ORDER", "Places", "attach_handlers"),
    "hookloop.handlers.replica_groups": ("ReplicaGroups",),
    "hookloop.handlers.run_config": (
        "RunConfig",
        "check_run_paths",
        "compose_config",
        "load_run_config",
        "validate_run_config",
    ),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}
_HOMES.update({dotted.partition(":")[2]: dotted.partition(":")[0] for dotted in HANDLERS})
_HOMES.update({c.__name__: c.__module__ for c in SECTIONS.values() if c.__module__.startswith(__name__)})


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)


__all__ = sorted(_HOMES)
