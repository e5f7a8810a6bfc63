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
