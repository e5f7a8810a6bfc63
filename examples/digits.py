"""A small classifier through ``hookloop train``: scikit-learn's bundled handwritten digits (1,797
8x8 images, 10 classes; shipped with scikit-learn, nothing downloaded), an MLP, cross entropy, and
validation accuracy from ignite's ``Accuracy`` ranking the checkpoints it keeps.

    hookloop train examples/configs/digits.yaml        # from the repository root

``digits`` is the config's ``data.target`` (a map-style dataset of ``(image, label)`` samples) and
``recipe`` its ``model.target``; neither knows anything about hookloop's data or loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hookloop.recipe import ModelRecipe


def digits(seed: int = 0) -> TensorDataset:
    """Every digit as ``(pixels [64] in [0, 1], label)``, in an order shuffled once by ``seed`` so
    that the tail hookloop holds out for validation (``data.val_fraction``) has every class."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    x = torch.tensor(images, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(labels, dtype=torch.long)[order]
    return TensorDataset(x, y)


def build(hidden: int = 128, dropout: float = 0.1) -> torch.nn.Module:
    """An MLP from 64 pixels to 10 class logits."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 10),
    )


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


# 6N FLOPs per "token" would count pixels as tokens: the MFU of a model this small says nothing.
recipe = ModelRecipe(build=build, loss_fn=classification_loss)
