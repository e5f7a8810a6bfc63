"""Sources of the small user models tests write into a project directory (``my_models.py``), as a
user of ``model.target: my_models.py:build`` would."""

from __future__ import annotations

__all__ = ["tiny_lm_source"]


def tiny_lm_source(seq_len: int = 16) -> str:
    """A byte-level language model (embedding, ReLU, head) built by ``build(dim=8, seq_len=...)``."""
    return f"""
import torch

class TinyLM(torch.nn.Module):
    def __init__(self, dim, seq_len, vocab=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(torch.relu(self.embed(tokens)))

def build(dim: int = 8, seq_len: int = {seq_len}):
    return TinyLM(dim, seq_len)
"""


def tiny_lm_config(
    max_steps: int,
    ckpt_every_steps: int | None = None,
    val_every_steps: int | None = None,
    target: str = "my_models.py:build",
) -> str:
    """The start of a run config that trains a model of width 8 (:func:`tiny_lm_source`'s by default)
    on sequences of 8 bytes with a global batch of 8 in local batches of 2 and no warm-up, up to
    its ``lr`` section (a test may add to it) and the sections of the test's own."""

    def value(n: int | None) -> str:
        return "null" if n is None else str(n)

    return f"""
model:
  target: {target}
  dim: 8
train:
  seq_len: 8
  local_batch_size: 2
step_scheduler:
  global_batch_size: 8
  max_steps: {max_steps}
  num_epochs: null
  ckpt_every_steps: {value(ckpt_every_steps)}
  val_every_steps: {value(val_every_steps)}
lr:
  warmup_steps: 0
"""
