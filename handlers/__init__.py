"""Handlers: everything a run needs beyond the step itself, each attached to a Trainer.

Each handler's config section (``NaNConfig``, ``CheckpointConfig``, ...) lives beside it;
:class:`RunConfig` composes them with the engine's sections, :func:`load_run_config` loads and
validates one, :func:`compose_config` adds a user's sections, and :func:`attach_handlers` builds and
attaches every enabled handler in :data:`HANDLER_ORDER`. :class:`Places` is the place of every
shipped handler (``Places.CHECKPOINT``, ``Places.LOG``, ...), each inside one of the engine's phases;
``Priority`` here is the engine's own phase table (``hookloop.Priority``, the same object).

Importing ``handlers`` stays cheap: optional backends (tensorboard, wandb, matplotlib) are imported
only when the handler that needs them is built.
"""

from hookloop.engine.events import Priority
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointConfig
from hookloop.handlers.console import ConsoleLogger
from hookloop.handlers.curriculum import Phase, PhaseCurriculum
from hookloop.handlers.dataset_metrics import DatasetMetricsConfig, PerDatasetMetrics
from hookloop.handlers.health_check import HealthCheck, HealthCheckError, HealthConfig
from hookloop.handlers.jsonl_logger import JSONLLogger
from hookloop.handlers.loggers import LoggingConfig, MetricLogger, build_loggers, metric_tag
from hookloop.handlers.metrics import MetricsConfig, MetricsTracker
from hookloop.handlers.nan_detector import NaNConfig, NaNDetector
from hookloop.handlers.order import Places
from hookloop.handlers.profiler import ProfilerWindow, ProfilingConfig
from hookloop.handlers.replica_groups import ReplicaGroups
from hookloop.handlers.run_config import (
    HANDLER_ORDER,
    RunConfig,
    attach_handlers,
    check_run_paths,
    compose_config,
    load_run_config,
    validate_run_config,
)
from hookloop.handlers.step_scheduler import StepScheduler, StepSchedulerConfig
from hookloop.handlers.straggler import StragglerConfig, StragglerDetector
from hookloop.handlers.tensorboard_logger import TensorBoardLogger
from hookloop.handlers.wandb_logger import WandBLogger

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
