"""Make a Hugging Face causal LM's stages runnable in a pipeline (the ``patch_*`` pipeline fields).

A stage is a pruned deep copy of the whole model (:mod:`engine.pipeline.split`): a later stage has
no token embedding, an earlier one no final norm or ``lm_head``, and its layer list holds only some
layers. Hugging Face's own ``forward`` methods assume the whole tree and return ``ModelOutput``
objects, which cannot cross stages. The patches (one per ``pipeline.patch_*`` field, described
with :class:`~engine.pipeline.PipelineConfig`), bound to each stage's copy only (the class and the
original model are untouched), replace them; the last stage's loss is then :func:`causal_lm_loss`,
the model's own shifted cross-entropy, so pipeline and single-process losses agree.

Decoders in the Llama layout (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``: Llama,
Mistral, Qwen2, ...) are supported; others are refused with the field to change.
``transformers`` is imported only when a patched forward first runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookloop.engine.errors import ConfigError

__all__ = [
    "IGNORE_INDEX",
    "causal_lm_loss",
    "check_hf_pipeline",
    "is_hf_causal_lm",
    "patch_stage_backward",
    "patch_stage_module",
]

#: Label value without a loss (Hugging Face's and ``F.cross_entropy``'s default).
IGNORE_INDEX = -100
_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel`` with a causal-LM head (``lm_head``),
    told by duck typing so ``transformers`` is never imported here."""
    return (
        isinstance(getattr(model, "base_model_prefix", None), str)
        and hasattr(model, "config")
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    )


def inner_model(model: nn.Module) -> nn.Module:
    """The decoder under a causal-LM wrapper (``model.model`` for Llama)."""
    return getattr(model, model.base_model_prefix)


def check_hf_pipeline(model: nn.Module, config: Any, prefix: str = "pipeline") -> None:
    """Refuse, naming the field, a Hugging Face causal LM the pipeline cannot run: unpatched
    forwards, a decoder outside the Llama layout, or an attention mask the stages would drop."""
    name = type(model).__name__
    if not config.patch_causal_lm_model:
        raise ConfigError(
            f"{prefix}.patch_causal_lm_model",
            f"is false but {name}.forward returns a CausalLMOutput (and a loss), which cannot cross "
            "pipeline stages; set it to true so stages return logits / hidden states",
        )
    if not config.patch_inner_model:
        raise ConfigError(
            f"{prefix}.patch_inner_model",
            f"is false but {type(inner_model(model)).__name__}.forward needs its embedding and every "
            "layer, which a stage does not hold; set it to true",
        )
    inner = inner_model(model)
    missing = [p for p in _DECODER_PARTS if not hasattr(inner, p)]
    if missing:
        raise ConfigError(
            f"{prefix}.patch_inner_model",
            f"can patch decoders laid out as {', '.join(_DECODER_PARTS)} (Llama, Mistral, Qwen2, ...); "
            f"{type(inner).__name__} lacks {', '.join(missing)}: use such a model, or split a model "
            "whose own forward skips absent parts (see examples/models/gpt.py)",
        )


def layers_as_module_dict(stage: nn.Module, container: str) -> None:
    """Replace the decoder's ``nn.ModuleList`` of layers with an ``nn.ModuleDict`` keyed "0", "1",
    ... in place, so pruning a stage keeps every layer's parameter names."""
    parent_name, _, attr = container.rpartition(".")
    parent = stage.get_submodule(parent_name) if parent_name else stage
    layers = getattr(parent, attr)
    if isinstance(layers, nn.ModuleList):
        setattr(parent, attr, nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)}))


def patch_stage_module(stage: nn.Module, *, patch_inner: bool, patch_causal_lm: bool) -> None:
    """Bind the pipeline forwards to this stage's modules (instances only, not the classes)."""
    if patch_inner:
        inner = inner_model(stage)
        inner.forward = types.MethodType(_decoder_stage_forward, inner)
    if patch_causal_lm:
        stage.forward = types.MethodType(_causal_lm_stage_forward, stage)


def _decoder_stage_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None = None):
    """Token ids (first stage) or hidden states (later stages) -> hidden states."""
    from transformers.masking_utils import create_causal_mask

    hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(
        config=self.config,
        inputs_embeds=hidden,
        attention_mask=None,
        past_key_values=None,
        position_ids=position_ids,
    )
    position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
    for layer in self.layers.values():
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            use_cache=False,
        )
    if self.norm is not None:
        hidden = self.norm(hidden)
    return hidden


def _causal_lm_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Token ids or hidden states -> logits on the stage holding ``lm_head``, else hidden states."""
    hidden = inner_model(self)(x)
    if not isinstance(hidden, torch.Tensor):  # an unpatched decoder's BaseModelOutput
        hidden = hidden.last_hidden_state
    return self.lm_head(hidden) if self.lm_head is not None else hidden


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a Hugging Face causal LM computes for ``labels``: logits at position t predict label
    t + 1 (labels are given unshifted), mean cross-entropy over labels that are not -100."""
    shift_logits = logits[..., :-1, :].float()
    shift_labels = labels[..., 1:].to(shift_logits.device)
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


def patch_stage_backward(stage: Any) -> None:
    """Bind :func:`_backward_maybe_with_nosync` to one ``PipelineStage`` (the class is untouched)."""
    stage.backward_maybe_with_nosync = types.MethodType(_backward_maybe_with_nosync, stage)


def _backward_maybe_with_nosync(
    self: Any, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
) -> tuple[Any, Any]:
    """A stage backward that syncs data-parallel gradients only on the step's last microbatch:
    DDP under ``no_sync`` before it; FSDP2 with ``set_requires_gradient_sync(last_backward)`` (and
    resharding only then), so the reduce-scatter runs inside the last backward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import stage as stage_mod
    from torch.nn.parallel import DistributedDataParallel

    submod = self.submod

    def run() -> tuple[Any, Any]:
        if backward_type == "full":
            grads = stage_mod.stage_backward(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
            )
            return grads, None
        if backward_type == "input":
            return stage_mod.stage_backward_input(
                bwd_kwargs["stage_output"],
                bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"],
                submod.parameters(),
            )
        if backward_type == "weight":
            return stage_mod.stage_backward_weight(submod.parameters(), bwd_kwargs["param_groups"]), None
        raise RuntimeError(f"unknown backward type {backward_type!r}")

    if isinstance(submod, DistributedDataParallel):
        if not last_backward:
            with submod.no_sync():
                return run()
        # The reducer expects a forward's outputs before a syncing backward (torch does the same).
        submod.reducer.prepare_for_backward(
            list(nn.parallel.distributed._find_tensors(bwd_kwargs["stage_output"]))
        )
        return run()
    if isinstance(submod, FSDPModule):
        submod.set_requires_gradient_sync(last_backward)
        submod.set_is_last_backward(last_backward)
        submod.set_reshard_after_backward(last_backward)
    return run()
