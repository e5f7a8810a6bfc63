"""Tensor (and sequence) parallelism with torch's DTensor tools, and the gradient norm over DTensors.

A *plan* says how a model's modules are cut over the ``tp`` mesh dimension. It is either

- a mapping of module names to ``torch.distributed.tensor.parallel`` styles
  (``{"blocks.0.qkv_heads": ColwiseParallel(), ...}``), handed to ``parallelize_module`` as it is; or
- a callable ``plan(model, tp_mesh)`` that parallelizes ``model`` in place (it may take the
  keywords ``sequence_parallel`` and ``loss_parallel`` too, then it is told whether they are on).

The bundled models ship plans (:func:`hookloop.models.gpt.tp_plan`,
:func:`hookloop.models.hf.llama_tp_plan`); a config's model gets its plan from its
:class:`~hookloop.recipe.ModelRecipe` (``tp_plan=``). A plan runs on the whole model or on one
pipeline stage's part of it, so a callable plan skips what a stage does not hold.

Attention heads: a column-parallel projection gives each rank ``n_heads / tp`` heads. The bundled
models read the local head count from the projection's output size, so nothing else changes.

Gradients of parallelized parameters are DTensors; :func:`grad_norm` is the norm over every rank's
part (shards counted once, replicas once) and :func:`clip_grads_with_norm` scales DTensor and plain
gradients alike.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hookloop.engine.errors import ConfigError

__all__ = [
    "TPPlan",
    "apply_tensor_parallel",
    "clip_grads_with_norm",
    "grad_norm",
    "find_tp_mesh",
    "is_dtensor",
    "local_value",
]

#: A tensor-parallel plan: module name -> ParallelStyle, or ``plan(model, tp_mesh, **keywords)``.
TPPlan = Mapping[str, Any] | Callable[..., Any]

NO_PLAN_HINT = (
    "give the model a tensor-parallel plan: a ModelRecipe(tp_plan=...) for model.target, either a dict "
    "of module name -> ParallelStyle (ColwiseParallel, RowwiseParallel, SequenceParallel) or a "
    "callable(model, tp_mesh) that calls torch.distributed.tensor.parallel.parallelize_module; "
    "or set distributed.tp_size=1"
)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor when nothing has made one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_value(t: Any) -> Any:
    """A DTensor as a plain tensor holding its whole value (``full_tensor()``: a replicated one
    costs nothing, a sharded one is gathered); anything else as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def find_tp_mesh(params: Iterable[torch.Tensor]) -> Any:
    """The 1-D ``tp`` mesh of the first DTensor parameter whose mesh has a dimension named
    ``"tp"`` (also inside a 2-D ``("dp", "tp")`` mesh FSDP2 made), else None."""
    for p in params:
        if is_dtensor(p):
            mesh = p.device_mesh
            names = mesh.mesh_dim_names or ()
            if "tp" in names:
                return mesh if mesh.ndim == 1 else mesh["tp"]
    return None


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: Any,
    plan: TPPlan | None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Parallelize ``model`` in place over ``tp_mesh`` (a 1-D device mesh) with ``plan``; returns it.

    A mapping plan goes to ``parallelize_module`` (``sequence_parallel`` must then be built into
    the mapping's styles); a callable plan is called as ``plan(model, tp_mesh)``, with
    ``sequence_parallel=`` and ``loss_parallel=`` when its signature takes them (a plan asked for
    what it does not take is a ``ConfigError``). ``loss_parallel``: the plan leaves the logits a
    DTensor sharded over the vocabulary (train with ``Trainer(loss_parallel=True)``). With
    ``tp_mesh`` of size 1 nothing changes.
    """
    if plan is None:
        raise ConfigError(
            "distributed.tp_size", f"{type(model).__name__} has no tensor-parallel plan: {NO_PLAN_HINT}"
        )
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    asked = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
    if isinstance(plan, Mapping):
        for name, on in asked.items():
            if on:
                raise ConfigError(
                    f"distributed.{name}",
                    f"a dict plan cannot switch {name} on: build it into the dict's styles (layouts), "
                    f"or give a callable plan taking {name}",
                )
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, dict(plan))
        return model
    if not callable(plan):
        raise TypeError(
            f"a tensor-parallel plan is a dict or a callable(model, tp_mesh), got {type(plan).__name__}"
        )
    kwargs = {}
    for name, on in asked.items():
        if _takes_keyword(plan, name):
            kwargs[name] = on
        elif on:
            raise ConfigError(
                f"distributed.{name}",
                f"the plan {getattr(plan, '__name__', plan)!r} takes no {name} argument; "
                f"give it one or set distributed.{name}=false",
            )
    plan(model, tp_mesh, **kwargs)
    return model


def _takes_keyword(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _group_key(t: torch.Tensor) -> tuple:
    if is_dtensor(t):
        return (id(t.device_mesh), tuple(t.placements), t.dtype)
    return (None, (), t.dtype)


def grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of ``grads`` over every rank's part: DTensor gradients are
    grouped by mesh and placements, each group's norm made whole (``full_tensor()``: one small
    all-reduce for a sharded group, none for a replicated one), plain gradients taken as they are.
    A plain tensor (fp32 or wider) is returned."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    if not groups:
        return torch.zeros(())
    parts = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, foreach=not is_dtensor(members[0]) or None)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        parts.append(norm.float() if norm.dtype in (torch.float16, torch.bfloat16) else norm)
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack([p.to(parts[0].device, torch.float64) for p in parts])
    return stacked.pow(2.0).sum().pow(0.5).to(parts[0].dtype)


def clip_grads_with_norm(params: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's rule), DTensor
    gradients through their local shards (the factor is the same on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm.detach() + 1e-6), max=1.0)
    plain = [g for g in grads if not is_dtensor(g)]
    local = [g.to_local() for g in grads if is_dtensor(g)]
    for group in (plain, local):
        if group:
            torch._foreach_mul_(group, coef.to(group[0].device, group[0].dtype))
