"""hookloop's core: the :class:`Trainer`, its :class:`Events` and :class:`TrainState`, the step
bodies, parallelism set-up, learning-rate schedules and configuration.

Importing ``engine`` is cheap: no logger backends (TensorBoard, W&B) are imported here.
"""

from engine.activation_checkpointing import apply_activation_checkpointing
from engine.checks import check_bool, check_choice, check_int, check_number, check_str
from engine.compile import compile_model
from engine.config import load_config, validate_sections
from engine.data import MixtureDataset, MixtureLoader, MixtureSampler, TokenDataset, prepare_tokens
from engine.errors import ConfigError, HookloopError, TrainingAborted
from engine.events import EventHandle, Events, Priority, StepEvents
from engine.exit_codes import ExitCode
from engine.handler import Handler, HandlerLike
from engine.logging_setup import setup_logging
from engine.lr import build_lr_scheduler, lr_at
from engine.parallel import DistInfo, agree_any, init_distributed, wrap_data_parallel
from engine.pipeline import PipelineConfig, PipelineRuntime, available_schedules, build_pipeline
from engine.state import TrainState
from engine.step_batches import StepBatches
from engine.trainer import Trainer, default_prepare_batch

__version__ = "0.1.0"

__all__ = [
    "EventHandle",
    "Handler",
    "HandlerLike",
    "Priority",
    "StepBatches",
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
    "HookloopError",
    "StepEvents",
    "TrainState",
    "Trainer",
    "TrainingAborted",
    "agree_any",
    "apply_activation_checkpointing",
    "available_schedules",
    "build_lr_scheduler",
    "build_pipeline",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_str",
    "compile_model",
    "default_prepare_batch",
    "init_distributed",
    "load_config",
    "prepare_tokens",
    "setup_logging",
    "lr_at",
    "validate_sections",
    "wrap_data_parallel",
]


def __getattr__(name: str):
    # HookloopConfig and validate_config moved to handlers (RunConfig, validate_run_config): the
    # shim resolves them lazily with a DeprecationWarning, so importing engine never imports handlers.
    import importlib

    return importlib.import_module("engine._deprecated").resolve(__name__, name)
