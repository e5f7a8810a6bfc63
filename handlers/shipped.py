"""The shipped handlers and their config sections, in attach order. Imports no torch.

Generated from the handlers' declarations by `python -m hookloop.handlers.declarations`; do not edit, except
to move a line of HANDLERS to change where that handler attaches."""

from hookloop.engine.data.config import DataConfig
from hookloop.handlers.sections.attribution import AttributionConfig
from hookloop.handlers.sections.checkpoint import CheckpointConfig
from hookloop.handlers.sections.dataset_metrics import DatasetMetricsConfig
from hookloop.handlers.sections.ema import EMAConfig
from hookloop.handlers.sections.fault_injection import FaultInjectionConfig
from hookloop.handlers.sections.health import HealthConfig
from hookloop.handlers.sections.logging import LoggingConfig
from hookloop.handlers.sections.metrics import MetricsConfig
from hookloop.handlers.sections.nan import NaNConfig
from hookloop.handlers.sections.profiling import ProfilingConfig
from hookloop.handlers.sections.replica_check import ReplicaCheckConfig
from hookloop.handlers.sections.step_scheduler import StepSchedulerConfig
from hookloop.handlers.sections.straggler import StragglerConfig

__all__ = ["HANDLERS", "SECTIONS"]

#: section -> its config dataclass, in the order the handlers reading them attach
SECTIONS: dict[str, type] = {
    "step_scheduler": StepSchedulerConfig,
    "checkpoint": CheckpointConfig,
    "nan": NaNConfig,
    "data": DataConfig,
    "dataset_metrics": DatasetMetricsConfig,
    "metrics": MetricsConfig,
    "logging": LoggingConfig,
    "profiling": ProfilingConfig,
    "health": HealthConfig,
    "straggler": StragglerConfig,
    "ema": EMAConfig,
    "attribution": AttributionConfig,
    "fault_injection": FaultInjectionConfig,
    "replica_check": ReplicaCheckConfig,
}

#: each shipped handler class (module:class) -> its section, in attach order (handlers.order)
HANDLERS: dict[str, str] = {
    "hookloop.handlers.step_scheduler:StepScheduler": "step_scheduler",
    "hookloop.handlers.checkpoint.handler:AsyncCheckpointer": "checkpoint",
    "hookloop.handlers.nan_detector:NaNDetector": "nan",
    "hookloop.handlers.curriculum:PhaseCurriculum": "data",
    "hookloop.handlers.dataset_metrics:PerDatasetMetrics": "dataset_metrics",
    "hookloop.handlers.metrics:MetricsTracker": "metrics",
    "hookloop.handlers.jsonl_logger:JSONLLogger": "logging",
    "hookloop.handlers.tensorboard_logger:TensorBoardLogger": "logging",
    "hookloop.handlers.wandb_logger:WandBLogger": "logging",
    "hookloop.handlers.console:ConsoleLogger": "logging",
    "hookloop.handlers.profiler:ProfilerWindow": "profiling",
    "hookloop.handlers.health_check:HealthCheck": "health",
    "hookloop.handlers.straggler:StragglerDetector": "straggler",
    "hookloop.handlers.ema:WeightEMA": "ema",
    "hookloop.handlers.attribution:RerunAttribution": "attribution",
    "hookloop.handlers.fault_injection:FaultInjector": "fault_injection",
    "hookloop.handlers.replica_check:ReplicaCheck": "replica_check",
}
