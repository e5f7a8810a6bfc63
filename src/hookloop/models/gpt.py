"""A small GPT for the examples, tests and benchmarks (``model.target: hookloop.models.gpt:recipe``).

Built from parts a pipeline split can remove: ``tok_emb``/``pos_emb`` (first stage), ``blocks``
(a ``ModuleDict`` keyed "0", "1", ... so names stay stable when a stage keeps only some),
``norm`` and ``head`` (last stage). ``forward`` skips whatever part is ``None``: on the first stage
it takes token ids, elsewhere hidden states.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from hookloop.recipe import ModelRecipe, token_cross_entropy

__all__ = ["GPT", "GPTConfig", "build", "cross_entropy_loss", "recipe"]


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
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
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
    GPTConfig(**args)  # raises ValueError naming the model field


#: What ``model.target: hookloop.models.gpt:recipe`` trains.
recipe = ModelRecipe(build=build, loss_fn=cross_entropy_loss, check=_check)
