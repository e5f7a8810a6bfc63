"""What ``hookloop check`` checks: :func:`check` finds every mistake it can before any process
group exists (the model, the validation metrics, the config's own handlers, the paths, the data,
the device and the layout), ending with step 1 tried (:mod:`hookloop.first_step`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hookloop.engine.data import check_model_vocab
from hookloop.engine.errors import ConfigError
from hookloop.engine.tensor_parallel import NO_PLAN_HINT
from hookloop.engine.validation import build_metrics
from hookloop.first_step import FirstStep, try_first_step
from hookloop.handlers.handler_entries import HandlerEntry, check_handler_entries
from hookloop.handlers.run_config import check_run_paths
from hookloop.recipe import ResolvedModel, resolve_model
from hookloop.run_data import check_data

__all__ = ["Checked", "check", "check_device"]


def check_device(cfg: Any) -> None:
    """``train.device`` (null: the launcher's choice, CPU or this rank's GPU) must exist here."""
    device = cfg.train.device
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ConfigError(
            "train.device", f"{device!r} is not a device ({e}); use 'cpu', 'cuda' or null"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", f"{device!r} but no CUDA device is available; use 'cpu' or null")


@dataclass(frozen=True)
class Checked:
    """What :func:`check` resolved: the model (its target, recipe and bound arguments), the
    config's own handler entries, and what trying step 1 found."""

    model: ResolvedModel
    handlers: tuple[HandlerEntry, ...] = ()
    first_step: FirstStep | None = None

    @property
    def target(self) -> str:
        return self.model.target

    @property
    def args(self) -> dict[str, Any]:
        return self.model.args


def check(cfg: Any, world_size: int | None = None) -> Checked:
    """Everything that can be checked before a process group exists, then step 1 tried for
    ``world_size`` processes (default: ``WORLD_SIZE``, else 1; :mod:`hookloop.first_step`). Raises
    :class:`ConfigError` naming the field; creates nothing."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = resolve_model(cfg)
    build_metrics(cfg.validation)  # each validation metric's target and arguments
    entries = check_handler_entries(cfg.handlers)
    check_run_paths(cfg)
    check_data(cfg)
    if cfg.data.target is None:  # token files say their vocabulary (docs/data.md, "Vocabulary")
        check_model_vocab(model.recipe.build, model.args, cfg.data.datasets)
    check_device(cfg)
    _check_layout(cfg, model)
    if callable(getattr(cfg, "check_ranked_metric", None)):
        cfg.check_ranked_metric([entry.factory for entry in entries])
    return Checked(model, tuple(entries), try_first_step(cfg, model, world_size))


def _check_layout(cfg: Any, model: ResolvedModel) -> None:
    if cfg.train.compile is not False and cfg.distributed.pp_size > 1:
        raise ConfigError(
            "train.compile", "is not supported with distributed.pp_size > 1 yet; set train.compile=false"
        )
    if cfg.distributed.tp_size == 1:
        return
    if model.recipe.tp_plan is None:
        raise ConfigError(
            "distributed.tp_size",
            f"model.target {model.target} has no tensor-parallel plan: {NO_PLAN_HINT}",
        )
    if cfg.train.compile is not False:
        raise ConfigError(
            "train.compile", "is not supported with distributed.tp_size > 1 yet; set train.compile=false"
        )
    if cfg.distributed.loss_parallel and cfg.distributed.pp_size > 1:
        raise ConfigError(
            "distributed.loss_parallel",
            "is not supported with distributed.pp_size > 1 (the schedule runs backward); set it to false",
        )
    if cfg.distributed.loss_parallel and model.recipe.loss_fn is None:
        raise ConfigError(
            "distributed.loss_parallel",
            f"needs a loss_fn (a cross entropy) to run on the sharded logits; model.target "
            f"{model.target} computes its own loss: set it to false",
        )
    if cfg.train.precision == "fp16-mixed":
        raise ConfigError(
            "train.precision",
            "'fp16-mixed' (loss scaling) is not supported with distributed.tp_size > 1 yet; "
            "use 'bf16-mixed' or 'fp32'",
        )
