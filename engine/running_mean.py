"""RunningMean: the mean of the last N finite values, the one implementation of ``loss_avg``.

The StepScheduler (window ``loss_average_window_steps``) and the MetricsTracker (window
``log_interval``, when no scheduler is attached) both report a windowed mean of the step loss;
both use this class, so the rule (which values count, what an empty window gives) is written once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from engine.checks import check_int

__all__ = ["RunningMean"]


class RunningMean:
    """Mean of the last ``window`` finite values added; NaN while none was added.

    Non-finite values (a NaN or inf loss) are left out, so one bad step does not blank the curve
    for a whole window.
    """

    def __init__(self, window: int) -> None:
        check_int("window", window)
        self._values: deque[float] = deque(maxlen=window)

    @property
    def window(self) -> int:
        return self._values.maxlen or 0

    def add(self, value: float) -> float:
        """Add ``value`` (ignored unless finite); returns the mean after it."""
        value = float(value)
        if math.isfinite(value):
            self._values.append(value)
        return self.mean

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.add(value)

    @property
    def mean(self) -> float:
        values = self._values
        return math.fsum(values) / len(values) if values else float("nan")

    def clear(self) -> None:
        self._values.clear()

    @property
    def values(self) -> list[float]:
        """The values in the window, oldest first (what a checkpoint keeps to resume the mean)."""
        return list(self._values)

    def restore(self, values: Iterable[float]) -> None:
        """Replace the window's contents with ``values`` (the last ``window`` finite ones count)."""
        self.clear()
        self.extend(values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"RunningMean(window={self.window}, n={len(self)}, mean={self.mean:.6g})"
