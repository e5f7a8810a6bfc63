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

import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hookloop.engine.errors import ConfigError

__all__ = ["ModelRecipe", "ResolvedModel", "resolve_model", "resolve_target", "token_cross_entropy"]

TARGET_HINT = "module:attribute (e.g. hookloop.models.gpt:recipe) or path/to/file.py:attribute"


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
    """

    build: Callable[..., torch.nn.Module]
    loss_fn: Callable | None = token_cross_entropy
    collate_fn: Callable | None = None
    check: Callable[[dict[str, Any], Any], Any] | None = None
    flops_per_token: Callable[[torch.nn.Module, dict[str, Any], Any], float] | None = None
    tp_plan: Mapping[str, Any] | Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """``model.target`` resolved and its arguments bound: what :mod:`hookloop.train` builds."""

    target: str
    recipe: ModelRecipe
    args: dict[str, Any]

    def build(self) -> torch.nn.Module:
        model = self.recipe.build(**self.args)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model.target {self.target} returned {type(model).__name__}, not an nn.Module")
        return model

    def flops_per_token(self, model: torch.nn.Module, cfg: Any) -> float:
        if self.recipe.flops_per_token is not None:
            return float(self.recipe.flops_per_token(model, self.args, cfg))
        own = getattr(model, "flops_per_token", None)
        if callable(own):
            return float(own())
        return 6.0 * sum(p.numel() for p in model.parameters())


def resolve_target(target: Any, field: str = "model.target") -> Any:
    """Import what ``target`` (``module:attribute`` or ``file.py:attribute``) names."""
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ConfigError(field, f"must look like {TARGET_HINT}, got {target!r}")
    where, attr = target.split(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(field, f"{where} is not a file (relative paths start at {Path.cwd()})")
        name = f"hookloop_user_model_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception:
                del sys.modules[name]
                raise
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):
                raise ConfigError(
                    field, f"cannot import {where} ({e}); install it or give path/to/file.py:{attr}"
                ) from None
            raise
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(field, f"{where} has no attribute {attr!r}") from None


def resolve_model(cfg: Any) -> ResolvedModel:
    """Resolve ``cfg.model`` and check its arguments; raises :class:`ConfigError` naming the field.
    Nothing is built."""
    section = dict(cfg.model)
    target = section.pop("target", None)
    if target is None:
        raise ConfigError("model.target", f"is not set: name the model factory, {TARGET_HINT}")
    obj = resolve_target(target)
    if isinstance(obj, ModelRecipe):
        recipe = obj
    elif callable(obj):
        recipe = ModelRecipe(build=obj)
    else:
        raise ConfigError(
            "model.target", f"{target} is a {type(obj).__name__}: name a model factory or a ModelRecipe"
        )
    args = _bind(target, recipe.build, section, cfg)
    if recipe.check is not None:
        try:
            recipe.check(args, cfg)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError("model", str(e)) from None
    return ResolvedModel(target, recipe, args)


def _bind(target: str, build: Callable, section: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    try:
        sig = inspect.signature(build)
    except (TypeError, ValueError):  # a builtin without a signature: pass the keys as they are
        return dict(section)
    params = sig.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    args = dict(section)
    if "seq_len" not in args and "seq_len" in named:
        args["seq_len"] = cfg.train.seq_len
    for key in section:
        if key not in named and not takes_any:
            raise ConfigError(
                f"model.{key}", f"is not an argument of {target} (it takes: {', '.join(named) or 'none'})"
            )
    missing = [
        n
        for n in named
        if params[n].default is inspect.Parameter.empty
        and n not in args
        and params[n].kind is not inspect.Parameter.VAR_POSITIONAL
    ]
    if missing:
        raise ConfigError(f"model.{missing[0]}", f"is required by {target}; set it in the model section")
    return args
