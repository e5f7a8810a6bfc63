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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see; at run time, __getattr__ below
    from hookloop.engine.events import Priority
    from hookloop.handlers.checkpoint import AsyncCheckpointer
    from hookloop.handlers.console import ConsoleLogger
    from hookloop.handlers.curriculum import Phase, PhaseCurriculum
    from hookloop.handlers.dataset_metrics import PerDatasetMetrics
    from hookloop.handlers.health_check import HealthCheck, HealthCheckError
    from hookloop.handlers.jsonl_logger import JSONLLogger
    from hookloop.handlers.loggers import build_loggers
    from hookloop.handlers.metric_logger import MetricLogger, metric_tag
    from hookloop.handlers.metrics import MetricsTracker
    from hookloop.handlers.nan_detector import NaNDetector
    from hookloop.handlers.order import HANDLER_ORDER, Places, attach_handlers
    from hookloop.handlers.profiler import ProfilerWindow
    from hookloop.handlers.replica_groups import ReplicaGroups
    from hookloop.handlers.run_config import (
        RunConfig,
        check_run_paths,
        compose_config,
        load_run_config,
        validate_run_config,
    )
    from hookloop.handlers.sections.checkpoint import CheckpointConfig
    from hookloop.handlers.sections.dataset_metrics import DatasetMetricsConfig
    from hookloop.handlers.sections.health import HealthConfig
    from hookloop.handlers.sections.logging import LoggingConfig
    from hookloop.handlers.sections.metrics import MetricsConfig
    from hookloop.handlers.sections.nan import NaNConfig
    from hookloop.handlers.sections.profiling import ProfilingConfig
    from hookloop.handlers.sections.step_scheduler import StepSchedulerConfig
    from hookloop.handlers.sections.straggler import StragglerConfig
    from hookloop.handlers.step_scheduler import StepScheduler
    from hookloop.handlers.straggler import StragglerDetector
    from hookloop.handlers.tensorboard_logger import TensorBoardLogger
    from hookloop.handlers.wandb_logger import WandBLogger

_MODULES = {
    "hookloop.engine.events": ("Priority",),
    "hookloop.handlers.checkpoint": ("AsyncCheckpointer",),
    "hookloop.handlers.console": ("ConsoleLogger",),
    "hookloop.handlers.curriculum": ("Phase", "PhaseCurriculum"),
    "hookloop.handlers.dataset_metrics": ("PerDatasetMetrics",),
    "hookloop.handlers.health_check": ("HealthCheck", "HealthCheckError"),
    "hookloop.handlers.jsonl_logger": ("JSONLLogger",),
    "hookloop.handlers.loggers": ("build_loggers",),
    "hookloop.handlers.metric_logger": ("MetricLogger", "metric_tag"),
    "hookloop.handlers.metrics": ("MetricsTracker",),
    "hookloop.handlers.nan_detector": ("NaNDetector",),
    "hookloop.handlers.order": ("HANDLER_ORDER", "Places", "attach_handlers"),
    "hookloop.handlers.profiler": ("ProfilerWindow",),
    "hookloop.handlers.replica_groups": ("ReplicaGroups",),
    "hookloop.handlers.run_config": (
        "RunConfig",
        "check_run_paths",
        "compose_config",
        "load_run_config",
        "validate_run_config",
    ),
    "hookloop.handlers.sections.checkpoint": ("CheckpointConfig",),
    "hookloop.handlers.sections.dataset_metrics": ("DatasetMetricsConfig",),
    "hookloop.handlers.sections.health": ("HealthConfig",),
    "hookloop.handlers.sections.logging": ("LoggingConfig",),
    "hookloop.handlers.sections.metrics": ("MetricsConfig",),
    "hookloop.handlers.sections.nan": ("NaNConfig",),
    "hookloop.handlers.sections.profiling": ("ProfilingConfig",),
    "hookloop.handlers.sections.step_scheduler": ("StepSchedulerConfig",),
    "hookloop.handlers.sections.straggler": ("StragglerConfig",),
    "hookloop.handlers.step_scheduler": ("StepScheduler",),
    "hookloop.handlers.straggler": ("StragglerDetector",),
    "hookloop.handlers.tensorboard_logger": ("TensorBoardLogger",),
    "hookloop.handlers.wandb_logger": ("WandBLogger",),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hookloop.handlers' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = [
    "HANDLER_ORDER",
    "AsyncCheckpointer",
    "CheckpointConfig",
    "ConsoleLogger",
    "DatasetMetricsConfig",
    "HealthCheck",
    "HealthCheckError",
    "HealthConfig",
    "JSONLLogger",
    "LoggingConfig",
    "MetricLogger",
    "MetricsConfig",
    "MetricsTracker",
    "NaNConfig",
    "NaNDetector",
    "PerDatasetMetrics",
    "Phase",
    "PhaseCurriculum",
    "Places",
    "Priority",
    "ProfilerWindow",
    "ProfilingConfig",
    "RunConfig",
    "StepScheduler",
    "StepSchedulerConfig",
    "ReplicaGroups",
    "StragglerConfig",
    "StragglerDetector",
    "TensorBoardLogger",
    "WandBLogger",
    "attach_handlers",
    "build_loggers",
    "compose_config",
    "check_run_paths",
    "load_run_config",
    "metric_tag",
    "validate_run_config",
]
