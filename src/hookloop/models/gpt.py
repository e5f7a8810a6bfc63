"""A small GPT for the examples, tests and benchmarks (``model.target: hookloop.models.gpt:recipe``).

Built from parts a pipeline split can remove: ``tok_emb``/``pos_emb`` (first stage), ``blocks``
(a ``ModuleDict`` keyed "0", "1", ... so names stay stable when a stage keeps only some),
``norm`` and ``head`` (last stage). ``forward`` skips whatever part is ``None``: on the first stage
it takes token ids, elsewhere hidden states.

Each block's fused ``qkv_heads`` projection is head-major (head 0's query, key and value rows, then
head 1's, ...), so :func:`tp_plan`'s column split gives every tensor-parallel rank whole heads. The
fused projection of earlier versions was called ``qkv`` and held ``[all queries | all keys | all
values]``: same shape, other meaning, so it has another name, and the checkpointer refuses such a
checkpoint as another model layout instead of reading its heads wrongly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookloop.engine.errors import ConfigError
from hookloop.recipe import ModelRecipe, token_cross_entropy

__all__ = ["GPT", "GPTConfig", "build", "cross_entropy_loss", "recipe", "tp_plan"]


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})"
            )


class Block(nn.Module):
    """Pre-norm transformer block. ``qkv_heads`` holds each head's query, key and value rows
    together (head-major), so a column-parallel split of it gives every rank whole heads; the
    forward reads the number of heads it holds from its output width."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv_heads = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_heads(self.ln1(x))
        b, t, width = qkv.shape  # under tensor parallelism: this rank's heads (and all positions)
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, heads * self.head_dim))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Module | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + (self.pos_emb(pos) if self.pos_emb is not None else 0)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for m in (self.tok_emb, self.pos_emb) if m is not None for p in m.parameters())
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N plus the attention term 12 * layers * d_model * seq_len."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layers * c.d_model * c.seq_len


#: Next-token cross entropy of logits ``[batch, seq, vocab]`` against ids ``[batch, seq]``.
cross_entropy_loss = token_cross_entropy


def build(
    n_layers: int = 4,
    d_model: int = 128,
    n_heads: int = 4,
    dropout: float = 0.0,
    vocab_size: int = 256,
    seq_len: int = 128,
) -> GPT:
    """A freshly initialized :class:`GPT` (``seq_len`` defaults to ``train.seq_len`` in a config)."""
    return GPT(GPTConfig(vocab_size, seq_len, n_layers, d_model, n_heads, dropout))


def _check(args: dict, cfg: object) -> None:
    config = GPTConfig(**args)  # raises ValueError naming the model field
    distributed = getattr(cfg, "distributed", None)
    tp = getattr(distributed, "tp_size", 1)
    if tp > 1:
        for name in ("n_heads", "vocab_size"):
            if getattr(config, name) % tp:
                raise ConfigError(
                    f"model.{name}",
                    f"({getattr(config, name)}) must be a multiple of distributed.tp_size ({tp}): "
                    "each tensor-parallel rank holds an equal part",
                )
        if getattr(distributed, "sequence_parallel", False) and config.seq_len % tp:
            raise ConfigError(
                "train.seq_len",
                f"({config.seq_len}) must be a multiple of distributed.tp_size ({tp}) with "
                "distributed.sequence_parallel: each rank holds an equal slice of the positions",
            )


def tp_plan(model: GPT, tp_mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> GPT:
    """Tensor-parallel plan of :class:`GPT` (the whole model or one pipeline stage's part):
    token embedding row-parallel (the vocabulary sharded; the position embedding too with sequence
    parallelism, else it and the layer norms stay whole on every rank), in each block ``qkv_heads``
    and ``mlp.0`` column-parallel (whole heads, a slice of the hidden units per rank), ``proj`` and ``mlp.2``
    row-parallel, the head column-parallel with its logits gathered (every rank computes the loss on
    the whole vocabulary). With ``sequence_parallel`` the residual stream between the parallel
    regions is split along the positions and the layer norms run on each rank's slice. With
    ``loss_parallel`` the head's logits stay a DTensor sharded over the vocabulary, for a cross
    entropy computed on the shards (``Trainer(loss_parallel=True)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    # A block may sit in an activation-checkpointing wrapper: parallelize the block it holds.
    blocks = [getattr(b, "_checkpoint_wrapped_module", b) for b in model.blocks.values()]
    for block in blocks:
        if block.n_heads % tp:
            raise ConfigError(
                "distributed.tp_size", f"({tp}) must divide the number of attention heads ({block.n_heads})"
            )
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    block_plan: dict[str, Any] = {
        "qkv_heads": ColwiseParallel(input_layouts=stream),
        "proj": RowwiseParallel(output_layouts=stream),
        "mlp.0": ColwiseParallel(input_layouts=stream),
        "mlp.2": RowwiseParallel(output_layouts=stream),
    }
    if sp:
        block_plan.update(ln1=SequenceParallel(), ln2=SequenceParallel())
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan)
    plan: dict[str, Any] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.pos_emb is not None and sp:  # positions [t] -> [t, d]: their dimension 0 is the sequence
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        if loss_parallel:
            plan["head"] = ColwiseParallel(
                input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
            )
        else:
            plan["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)
    return model


#: What ``model.target: hookloop.models.gpt:recipe`` trains.
recipe = ModelRecipe(build=build, loss_fn=cross_entropy_loss, check=_check, tp_plan=tp_plan)
