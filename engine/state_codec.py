"""The JSON form of the state a checkpoint keeps beside DCP's files (per-rank state: counters, the
LR scheduler, handlers' state, the data position, RNG states): tensors, numpy arrays, tuples and
non-string dict keys tagged so they come back exactly."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

__all__ = ["decode", "encode"]


def encode(obj: Any, where: str = "state") -> Any:
    """A JSON-able form of ``obj``: tensors, numpy arrays, tuples and non-string dict keys are
    tagged so :func:`decode` restores them exactly. Anything else is refused, naming ``where``."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.numel() and t.dtype != torch.bool else t
        data = raw.numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": base64.b64encode(data).decode(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(obj, np.ndarray):
        return {
            "__ndarray__": base64.b64encode(obj.tobytes()).decode(),
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(
            k.startswith("__") and k.endswith("__") for k in obj
        ):
            return {k: encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(
        f"{where} holds a {type(obj).__name__}, which a checkpoint cannot store safely; state_dict() "
        "must return tensors, numbers, strings, bools, None, lists, tuples and dicts of these"
    )


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        dtype = getattr(torch, obj["dtype"])
        data = bytearray(base64.b64decode(obj["__tensor__"]))
        if not data:
            return torch.empty(obj["shape"], dtype=dtype)
        if dtype == torch.bool:
            return torch.frombuffer(data, dtype=torch.bool).reshape(obj["shape"]).clone()
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        raw = base64.b64decode(obj["__ndarray__"])
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(decode(k)): decode(v) for k, v in obj["__items__"]}
    return {k: decode(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
