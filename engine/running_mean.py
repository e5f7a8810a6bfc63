"""RunningMean: the mean of the last N finite values, the one implementation of ``loss_avg``.

The step scheduler (window ``loss_average_window_steps``) and the metrics tracker (window
``log_interval``, when no scheduler is attached) both report a windowed mean of the step loss;
both use this class, so the rule (which values count, what an empty window gives) is written once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from hookloop.engine.checks import check_int

__all__ = ["RunningMean"]

NAN = math.nan


class RunningMean:
    """Mean of the last ``window`` finite values added; NaN while none was added.

    Non-finite values (a NaN or inf loss) are left out, so one bad step does not blank the curve
    for a whole window. Values may be 0-dim tensors (a step loss nobody has read): they are kept
    as they are and read to the host together, in one transfer, when the mean is asked for;
    :meth:`lazy_mean` gives the mean without reading anything.

    For :meth:`lazy_mean` the window is mirrored on the tensors' device: a ring of ``window`` slots in
    float64 (NaN where a slot is empty or its value is not finite), of which each push writes one
    slot, so a step's mean is one ``nanmean`` whatever the window, not a stack of every value in
    it. The ring is built (one stack) on the first lazy mean and after a read that dropped values.
    """

    def __init__(self, window: int) -> None:
        check_int("window", window)
        self._values: deque[Any] = deque(maxlen=window)
        self._unread = False  # whether some values are tensors not yet read to the host
        self._ring: torch.Tensor | None = None  # the window on the device, for lazy_mean
        self._slots: list[torch.Tensor] = []  # the ring's slots (0-dim views), oldest at _next
        self._next = 0

    @property
    def window(self) -> int:
        return self._values.maxlen or 0

    def add(self, value: float) -> float:
        """Add ``value`` (ignored unless finite); returns the mean after it."""
        self.push(value)
        return self.mean

    def push(self, value: Any) -> None:
        """Add ``value`` without computing the mean; a tensor is kept unread."""
        if isinstance(value, torch.Tensor):
            value = value.detach() if value.requires_grad else value
            self._values.append(value)
            self._unread = True
            if self._ring is not None:
                self._next_slot().copy_(value).nan_to_num_(NAN, NAN, NAN)  # inf too: left out
            return
        value = float(value)
        if math.isfinite(value):
            self._values.append(value)
            if self._ring is not None:
                self._next_slot().fill_(value)

    def _next_slot(self) -> torch.Tensor:
        """The ring's oldest slot, now the newest."""
        i = self._next
        self._next = i + 1 if i + 1 < len(self._slots) else 0
        return self._slots[i]

    def _read(self) -> None:
        if not self._unread:
            return
        values = list(self._values)
        at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        read: list[float] = []  # none left: the window dropped them
        if len(at) == 1:  # the usual case (one step between reads): one read, no new tensors
            read = [values[at[0]].item()]
        elif at:  # several: one transfer for all
            read = torch.stack([values[i].to(torch.float64) for i in at]).cpu().tolist()
        for i, v in zip(at, read):
            values[i] = v
        self._values.clear()
        self._values.extend(v for v in values if math.isfinite(v))
        self._unread = False
        if len(self._values) != len(values):  # non-finite values dropped: the ring no longer mirrors
            self._ring, self._slots = None, []

    def lazy_mean(self) -> Any:
        """The mean, as a float when every value is one, else as a 0-dim tensor (nothing read)."""
        if not self._unread:
            return self.mean
        if self._ring is None:
            self._build_ring()
        return self._ring.nanmean()  # type: ignore[union-attr]

    def _build_ring(self) -> None:
        """The ring from the window's values: the oldest at slot 0 after NaN for the empty slots."""
        values = list(self._values)
        device = next(v.device for v in reversed(values) if isinstance(v, torch.Tensor))
        ring = torch.full((self.window,), NAN, dtype=torch.float64, device=device)
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
        ring[self.window - len(values) :] = stacked.nan_to_num(NAN, NAN, NAN)
        self._ring, self._slots, self._next = ring, list(ring.unbind(0)), 0

    @property
    def mean(self) -> float:
        self._read()
        values = self._values
        return math.fsum(values) / len(values) if values else float("nan")

    def clear(self) -> None:
        self._values.clear()
        self._unread = False
        self._ring, self._slots = None, []

    @property
    def values(self) -> list[float]:
        """The values in the window, oldest first (what a checkpoint keeps to resume the mean)."""
        self._read()
        return list(self._values)

    def restore(self, values: Iterable[float]) -> None:
        """Replace the window's contents with ``values`` (the last ``window`` finite ones count)."""
        self.clear()
        for value in values:
            self.add(value)

    def __len__(self) -> int:
        self._read()
        return len(self._values)

    def __repr__(self) -> str:
        return f"RunningMean(window={self.window}, n={len(self)}, mean={self.mean:.6g})"
