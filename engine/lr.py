"""Learning-rate schedules: linear warmup, then a decay style, as a ``LambdaLR``.

As a ``LambdaLR`` the schedule checkpoints like any torch scheduler. ``lr_at(s)`` is the learning
rate after ``s`` scheduler steps, i.e. the one used by optimizer step ``s + 1``:

- warmup (``s <= warmup_steps``): ``warmup_init + (peak - warmup_init) * s / warmup_steps``
- ``constant``: ``peak``
- ``linear`` / ``cosine``: from ``peak`` at ``warmup_steps`` to ``min_lr`` at ``decay_steps``, with
  ratio ``r = (s - warmup_steps) / (decay_steps - warmup_steps)``: ``1 - r`` or
  ``(1 + cos(pi r)) / 2``
- ``inverse-square-root``: ``peak * sqrt(max(warmup_steps, 1) / max(s, 1))``, floored at ``min_lr``
- ``WSD`` (warmup-stable-decay): ``peak`` until ``decay_steps - wsd_decay_steps``, then the
  ``wsd_decay_style`` (``linear``, ``cosine`` or ``exponential``: ``2 * 0.5**r - 1``) down to
  ``min_lr`` at ``decay_steps``
- after ``decay_steps``: ``min_lr``

``peak`` is each parameter group's initial learning rate; ``min_lr`` and ``warmup_init`` are
absolute values for the reference rate ``peak_lr`` (the first group's, by default) and scale with
every other group's rate.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from hookloop.engine.errors import ConfigError

__all__ = ["DECAY_STYLES", "WSD_DECAY_STYLES", "build_lr_scheduler", "lr_at"]

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential")


def _check(
    peak_lr: float,
    warmup_steps: int,
    decay_steps: int | None,
    decay_style: str,
    min_lr: float,
    warmup_init: float,
    wsd_decay_steps: int | None,
    wsd_decay_style: str,
) -> None:
    if decay_style not in DECAY_STYLES:
        raise ConfigError("lr.decay_style", f"must be one of {', '.join(DECAY_STYLES)}, got {decay_style!r}")
    if wsd_decay_style not in WSD_DECAY_STYLES:
        raise ConfigError(
            "lr.wsd_decay_style", f"must be one of {', '.join(WSD_DECAY_STYLES)}, got {wsd_decay_style!r}"
        )
    if not peak_lr > 0:
        raise ConfigError("optimizer.lr", f"must be > 0, got {peak_lr!r}")
    if warmup_steps < 0:
        raise ConfigError("lr.warmup_steps", f"must be >= 0, got {warmup_steps!r}")
    if not 0 <= min_lr <= peak_lr:
        raise ConfigError("lr.min_lr", f"must be between 0 and the peak lr {peak_lr}, got {min_lr!r}")
    if warmup_init < 0:
        raise ConfigError("lr.warmup_init", f"must be >= 0, got {warmup_init!r}")
    if decay_style in ("linear", "cosine", "WSD"):
        if decay_steps is None:
            raise ConfigError(
                "lr.decay_steps", f"is required for decay_style={decay_style!r} (e.g. max_steps)"
            )
        if decay_steps <= warmup_steps:
            raise ConfigError(
                "lr.decay_steps", f"({decay_steps}) must be larger than lr.warmup_steps ({warmup_steps})"
            )
    if decay_style == "WSD":
        if wsd_decay_steps is None or wsd_decay_steps < 1:
            raise ConfigError(
                "lr.wsd_decay_steps", f"must be >= 1 for decay_style='WSD', got {wsd_decay_steps!r}"
            )
        assert decay_steps is not None
        if wsd_decay_steps > decay_steps - warmup_steps:
            raise ConfigError(
                "lr.wsd_decay_steps",
                f"({wsd_decay_steps}) must fit after warmup: at most decay_steps - warmup_steps "
                f"= {decay_steps - warmup_steps}",
            )


def lr_at(
    s: int,
    *,
    peak_lr: float,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    decay_style: str = "cosine",
    min_lr: float = 0.0,
    warmup_init: float = 0.0,
    wsd_decay_steps: int | None = None,
    wsd_decay_style: str = "exponential",
) -> float:
    """The learning rate after ``s`` scheduler steps (see the module docstring)."""
    if warmup_steps > 0 and s <= warmup_steps:
        return warmup_init + (peak_lr - warmup_init) * s / warmup_steps
    if decay_style == "constant":
        return peak_lr
    if decay_style == "inverse-square-root":
        return max(min_lr, peak_lr * math.sqrt(max(warmup_steps, 1) / max(s, 1)))
    assert decay_steps is not None
    if s > decay_steps:
        return min_lr
    if decay_style == "WSD":
        assert wsd_decay_steps is not None
        anneal_start = decay_steps - wsd_decay_steps
        if s <= anneal_start:
            coeff = 1.0
        else:
            r = (s - anneal_start) / wsd_decay_steps
            coeff = _decay(wsd_decay_style, r)
    else:
        r = (s - warmup_steps) / (decay_steps - warmup_steps)
        coeff = _decay(decay_style, r)
    return min_lr + coeff * (peak_lr - min_lr)


def _decay(style: str, r: float) -> float:
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    return 2.0 * (0.5**r) - 1.0  # exponential


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    decay_style: str = "cosine",
    min_lr: float = 0.0,
    warmup_init: float = 0.0,
    wsd_decay_steps: int | None = None,
    wsd_decay_style: str = "exponential",
    peak_lr: float | None = None,
) -> LambdaLR:
    """A ``LambdaLR`` that follows :func:`lr_at` for every parameter group."""
    peak = float(peak_lr if peak_lr is not None else optimizer.param_groups[0]["lr"])
    _check(
        peak, warmup_steps, decay_steps, decay_style, min_lr, warmup_init, wsd_decay_steps, wsd_decay_style
    )
    params = dict(
        peak_lr=peak,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_style=decay_style,
        min_lr=min_lr,
        warmup_init=warmup_init,
        wsd_decay_steps=wsd_decay_steps,
        wsd_decay_style=wsd_decay_style,
    )
    return LambdaLR(optimizer, lambda s: lr_at(s, **params) / peak)
