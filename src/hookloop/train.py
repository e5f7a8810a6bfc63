"""Config-driven training: build the model a config names, its optimizer, data, parallel layout,
every shipped handler and your own, train, and map the outcome to an exit code.

This is what ``hookloop train CONFIG [section.field=value ...]`` runs, under ``python``,
``python -m hookloop`` or ``torchrun --nproc-per-node N -m hookloop``. From Python::

    from hookloop.train import build, load_training_config, train

    cfg = load_training_config("my_run.yaml", ["step_scheduler.max_steps=100"])
    exit_code = train(cfg, handlers=[MyHook()])        # the whole of `hookloop train`

    with build(cfg, handlers=[MyHook()]) as run:       # or wired, inspected, then run
        print(run.model, run.optimizer, run.trainer.handlers)
        exit_code = run.run()

    model = load_model("runs/my_run")                  # the trained model, in one process

Everything that can be checked is checked (:func:`check`) before any process group, data or model
exists; a config error exits with 2 and one line naming the field (under torchrun, said once by
rank 0). The run directory (``train.run_dir``; null: ``runs/<config file stem>``) is held by one run
at a time; once the run has started it gets the resolved config as ``config.yaml`` beside the
metrics and checkpoints, and a later run in it resumes. Exit codes are
:class:`hookloop.engine.ExitCode`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hookloop.engine import ConfigError
from hookloop.export import load_model
from hookloop.run import Run, build, build_optimizer
from hookloop.run_check import Checked, check
from hookloop.run_data import build_data, validation_indices
from hookloop.training_config import (
    TrainingConfig,
    load_training_config,
    report_config_error,
    resolve_run_dir,
    save_config,
)

__all__ = [
    "Checked",
    "Run",
    "TrainingConfig",
    "build",
    "build_data",
    "build_optimizer",
    "check",
    "load_model",
    "load_training_config",
    "report_config_error",
    "resolve_run_dir",
    "save_config",
    "train",
    "validation_indices",
]


def train(cfg: Any, handlers: Sequence[Any] = (), *, checked: Checked | None = None) -> int:
    """Train what ``cfg`` (a :data:`TrainingConfig`, e.g. from :func:`load_training_config`) says,
    with ``handlers`` (objects with ``attach(trainer)``) attached after the config's own; return the
    exit code. Config errors print one line and return 2, before any process group or model exists
    when :func:`check` can find them."""
    try:
        run = build(cfg, handlers, checked=checked)
    except ConfigError as e:
        report_config_error(e)
        return 2
    with run:
        return run.run()
