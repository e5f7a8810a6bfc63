"""hookloop's core: the :class:`Trainer`, its :class:`Events` and :class:`TrainState`, the step
bodies, parallelism set-up, learning-rate schedules and configuration.

The checkpoint format (what a checkpoint looks like on disk, how to read one without trusting it)
is the package :mod:`hookloop.engine.checkpoint_format`, imported module by module; saving and
loading are the checkpointer's (:mod:`hookloop.handlers.checkpoint`).

Importing ``hookloop.engine`` is cheap: no logger backends (TensorBoard, W&B) and no
``torch.distributed.checkpoint`` are imported here.
"""

from hookloop.engine.activation_checkpointing import apply_activation_checkpointing
from hookloop.engine.checks import check_bool, check_choice, check_int, check_number, check_str
from hookloop.engine.compile import compile_model
from hookloop.engine.config import load_config, validate_sections
from hookloop.engine.control import Decided, Rollback, StepControl
from hookloop.engine.data import MixtureDataset, MixtureLoader, MixtureSampler, TokenDataset, prepare_tokens
from hookloop.engine.errors import ConfigError, HookloopError, StartRefused, TrainingAborted
from hookloop.engine.events import EventHandle, Events, Place, PlaceError, Priority, StepEvents
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.fault_tolerance import FaultToleranceConfig
from hookloop.engine.handler import Handler, HandlerLike
from hookloop.engine.logging_setup import install_default, setup_logging
from hookloop.engine.lr import build_lr_scheduler, lr_at
from hookloop.engine.parallel import DistInfo, agree_any, init_distributed, wrap_data_parallel
from hookloop.engine.pipeline import PipelineConfig, PipelineRuntime, available_schedules, build_pipeline
from hookloop.engine.record_file import RecordFile
from hookloop.engine.save_policy import SavePolicy
from hookloop.engine.state import TrainState
from hookloop.engine.step_batches import StepBatches
from hookloop.engine.step_body import EvalResult, LocalStepBody, StepBody, StepContext, StepResult
from hookloop.engine.tensor_parallel import apply_tensor_parallel
from hookloop.engine.token_accuracy import TokenAccuracy
from hookloop.engine.trainer import Trainer, default_prepare_batch
from hookloop.engine.validation import ValidationConfig, Validator, build_metrics

__version__ = "0.1.0"

__all__ = [
    "EventHandle",
    "Handler",
    "HandlerLike",
    "Place",
    "PlaceError",
    "Priority",
    "StepBatches",
    "StepBody",
    "EvalResult",
    "StepContext",
    "StepResult",
    "LocalStepBody",
    "ConfigError",
    "Decided",
    "Rollback",
    "RecordFile",
    "FaultToleranceConfig",
    "SavePolicy",
    "StepControl",
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
    "StartRefused",
    "TokenAccuracy",
    "TrainState",
    "Trainer",
    "TrainingAborted",
    "agree_any",
    "apply_activation_checkpointing",
    "apply_tensor_parallel",
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
    "ValidationConfig",
    "Validator",
    "build_metrics",
    "wrap_data_parallel",
]

install_default()  # lifecycle lines reach stderr until the application configures logging
