"""hookloop's core: the :class:`Trainer`, its :class:`Events` and :class:`TrainState`, the step
bodies, parallelism set-up, learning-rate schedules and configuration.

Importing ``engine`` is cheap: no logger backends (TensorBoard, W&B) are imported here.
"""

from engine.config import HookloopConfig, load_config, validate_config
from engine.data import MixtureDataset, MixtureLoader, MixtureSampler, TokenDataset, prepare_tokens
from engine.errors import ConfigError, HookloopError, TrainingAborted
from engine.events import Events, StepEvents
from engine.exit_codes import ExitCode
from engine.lr import build_lr_scheduler, lr_at
from engine.parallel import DistInfo, agree_any, init_distributed, wrap_data_parallel
from engine.pipeline import PipelineConfig, PipelineRuntime, available_schedules, build_pipeline
from engine.state import TrainState
from engine.trainer import Trainer, default_prepare_batch

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DistInfo",
    "MixtureLoader",
    "Events",
    "MixtureDataset",
    "PipelineConfig",
    "PipelineRuntime",
    "MixtureSampler",
    "TokenDataset",
    "ExitCode",
    "HookloopConfig",
    "HookloopError",
    "StepEvents",
    "TrainState",
    "Trainer",
    "TrainingAborted",
    "agree_any",
    "available_schedules",
    "build_lr_scheduler",
    "build_pipeline",
    "default_prepare_batch",
    "init_distributed",
    "load_config",
    "prepare_tokens",
    "lr_at",
    "validate_config",
    "wrap_data_parallel",
]
