"""A Hugging Face causal LM built from its config class (nothing downloaded), as a recipe::

    model:
      target: hookloop.models.hf:recipe
      architecture: llama          # or gpt2
      hidden_size: 64              # every other key is a field of LlamaConfig / GPT2Config
      num_hidden_layers: 2

Needs ``transformers`` (``pip install "hookloop[hf]"``). The vocabulary is bytes (256 tokens), so
no tokenizer is needed, and the positions are ``train.seq_len``. Microbatches follow the Hugging
Face convention, ``{"input_ids", "labels"}`` with labels equal to the inputs (the model shifts
them), and the model computes its own loss (``loss_fn=None``). Under ``distributed.pp_size > 1`` the
Llama layout is split into stages whose last computes the same shifted cross entropy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from hookloop.engine.errors import ConfigError
from hookloop.recipe import ModelRecipe

__all__ = [
    "ARCHITECTURES",
    "VOCAB_SIZE",
    "build",
    "check_llama_tp",
    "hf_collate",
    "hf_model_config",
    "llama_tp_plan",
    "recipe",
]

VOCAB_SIZE = 256  # bytes: the token files hold one byte per token
ARCHITECTURES = ("llama", "gpt2")
_SET_HERE = ("vocab_size", "max_position_embeddings", "n_positions")


def hf_model_config(architecture: str = "llama", seq_len: int = 128, pp_size: int = 1, **fields: Any) -> Any:
    """A ``transformers`` config (``LlamaConfig`` / ``GPT2Config``) from the ``model`` section's
    fields, every key checked (the config classes accept unknown ones silently)."""
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            "model.architecture", f"must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}"
        )
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.target", "hookloop.models.hf needs transformers: pip install 'hookloop[hf]'"
        ) from None
    cls = transformers.LlamaConfig if architecture == "llama" else transformers.GPT2Config
    known = set(cls().to_dict())
    for key in fields:
        if key not in known:
            raise ConfigError(f"model.{key}", f"is not a field of {cls.__name__}; check the spelling")
        if key in _SET_HERE:
            raise ConfigError(
                f"model.{key}", "is set by hookloop (byte vocabulary 256, positions train.seq_len)"
            )
    positions = {"max_position_embeddings" if architecture == "llama" else "n_positions": seq_len}
    extra = {"bos_token_id": None, "eos_token_id": None} if architecture == "gpt2" else {}
    # Untied embeddings: the input embedding and lm_head sit on different pipeline stages.
    config = cls(vocab_size=VOCAB_SIZE, tie_word_embeddings=False, **positions, **{**extra, **fields})
    if architecture == "gpt2" and pp_size > 1:
        raise ConfigError(
            "model.architecture",
            "gpt2 cannot be split into pipeline stages here (the stage forward is patched for the Llama "
            "layout); use model.architecture=llama with distributed.pp_size > 1",
        )
    heads = getattr(config, "num_attention_heads", None)
    if heads and config.hidden_size % heads:
        raise ConfigError(
            "model.hidden_size" if architecture == "llama" else "model.n_embd",
            f"({config.hidden_size}) must be a multiple of the number of attention heads ({heads})",
        )
    return config


def build(architecture: str = "llama", seq_len: int = 128, **fields: Any) -> torch.nn.Module:
    """A freshly initialized causal LM."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_model_config(architecture, seq_len, **fields))


def _check(args: dict[str, Any], cfg: Any) -> None:
    config = hf_model_config(**args, pp_size=cfg.distributed.pp_size)
    tp = getattr(cfg.distributed, "tp_size", 1)
    if tp > 1:
        if args.get("architecture", "llama") != "llama":
            raise ConfigError(
                "model.architecture",
                "only the Llama layout ships a tensor-parallel plan (q_proj/k_proj/v_proj/o_proj, "
                "gate_proj/up_proj/down_proj); use model.architecture=llama with distributed.tp_size > 1",
            )
        check_llama_tp(config, tp)
        if getattr(cfg.distributed, "sequence_parallel", False):
            raise ConfigError("distributed.sequence_parallel", SP_REFUSED)


SP_REFUSED = (
    "is not supported for Hugging Face models: their decoder derives positions and the causal mask from "
    "the embedding output's length, which sequence parallelism splits; set it to false (tensor "
    "parallelism alone works)"
)


def check_llama_tp(config: Any, tp: int) -> None:
    """Every tensor-parallel rank must hold whole heads and an equal share of the MLP and the
    vocabulary: ``ConfigError`` naming the model field otherwise."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, value in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ):
        if value % tp:
            raise ConfigError(
                f"model.{name}",
                f"({value}) must be a multiple of distributed.tp_size ({tp}): each tensor-parallel rank "
                "holds an equal part",
            )


def llama_tp_plan(
    model: torch.nn.Module, tp_mesh: Any, *, sequence_parallel: bool = False
) -> torch.nn.Module:
    """Tensor-parallel plan of a Llama-family causal LM (Llama, Mistral, Qwen2, ...: the module
    names ``embed_tokens``, ``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.mlp.{gate,up,down}_proj``,
    ``lm_head``), the whole model or one pipeline stage's part: the embedding row-parallel
    (vocabulary sharded), q/k/v and gate/up column-parallel (whole heads and a slice of the MLP per
    rank; the attention reads its local head count from the projection's size), o and down
    row-parallel, ``lm_head`` column-parallel with its logits gathered so the model's own loss sees
    the whole vocabulary. The norms stay whole on every rank. Sequence parallelism is refused."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if sequence_parallel:
        raise ConfigError("distributed.sequence_parallel", SP_REFUSED)
    tp = tp_mesh.size()
    config = getattr(model, "config", None)
    if config is not None:
        check_llama_tp(config, tp)
    decoder = getattr(model, "model", None) or model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(
            "distributed.tp_size",
            f"{type(model).__name__} has no decoder layers (model.layers) for the Llama tensor-parallel plan",
        )
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers:
        parallelize_module(getattr(layer, "_checkpoint_wrapped_module", layer), tp_mesh, layer_plan)
    if getattr(decoder, "embed_tokens", None) is not None:
        parallelize_module(decoder.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if getattr(model, "lm_head", None) is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return model


def _flops_per_token(model: torch.nn.Module, args: dict[str, Any], cfg: Any) -> float:
    """6N without embeddings, plus the attention term 12 * layers * hidden * seq_len."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding
    return 6 * non_embedding + 12 * config.num_hidden_layers * config.hidden_size * cfg.train.seq_len


def hf_collate(samples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """``(input_ids, next_ids, source_idx)`` samples -> a Hugging Face microbatch: labels are the
    inputs themselves (the model shifts them); ``source_idx`` is metadata the model never sees."""
    input_ids, _, source_idx = default_collate(samples)
    return {"input_ids": input_ids, "labels": input_ids, "source_idx": source_idx}


#: What ``model.target: hookloop.models.hf:recipe`` trains.
recipe = ModelRecipe(
    build=build,
    loss_fn=None,
    collate_fn=hf_collate,
    check=_check,
    flops_per_token=_flops_per_token,
    tp_plan=llama_tp_plan,
)
