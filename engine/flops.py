"""FLOPs per token of a model and the peak FLOP/s of an accelerator: what TFLOP/s and MFU divide by."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["estimate_flops_per_token", "peak_flops_for_device"]

# Dense bf16/fp16 tensor-core peak FLOP/s per device, by a substring of the CUDA device name.
# Checked in order, so more specific names come first.
_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_flops_for_device(device: torch.device | str | None = None) -> float | None:
    """Peak dense FLOP/s of a known accelerator, or None (always None on CPU: give it in config)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_FLOPS:
        if key in name:
            return peak
    return None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def estimate_flops_per_token(model: torch.nn.Module, seq_len: int | None = None) -> float:
    """Training FLOPs per token: ``6 * N`` (non-embedding parameters) plus the attention term
    ``12 * layers * d_model * seq_len`` when the model's config tells the shape.

    A model with its own ``flops_per_token()`` method is asked directly.
    """
    model = _unwrap(model)
    if callable(getattr(model, "flops_per_token", None)):
        return float(model.flops_per_token())
    embedding = sum(
        p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    )
    n = sum(p.numel() for p in model.parameters()) - embedding
    flops = 6.0 * n
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    layers = _first_attr(cfg, ("n_layers", "num_layers", "num_hidden_layers", "n_layer"))
    width = _first_attr(cfg, ("d_model", "hidden_size", "n_embd", "dim"))
    seq_len = seq_len or _first_attr(
        cfg, ("seq_len", "max_seq_len", "max_position_embeddings", "n_positions")
    )
    if layers and width and seq_len:
        flops += 12.0 * layers * width * seq_len
    return flops


def _first_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
