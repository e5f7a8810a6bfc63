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
:class:`ScheduledRates` is the one writer of ``param_groups[i]["lr"]``; others change its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from hookloop.engine.config import (
    DECAY_STYLES,
    DECAYING_STYLES,
    WSD_DECAY_STYLES,
    check_lr_schedule,
    schedule_settings,
)

__all__ = [
    "DECAY_STYLES",
    "LRSchedule",
    "ScheduledRates",
    "WSD_DECAY_STYLES",
    "build_lr_scheduler",
    "check_lr_schedule",
    "lr_at",
    "schedule_settings",
]


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


class LRSchedule(LambdaLR):
    """The ``LambdaLR`` :func:`build_lr_scheduler` makes, knowing its own settings: ``settings`` are
    :func:`lr_at`'s arguments (``decay_steps`` resolved) and ``decay_steps_from`` names what a null
    ``decay_steps`` stood for (None when it was set), so a checkpoint can record the schedule it
    was trained with. Neither is part of :meth:`state_dict`: the schedule is the config's, its
    position (``last_epoch``) and base rates are the state."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, settings: dict, decay_steps_from: str | None
    ) -> None:
        self._settings = dict(settings)
        self._decay_steps_from = decay_steps_from
        peak = settings["peak_lr"]
        super().__init__(optimizer, lambda s: lr_at(s, **self._settings) / peak)

    @property
    def settings(self) -> dict:
        return dict(self._settings)

    @property
    def decay_steps_from(self) -> str | None:
        return self._decay_steps_from

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_settings", None)
        state.pop("_decay_steps_from", None)
        return state


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
    decay_steps_default: int | None = None,
    default_name: str = "",
) -> LRSchedule:
    """An :class:`LRSchedule` (a ``LambdaLR``) that follows :func:`lr_at` for every parameter group.
    ``decay_steps_default`` stands in for a null ``decay_steps`` (as in :func:`check_lr_schedule`);
    ``default_name`` names it (``step_scheduler.max_steps``) in what the schedule says of itself."""
    peak = float(peak_lr if peak_lr is not None else optimizer.param_groups[0]["lr"])
    params = dict(
        peak_lr=peak,
        warmup_steps=warmup_steps,
        # a default stands in only where the style decays: the other styles never read it
        decay_steps=decay_steps
        if decay_steps is not None or decay_style not in DECAYING_STYLES
        else decay_steps_default,
        decay_style=decay_style,
        min_lr=min_lr,
        warmup_init=warmup_init,
        wsd_decay_steps=wsd_decay_steps,
        wsd_decay_style=wsd_decay_style,
    )
    check_lr_schedule(**params)
    from_default = decay_steps is None and params["decay_steps"] is not None
    return LRSchedule(optimizer, params, (default_name or "its default") if from_default else None)


class ScheduledRates:
    """The one writer of ``param_groups[i]["lr"]`` (the trainer's ``rates``): step ``k`` updates
    with the scheduler's ``get_last_lr()`` (without one, ``base``) times ``multiplier(k)``. Others
    set these inputs and ask for :meth:`write`: the curriculum its ``lr_scale`` as ``multiplier``, a
    resume that honours a new rate the scheduler's base rates (or ``base``), healing and rollbacks
    the scheduler's state."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self.multiplier: Callable[[int], float] | None = None  # None: 1
        self.base: list[float] | None = None  # None: the groups' rates when first needed

    def write(self, step: int) -> float:
        """Every group's rate for optimizer step ``step``; returns the first group's."""
        scheduler, groups = self._trainer.lr_scheduler, self._trainer.optimizer.param_groups
        if hasattr(scheduler, "get_last_lr"):
            rates = scheduler.get_last_lr()
        elif self.multiplier is None and self.base is None:
            return groups[0]["lr"]  # no schedule: the optimizer's rates are the run's
        else:
            self.base = self.base or [group["lr"] for group in groups]
            rates = self.base
        self._put(rates, 1.0 if self.multiplier is None else self.multiplier(step))
        return groups[0]["lr"]

    def step(self, next_step: int) -> None:
        """Step the scheduler after an optimizer step, then write the rates of ``next_step``. Under a
        multiplier it steps from its unscaled rates (a chainable scheduler such as ``ExponentialLR``
        computes from the current rate), so the multiplier never compounds."""
        scheduler, scaled = self._trainer.lr_scheduler, self.multiplier is not None
        if scheduler is None:
            return
        if scaled:
            self._put(scheduler.get_last_lr(), 1.0)
        scheduler.step()
        if scaled:
            self.write(next_step)

    def unstep(self, steps: int, next_step: int) -> None:
        """Move a ``LambdaLR`` schedule back ``steps`` steps (steps it was stepped after that turned
        out skipped, :meth:`engine.Trainer.count_device_skips`), then write the rates of
        ``next_step``. Its rate is a function of its step count, so moving back is exact."""
        scheduler = self._trainer.lr_scheduler
        if scheduler is None:
            return
        if not isinstance(scheduler, LambdaLR):
            raise TypeError(f"only a LambdaLR schedule can be moved back, not {type(scheduler).__name__}")
        scheduler.last_epoch -= steps
        scheduler._last_lr = [  # what LambdaLR.get_lr() computes, without its warning outside step()
            base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)
        ]
        self.write(next_step)

    def _put(self, rates: list[float], scale: float) -> None:
        for group, lr in zip(self._trainer.optimizer.param_groups, rates):
            group["lr"] = lr * scale
