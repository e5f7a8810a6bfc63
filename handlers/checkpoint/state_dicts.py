"""The model's and the optimizer's state dicts a save writes: torch's ``get_state_dict`` (with
:data:`~.dcp_calls.STATE_DICT_OPTIONS`), its naming learned once per layout.

``get_state_dict`` gives every entry its canonical name (without DDP's ``module.``,
``torch.compile``'s ``_orig_mod.``, activation checkpointing's wrapper) and keys the optimizer's
state by those names, walking the module tree for every name at every call: 7.9 ms per save for the
benchmarks' tiny Llama, most of an async save's time on training's thread, where the module's and
the optimizer's own ``state_dict()`` take 0.4 ms. :class:`StateDicts` asks torch at the first save
of each layout (the module, its parameters, the optimizer's parameters, the state dict's keys),
learns the names torch gave from its answer, and from then on renames the plain state dicts itself.
The renamed state dicts of that first save are compared with torch's entry by entry (the same keys
in the same order, the same tensors, the same values); a layout where they differ (FSDP1's flat
parameters, an optimizer state nested in dicts) asks torch at every save.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from hookloop.handlers.checkpoint.dcp_calls import STATE_DICT_OPTIONS, local_shard

__all__ = ["StateDicts"]

_STATE, _GROUPS = "state", "param_groups"


def _identical(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _same_entry(mine: Any, theirs: Any) -> bool:
    """The same tensor (the same memory, shape, strides and type: ``state_dict()`` makes new
    views at every call) or the same value."""
    if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
        if type(mine) is not type(theirs):
            return False
        a, b = local_shard(mine), local_shard(theirs)
        return (
            a.data_ptr() == b.data_ptr()
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.dtype == b.dtype
            and a.device == b.device
        )
    return mine is theirs


def _same(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    return list(mine) == list(theirs) and all(_same_entry(mine[k], theirs[k]) for k in mine)


class _Names:
    """The names torch gives one layout's entries."""

    __slots__ = ("model", "params")

    def __init__(self, model: dict[str, str], params: list[list[str]]) -> None:
        self.model = model  # module state dict key -> name, for the keys torch renames
        self.params = params  # per optimizer: parameter index (its state_dict's) -> name


class StateDicts:
    """``get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)`` for every save of one
    checkpointer (see the module docstring)."""

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._names: _Names | None = None  # None: this layout asks torch

    def get(self, model: torch.nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state dicts, as ``get_state_dict`` gives them."""
        optimizers = (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else tuple(optimizer)
        model_sd = model.state_dict()
        layout = (
            model,
            tuple(model_sd),
            tuple(model.parameters()),
            tuple(p for o in optimizers for g in o.param_groups for p in g["params"]),
        )
        known = self._layout is not None and self._layout[0] is layout[0] and self._layout[1] == layout[1]
        known = known and _identical(self._layout[2], layout[2]) and _identical(self._layout[3], layout[3])
        # an optimizer without state yet: torch makes it (a step with zero gradients), not us
        if known and self._names is not None and all(o.state for o in optimizers):
            renamed = self._rename(self._names, model_sd, optimizers)
            if renamed is not None:
                return renamed
        theirs = get_state_dict(model, optimizers, options=STATE_DICT_OPTIONS)
        if not known:
            self._layout, self._names = layout, self._learn(model, optimizers, model_sd, theirs)
        return theirs

    def _learn(
        self,
        model: torch.nn.Module,
        optimizers: tuple[torch.optim.Optimizer, ...],
        model_sd: dict[str, Any],
        theirs: tuple[dict[str, Any], dict[str, Any]],
    ) -> _Names | None:
        """The names torch gave in ``theirs`` (from ``model_sd``), if renaming by them gives
        exactly ``theirs``; None otherwise."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if FullyShardedDataParallel.fsdp_modules(model):
            return None  # FSDP1: its own state dict types and optimizer state
        model_theirs = theirs[0]
        # torch renames key by key, in order, each renamed one moving to the end
        renamed_from = [k for k in model_sd if k not in model_theirs]
        renamed_to = [k for k in model_theirs if k not in model_sd]
        if len(renamed_from) != len(renamed_to):
            return None
        renames = dict(zip(renamed_from, renamed_to))
        # each parameter's name, in the optimizers' order: from torch's flattened settings, which
        # hold each group's settings (in the group's order) for each of its parameters in turn
        settings = [k[len(_GROUPS) + 1 :] for k in theirs[1] if k.startswith(f"{_GROUPS}.")]
        params: list[list[str]] = []
        at = 0
        for optimizer in optimizers:
            names_here: list[str] = []
            for group in optimizer.param_groups:
                first = next((f".{k}" for k in group if k != "params"), None)
                for _ in group["params"]:
                    if first is None or at >= len(settings) or not settings[at].endswith(first):
                        return None
                    names_here.append(settings[at][: -len(first)])
                    at += len(group) - 1
            params.append(names_here)
        names = _Names(renames, params)
        mine = self._rename(names, model_sd, optimizers)
        if mine is None or not (_same(mine[0], theirs[0]) and _same(mine[1], theirs[1])):
            return None
        return names

    @staticmethod
    def _rename(
        names: _Names, model_sd: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer]
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """``model_sd`` and the optimizers' state dicts named as torch names them (flattened);
        None for a value torch's flattening treats otherwise (a nested dict) or refuses."""
        if names.model:
            model_out = {k: v for k, v in model_sd.items() if k not in names.model}
            model_out.update((names.model[k], v) for k, v in model_sd.items() if k in names.model)
        else:
            model_out = model_sd
        state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for optimizer, params in zip(optimizers, names.params):
            osd = optimizer.state_dict()
            for index, values in osd[_STATE].items():
                prefix = f"{_STATE}.{params[index]}."
                for key, value in values.items():
                    if isinstance(value, dict) or not isinstance(value, (torch.Tensor, int, float)):
                        return None
                    state[f"{prefix}{key}"] = value
            for group in osd[_GROUPS]:
                indices = group.pop("params")
                for index in indices:
                    prefix = f"{_GROUPS}.{params[index]}."
                    for key, value in group.items():
                        groups[f"{prefix}{key}"] = value
        state.update(groups)
        return model_out, state
