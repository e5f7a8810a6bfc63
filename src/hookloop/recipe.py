"""The model a config names: ``model.target`` and the arguments beside it.

A config's ``model`` section names a factory and its arguments::

    model:
      target: hookloop.models.gpt:recipe   # or my_package.models:build, or models/mine.py:build
      n_layers: 4
      d_model: 128

``target`` is ``module:attribute`` (an importable module) or ``path/to/file.py:attribute`` (a file,
relative to the working directory). The attribute is either

- a **factory**: any callable returning an ``nn.Module`` (a function or the module class itself).
  The other ``model`` keys are its keyword arguments, checked against its signature before anything
  is built; ``seq_len``, when the factory takes it and the config does not set it, is
  ``train.seq_len``. The model maps token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]`` and
  is trained with next-token cross entropy (:func:`token_cross_entropy`); or
- a :class:`ModelRecipe`, for anything else: another loss, a model that computes its own loss
  (``loss_fn=None``, Hugging Face style), a batch layout (``collate_fn``), checks of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from hookloop.engine.errors import ConfigError
from hookloop.engine.targets import TARGET_HINT, accepted_names, bind_arguments, resolve_target

__all__ = [
    "ModelRecipe",
    "ResolvedModel",
    "model_error",
    "resolve_model",
    "token_cross_entropy",
]

#: What a factory raises for arguments it refuses; reported as one line naming ``model`` or the argument.
REFUSALS = (ValueError, TypeError, AssertionError)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits [batch, seq, vocab]`` against ``targets [batch, seq]``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """A model factory and how its model is trained.

    Args:
        build: ``build(**args) -> nn.Module``, called with the ``model`` section's other keys.
        loss_fn: the Trainer's ``loss_fn(output, targets)``; None: the model computes its own loss
            from dict microbatches with ``labels``.
        collate_fn: turns a list of ``(input_ids, next_ids, source_idx)`` samples into one
            microbatch (default: torch's ``default_collate``).
        check: ``check(args, cfg)`` raises ``ConfigError`` (or ``ValueError``/``TypeError``, reported
            as a ``model`` error) for settings ``build`` would reject; it runs before any process
            group, data or model exists. ``args`` are the bound arguments.
        flops_per_token: ``flops_per_token(model, args, cfg)``: training FLOPs per token of the
            whole model, for MFU; default ``model.flops_per_token()`` if the model has it, else 6N.
        tp_plan: how ``distributed.tp_size > 1`` cuts the model over the tensor-parallel ranks: a
            dict of module name -> ``torch.distributed.tensor.parallel`` style, or a callable
            ``tp_plan(model, tp_mesh)`` (optionally taking ``sequence_parallel=``), see
            :mod:`engine.tensor_parallel`. None: the model cannot run tensor-parallel.
        inputs, targets: the keys of a dict microbatch that are the model's input and the loss's
            target (the config's ``data.inputs`` / ``data.targets`` win); None: the default layouts
            (:mod:`engine.batch`).
    """

    build: Callable[..., torch.nn.Module]
    loss_fn: Callable | None = token_cross_entropy
    collate_fn: Callable | None = None
    check: Callable[[dict[str, Any], Any], Any] | None = None
    flops_per_token: Callable[[torch.nn.Module, dict[str, Any], Any], float] | None = None
    tp_plan: Mapping[str, Any] | Callable[..., Any] | None = None
    inputs: str | None = None
    targets: str | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """``model.target`` resolved and its arguments bound: what :mod:`hookloop.train` builds."""

    target: str
    recipe: ModelRecipe
    args: dict[str, Any]
    #: arguments the config left out and hookloop filled in (``seq_len`` from ``train.seq_len``)
    filled: tuple[str, ...] = ()

    def build(self, device: torch.device | str | None = None) -> torch.nn.Module:
        """The model, freshly built; with ``device`` (e.g. ``"meta"``) its tensors are made there."""
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = self.recipe.build(**self.args)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model.target {self.target} returned {type(model).__name__}, not an nn.Module")
        return model

    def settings(self) -> dict[str, Any]:
        """``target`` and the arguments the model is built with, the build function's plain
        defaults (numbers, strings, booleans, None) included: what a checkpoint records of it."""
        try:
            params = inspect.signature(self.recipe.build).parameters.values()
        except (TypeError, ValueError):
            params = ()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        defaults = {
            p.name: p.default
            for p in params
            if p.kind in kinds and (p.default is None or isinstance(p.default, bool | int | float | str))
        }
        return {"target": self.target, **defaults, **self.args}

    def flops_per_token(self, model: torch.nn.Module, cfg: Any) -> float:
        if self.recipe.flops_per_token is not None:
            return float(self.recipe.flops_per_token(model, self.args, cfg))
        own = getattr(model, "flops_per_token", None)
        if callable(own):
            return float(own())
        return 6.0 * sum(p.numel() for p in model.parameters())


def resolve_model(cfg: Any) -> ResolvedModel:
    """Resolve ``cfg.model`` and check its arguments; raises :class:`ConfigError` naming the field.
    Nothing is built."""
    section = dict(cfg.model)
    target = section.pop("target", None)
    if target is None:
        raise ConfigError("model.target", f"is not set: name the model factory, {TARGET_HINT}")
    obj = resolve_target(target, "model.target")
    if isinstance(obj, ModelRecipe):
        recipe = obj
    elif callable(obj):
        recipe = ModelRecipe(build=obj)
    else:
        raise ConfigError(
            "model.target", f"{target} is a {type(obj).__name__}: name a model factory or a ModelRecipe"
        )
    args = _bind(target, recipe.build, section, cfg)
    filled = tuple(name for name in args if name not in section)
    if recipe.check is not None:
        try:
            recipe.check(args, cfg)
        except ConfigError:
            raise
        except Exception as e:
            error = model_error(e, args, filled)
            if error is None:
                raise
            raise error from None
    return ResolvedModel(target, recipe, args, filled)


def model_error(
    error: BaseException, args: Mapping[str, Any], filled: tuple[str, ...] = ()
) -> ConfigError | None:
    """``error`` from a model factory (or its ``check``) as one :class:`ConfigError` line: a
    :data:`REFUSALS` exception, or one raised from one (Hugging Face wraps its config errors), names
    the argument its message names (``model.d_model``; ``train.seq_len`` for the ``seq_len`` filled
    in from it), else ``model``. None for other exceptions."""
    if isinstance(error, ConfigError):
        return error
    refusal = error
    while refusal is not None and not isinstance(refusal, REFUSALS):
        refusal = refusal.__cause__
    if refusal is None:
        return None
    gist = next((line.strip() for line in str(refusal).splitlines() if line.strip()), "")
    gist = gist or type(refusal).__name__
    field, at = "model", None
    for name in args:
        found = re.search(rf"(?<![\w])(?:model\.)?{re.escape(name)}\b", gist)
        if found and (at is None or found.start() < at):
            field, at = ("train.seq_len" if name in filled else f"model.{name}"), found.start()
    if field != "model":
        gist = re.sub(rf"^model\.{re.escape(field.rpartition('.')[2])}[:\s]+", "", gist)
    return ConfigError(field, gist)


def _bind(target: str, build: Callable, section: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    args = dict(section)
    names = accepted_names(build)
    if "seq_len" not in args and names is not None and "seq_len" in names:
        args["seq_len"] = cfg.train.seq_len
    return bind_arguments(build, args, prefix="model", target=target)
