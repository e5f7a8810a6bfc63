"""The JSON form of the state a checkpoint keeps beside DCP's files (per-rank state: counters, the
LR scheduler, handlers' state, the data position, RNG states): tensors, numpy arrays, tuples and
non-string dict keys tagged so they come back exactly."""

from __future__ import annotations

import base64
import math
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
        raw = t.reshape(-1).view(torch.uint8) if t.numel() and t.dtype != torch.bool else t  # 0-dim too
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
    """What :func:`encode` was given. A tagged value that does not describe its own bytes (a dtype
    that is not one, a shape whose size is not the data's, an object array) is a ValueError, so a
    crafted file costs no more memory than its size."""
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        dtype = getattr(torch, str(obj["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a tensor's dtype {str(obj['dtype'])[:80]!r} is not a torch dtype")
        shape = _shape(obj["shape"])
        data = bytearray(base64.b64decode(obj["__tensor__"]))
        _sized(data, shape, dtype.itemsize)
        if not data:
            return torch.empty(shape, dtype=dtype)
        if dtype == torch.bool:
            return torch.frombuffer(data, dtype=torch.bool).reshape(shape).clone()
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if "__ndarray__" in obj:
        dtype = np.dtype(obj["dtype"])
        if dtype.hasobject:
            raise ValueError(f"an array's dtype {obj['dtype']!r} holds Python objects")
        shape = _shape(obj["shape"])
        raw = base64.b64decode(obj["__ndarray__"])
        _sized(raw, shape, dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(decode(k)): decode(v) for k, v in obj["__items__"]}
    return {k: decode(v) for k, v in obj.items()}


def _shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or len(shape) > 64:
        raise ValueError(f"a shape must be a list of at most 64 sizes, got {str(shape)[:80]}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"a shape's sizes must be non-negative integers, got {str(shape)[:80]}")
    return shape


def _sized(data: bytes | bytearray, shape: list[int], itemsize: int) -> None:
    size = math.prod(shape) * itemsize
    if len(data) != size:
        raise ValueError(f"shape {shape[:8]} takes {size} bytes, the data has {len(data)}")


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
