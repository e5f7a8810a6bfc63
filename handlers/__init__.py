"""Handlers: everything a run needs beyond the step itself, each attached to a Trainer.

Importing ``handlers`` stays cheap: optional backends (tensorboard, wandb, matplotlib) are imported
only when the handler that needs them is built.
"""

from handlers.checkpoint import AsyncCheckpointer
from handlers.console import ConsoleLogger
from handlers.curriculum import Phase, PhaseCurriculum
from handlers.dataset_metrics import PerDatasetMetrics
from handlers.health_check import HealthCheck, HealthCheckError
from handlers.jsonl_logger import JSONLLogger
from handlers.loggers import MetricLogger, build_loggers, metric_tag
from handlers.metrics import MetricsTracker, estimate_flops_per_token, peak_flops_for_device
from handlers.nan_detector import NaNDetector
from handlers.profiler import ProfilerWindow
from handlers.step_scheduler import StepScheduler, StepSchedulerConfig
from handlers.straggler import StragglerDetector
from handlers.tensorboard_logger import TensorBoardLogger
from handlers.wandb_logger import WandBLogger

__all__ = [
    "AsyncCheckpointer",
    "ConsoleLogger",
    "HealthCheck",
    "HealthCheckError",
    "JSONLLogger",
    "MetricLogger",
    "MetricsTracker",
    "NaNDetector",
    "PerDatasetMetrics",
    "Phase",
    "PhaseCurriculum",
    "ProfilerWindow",
    "StepScheduler",
    "StepSchedulerConfig",
    "StragglerDetector",
    "TensorBoardLogger",
    "WandBLogger",
    "build_loggers",
    "estimate_flops_per_token",
    "metric_tag",
    "peak_flops_for_device",
]
