"""The checks of :class:`~engine.trainer.Trainer`'s constructor arguments, made before anything is
built: each names the argument and what it takes (``TypeError`` for a wrong kind of object,
:class:`~engine.errors.ConfigError` for a setting out of range)."""

from __future__ import annotations

from typing import Any

import torch

from hookloop.engine.checks import check_choice, check_number
from hookloop.engine.errors import ConfigError
from hookloop.engine.precision import PRECISIONS
from hookloop.engine.step_body import check_step_body

__all__ = ["check_constructor_arguments"]


def check_constructor_arguments(
    model: Any,
    optimizer: Any,
    loss_fn: Any,
    *,
    prepare_batch: Any,
    grad_clip_norm: Any,
    precision: Any,
    hang_timeout_s: Any,
    step_body: Any,
    removed: dict[str, Any],
) -> None:
    """Raise on the first argument a trainer cannot take (``grad_accum_steps`` is checked by its
    setter, a step body's own arguments by its ``bind``); ``removed``: keyword arguments the trainer
    does not take (``pipeline`` is now ``step_body``)."""
    if "pipeline" in removed:
        raise TypeError(
            "Trainer(pipeline=...) is now Trainer(step_body=...): pass the runtime build_pipeline "
            "returns as step_body=runtime (it declares its microbatches per step)"
        )
    if removed:
        raise TypeError(f"Trainer() got unexpected keyword arguments: {', '.join(removed)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            "loss_fn must be callable: loss_fn(model_output, targets) -> scalar tensor, or None "
            "when the model computes its own loss (output.loss, Hugging Face convention)"
        )
    if prepare_batch is not None and not callable(prepare_batch):
        raise TypeError("prepare_batch must be callable: prepare_batch(microbatch, device)")
    number = isinstance(grad_clip_norm, (int, float)) and not isinstance(grad_clip_norm, bool)
    if grad_clip_norm is not None and not (number and grad_clip_norm > 0):
        raise ConfigError("grad_clip_norm", f"must be a positive number or None, got {grad_clip_norm!r}")
    check_choice("precision", precision, PRECISIONS)
    check_number("hang_timeout_s", hang_timeout_s, positive=True, allow_none=True, hint="seconds")
    check_step_body(step_body, precision)
