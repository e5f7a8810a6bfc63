"""Capturing and restoring RNG states: python, numpy, torch (CPU and every CUDA device) and the
generators that decide a data source's order, in the JSON form
:mod:`hookloop.engine.checkpoint_format.state_codec` writes. Checkpoints keep them per rank; a data
source replaying a pass keeps them too."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from hookloop.engine.checkpoint_format.state_codec import decode, encode

__all__ = ["capture_rng", "data_generators", "restore_rng"]


def capture_rng(generators: Iterable[torch.Generator] = ()) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, every CUDA device) and those of
    ``generators``, in the JSON-able form :func:`encode` produces."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": [g.get_state() for g in generators],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return encode(state, "rng")


def restore_rng(encoded: dict[str, Any], generators: Iterable[torch.Generator] = ()) -> None:
    state = decode(encoded)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])
    for g, s in zip(generators, state.get("generators", ())):
        g.set_state(s)


def data_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that decide a data source's order (a DataLoader's
    ``generator``, its sampler's and batch sampler's), each once."""
    found: list[torch.Generator] = []
    candidates = [data]
    for attr in ("sampler", "batch_sampler"):
        sub = getattr(data, attr, None)
        if sub is not None:
            candidates.append(sub)
            candidates.append(getattr(sub, "sampler", None))
    for obj in candidates:
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return found
