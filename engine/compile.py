"""``torch.compile`` for a model, per transformer block or whole.

    compile_model(model, "blocks")  # each block compiled in place (torchtitan's way)
    compile_model(model, "model")   # the whole module compiled in place

Both use ``nn.Module.compile()``, which compiles the module's call in place instead of wrapping it
in an ``OptimizedModule``: parameter and state-dict names carry no ``_orig_mod.``, so a checkpoint
written by a compiled run loads into an uncompiled one and the other way round. "blocks" compiles
one block's graph once and reuses it for every block of the same shape (shorter warm-up than
"model", and graph breaks stay inside one block). Apply activation checkpointing first
(:mod:`engine.activation_checkpointing`): a checkpoint-wrapped block is compiled with its wrapper.

The first step of a compiled run includes the compilation; the shipped
metrics handler reports it once and leaves it out of its averages.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hookloop.engine.config import COMPILE_MODES, compile_mode

__all__ = ["COMPILE_MODES", "compile_mode", "compile_model"]


def compile_model(model: nn.Module, mode: str | bool = "blocks", **compile_kwargs: Any) -> nn.Module:
    """Compile ``model`` in place (``mode`` "blocks" or "model", see the module docstring; also a
    ``train.compile`` setting: True is "blocks", False leaves the model alone) and return it;
    ``compile_kwargs`` go to ``torch.compile`` (e.g. ``fullgraph=True``)."""
    resolved = compile_mode(mode, "mode")
    if resolved is None:
        return model
    if resolved == "model":
        model.compile(**compile_kwargs)
        return model
    from hookloop.engine.activation_checkpointing import transformer_blocks

    for _parent, _name, block in transformer_blocks(model):
        block.compile(**compile_kwargs)
    return model
