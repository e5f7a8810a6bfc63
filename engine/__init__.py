"""hookloop's core: the :class:`Trainer`, its :class:`Events` and :class:`TrainState`, the step
bodies, parallelism set-up, learning-rate schedules and configuration.

The checkpoint format (what a checkpoint looks like on disk, how to read one without trusting it)
is the package :mod:`hookloop.engine.checkpoint_format`, imported module by module; saving and
loading are the checkpointer's (:mod:`hookloop.handlers.checkpoint`).

``__all__`` is the public API (``hookloop`` forwards it): what a training script or a handler
writes. Everything else (config checks, data sets, logging set-up, agreement helpers, ...) is
imported from its own module (``from hookloop.engine.checks import check_int``).

Importing ``hookloop.engine`` is cheap: it imports no torch; each public name loads its module on
first use.
"""

from typing import TYPE_CHECKING

from hookloop.engine.lazy import homes_of, lazy_exports
from hookloop.engine.logging_setup import install_default

if TYPE_CHECKING:  # what editors and type checkers see; at run time, __getattr__ below
    from hookloop.engine.control import StepControl
    from hookloop.engine.errors import ConfigError, HookloopError, StartRefused, TrainingAborted
    from hookloop.engine.events import Events, Place, PlaceError, Priority
    from hookloop.engine.exit_codes import ExitCode
    from hookloop.engine.handler import Handler
    from hookloop.engine.lr import build_lr_scheduler
    from hookloop.engine.parallel import init_distributed, wrap_data_parallel
    from hookloop.engine.pipeline import PipelineConfig, build_pipeline
    from hookloop.engine.record_file import RecordFile
    from hookloop.engine.state import TrainState
    from hookloop.engine.step_body import EvalResult, LocalStepBody, StepBody, StepContext, StepResult
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.engine.token_accuracy import TokenAccuracy
    from hookloop.engine.trainer import Trainer

# Where each public name lives: imported on first use (PEP 562), so the modules that need no torch
# (errors, run_lock, exit_status, ...) load without it and a refusal is answered in a fraction of a
# second (``hookloop train`` on a held run directory).
_MODULES = {
    "control": ("StepControl",),
    "errors": ("ConfigError", "HookloopError", "StartRefused", "TrainingAborted"),
    "events": ("Events", "Place", "PlaceError", "Priority"),
    "exit_codes": ("ExitCode",),
    "handler": ("Handler",),
    "lr": ("build_lr_scheduler",),
    "parallel": ("init_distributed", "wrap_data_parallel"),
    "pipeline": ("PipelineConfig", "build_pipeline"),
    "record_file": ("RecordFile",),
    "state": ("TrainState",),
    "step_body": ("EvalResult", "LocalStepBody", "StepBody", "StepContext", "StepResult"),
    "tensor_parallel": ("apply_tensor_parallel",),
    "token_accuracy": ("TokenAccuracy",),
    "trainer": ("Trainer",),
}
_HOMES = homes_of(__name__, _MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)


__version__ = "0.1.0"

# Pinned by tests/test_threads.py: a name added here is a decision.
__all__ = [
    # the trainer, its events, places and state
    "Trainer",
    "Events",
    "Priority",
    "Place",
    "PlaceError",
    "Handler",
    "TrainState",
    "StepControl",
    "ExitCode",
    # errors
    "ConfigError",
    "HookloopError",
    "StartRefused",
    "TrainingAborted",
    # step bodies
    "StepBody",
    "StepResult",
    "EvalResult",
    "StepContext",
    "LocalStepBody",
    # layouts and schedules
    "init_distributed",
    "wrap_data_parallel",
    "apply_tensor_parallel",
    "PipelineConfig",
    "build_pipeline",
    "build_lr_scheduler",
    # metrics and records
    "TokenAccuracy",
    "RecordFile",
]

install_default()  # lifecycle lines reach stderr until the application configures logging
