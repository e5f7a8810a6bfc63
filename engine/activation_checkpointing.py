"""Activation checkpointing: recompute a transformer block's activations in backward instead of
keeping them from forward.

    apply_activation_checkpointing(model, "full")       # every block
    apply_activation_checkpointing(model, "selective")  # every other block: blocks 0, 2, 4, ...
    apply_activation_checkpointing(model, "none")       # leave the model as it is

Each chosen block is replaced, in its parent, by torch's own ``checkpoint_wrapper``
(``CheckpointImpl.NO_REENTRANT``): its forward keeps only the block's inputs for backward and runs
the block again during backward. The blocks are the children of the layer container that pipeline
splitting finds (:func:`engine.pipeline.split.find_layer_container`, e.g. the GPT's ``blocks``), or
every module of ``module_types``.

"selective" here is *layer-level*: half the blocks trade compute for memory, the others keep their
activations. torchtitan's op-level selective AC (keep the outputs of matmuls and attention,
recompute the cheap pointwise ops, through ``torch.utils.checkpoint``'s ``context_fn`` policies) is
a possible later refinement.

Apply it before compiling (:mod:`engine.compile`) and before wrapping for data parallel. The wrapper
adds ``_checkpoint_wrapped_module`` to parameter names, but its state-dict hooks strip it again, so
``state_dict()`` and ``torch.distributed.checkpoint.state_dict.get_state_dict`` give the same keys
with AC on or off: checkpoints load across the setting.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from hookloop.engine.checks import check_choice
from hookloop.engine.config import AC_MODES

__all__ = ["AC_MODES", "apply_activation_checkpointing", "saved_activation_bytes", "transformer_blocks"]


def transformer_blocks(
    model: nn.Module, module_types: Iterable[type[nn.Module]] | None = None
) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, block)`` for every transformer block of ``model``, in order: the children of
    its layer container, or (with ``module_types``) every module of those types that is not inside
    another one."""
    if module_types is None:
        from hookloop.engine.pipeline.split import find_layer_container

        container = getattr(model, find_layer_container(model))
        return [(container, name, child) for name, child in container.named_children()]
    types = tuple(module_types)
    found: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, types) or isinstance(_inner(child), types):
                found.append((parent, name, child))
            else:
                visit(child)

    visit(model)
    return found


def _inner(module: nn.Module) -> nn.Module:
    """The block a checkpoint wrapper holds (the module itself otherwise)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def apply_activation_checkpointing(
    model: nn.Module,
    mode: str = "full",
    module_types: Iterable[type[nn.Module]] | None = None,
) -> nn.Module:
    """Wrap the model's transformer blocks in non-reentrant checkpoint wrappers, in place, and
    return the model. ``mode``: ``"full"`` (every block), ``"selective"`` (every other block,
    starting with the first) or ``"none"``. Blocks already wrapped are left as they are."""
    check_choice("train.activation_checkpointing", mode, AC_MODES)
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    for i, (parent, name, block) in enumerate(transformer_blocks(model, module_types)):
        if isinstance(block, CheckpointWrapper) or (mode == "selective" and i % 2):
            continue
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(parent, name, wrapped)  # a ModuleDict/ModuleList entry too: setattr replaces it
    return model


def saved_activation_bytes(model: nn.Module, *inputs: Any) -> int:
    """Bytes of activations one forward pass of ``model(*inputs)`` keeps for backward.

    Counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves, once
    (views of one storage region are counted once), parameters left out (they are kept anyway).
    Inside a checkpointed block the checkpoint's own hooks take over, so those tensors are not
    saved; what it keeps instead, the block's inputs, is counted from a forward pre-hook on each
    wrapper. The recomputation in backward saves again, one block at a time: that transient peak
    is not counted."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    params = {p.data_ptr() for p in model.parameters()}
    seen: set[tuple[int, int, tuple[int, ...], torch.dtype]] = set()
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.data_ptr() in params:
            return
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    def pre_hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
        for a in args:
            count(a)

    handles = [
        m.register_forward_pre_hook(pre_hook) for m in model.modules() if isinstance(m, CheckpointWrapper)
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
    finally:
        for h in handles:
            h.remove()
    del out
    return total
