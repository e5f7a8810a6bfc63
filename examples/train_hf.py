"""Train a tiny Hugging Face causal LM (built from a config, nothing downloaded) on text every Python
install has, with the full handler set.

    python examples/train_hf.py                                            # examples/configs/hf_tiny.yaml
    python examples/train_hf.py step_scheduler.max_steps=50 train.run_dir=runs/try
    torchrun --nproc-per-node 2 examples/train_hf.py                       # DDP (gloo on CPU)
    torchrun --nproc-per-node 2 examples/train_hf.py distributed.dp_mode=fsdp   # FSDP2
    torchrun --nproc-per-node 2 examples/train_hf.py distributed.pp_size=2      # 2 pipeline stages

Needs ``transformers`` (``pip install -e ".[hf]"``). The model is a ``transformers`` causal LM
(``model.architecture``: ``llama`` or ``gpt2``; every other ``model`` key is a field of its config
class, e.g. ``model.num_hidden_layers=4``) over a byte-level vocabulary of 256, so no tokenizer is
needed. Microbatches follow the Hugging Face convention, ``{"input_ids", "labels"}`` with labels
equal to the inputs (the model shifts them), and the Trainer gets ``loss_fn=None``: the model
computes its own loss. Under ``distributed.pp_size=2`` the model is split into two stages (embedding
and first layer, last layer with norm and ``lm_head``) whose forwards are patched
(``pipeline.patch_inner_model``, ``pipeline.patch_causal_lm_model``); the last stage computes the
same shifted cross-entropy the model does, so the losses match a single process. Pipeline
parallelism needs the ``llama`` architecture. Everything else (data, handlers, checkpoints, exits)
is :mod:`examples.training`'s, shared with ``examples/train_gpt.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import ConfigError  # noqa: E402
from engine.parallel import exit_process  # noqa: E402
from examples.training import ModelRecipe, run  # noqa: E402
from handlers import RunConfig  # noqa: E402

__all__ = ["DEFAULT_CONFIG", "RECIPE", "build_hf_model", "hf_collate", "hf_model_config", "main"]

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "hf_tiny.yaml"
VOCAB_SIZE = 256  # bytes: the token files hold one byte per token
ARCHITECTURES = ("llama", "gpt2")


def hf_model_config(cfg: RunConfig) -> Any:
    """The ``model`` section as a ``transformers`` config (``LlamaConfig`` / ``GPT2Config``); every
    key is checked, since the config classes accept unknown ones silently."""
    model = dict(cfg.model)
    arch = model.pop("architecture", "llama")
    if arch not in ARCHITECTURES:
        raise ConfigError("model.architecture", f"must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model", "examples/train_hf.py needs transformers: pip install -e '.[hf]'"
        ) from None
    cls = transformers.LlamaConfig if arch == "llama" else transformers.GPT2Config
    known = set(cls().to_dict())
    for key in model:
        if key not in known:
            raise ConfigError(f"model.{key}", f"is not a field of {cls.__name__}; check the spelling")
        if key in ("vocab_size", "max_position_embeddings", "n_positions"):
            raise ConfigError(
                f"model.{key}", "is set by the example (byte vocabulary 256, positions train.seq_len)"
            )
    positions = {"max_position_embeddings" if arch == "llama" else "n_positions": cfg.train.seq_len}
    # Untied embeddings: the input embedding and lm_head sit on different pipeline stages.
    config = cls(vocab_size=VOCAB_SIZE, tie_word_embeddings=False, **positions, **model)
    if arch == "gpt2" and cfg.distributed.pp_size > 1:
        raise ConfigError(
            "model.architecture",
            "gpt2 cannot be split into pipeline stages here (the stage forward is patched for the Llama "
            "layout); use model.architecture=llama with distributed.pp_size > 1",
        )
    heads = getattr(config, "num_attention_heads", None)
    if heads and config.hidden_size % heads:
        raise ConfigError(
            "model.hidden_size" if arch == "llama" else "model.n_embd",
            f"({config.hidden_size}) must be a multiple of the number of attention heads ({heads})",
        )
    return config


def build_hf_model(cfg: RunConfig) -> tuple[torch.nn.Module, float]:
    """A freshly initialized causal LM and its training FLOPs per token (6N without embeddings, plus
    the attention term 12 * layers * hidden * seq_len)."""
    from transformers import AutoModelForCausalLM

    config = hf_model_config(cfg)
    model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight.numel()
    non_embedding = sum(p.numel() for p in model.parameters()) - embedding
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return model, 6 * non_embedding + 12 * layers * hidden * cfg.train.seq_len


def hf_collate(samples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """``(input_ids, next_ids, source_idx)`` samples -> a Hugging Face microbatch: labels are the
    inputs themselves (the model shifts them); ``source_idx`` is metadata the model never sees."""
    input_ids, _, source_idx = default_collate(samples)
    return {"input_ids": input_ids, "labels": input_ids, "source_idx": source_idx}


RECIPE = ModelRecipe(
    description="Train a tiny Hugging Face causal LM with hookloop.",
    default_config=DEFAULT_CONFIG,
    check=hf_model_config,
    build=build_hf_model,
    loss_fn=None,  # the model computes its loss from the labels
    collate_fn=hf_collate,
)


def main(argv: list[str] | None = None) -> int:
    return run(argv, RECIPE)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_process(main())
