"""The ``nan`` section: :class:`NaNConfig`, read by
:class:`~hookloop.handlers.nan_detector.NaNDetector`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hookloop.engine.checks import check_bool, check_choice, check_int, check_number, dotted

__all__ = ["ACTIONS", "NaNConfig"]

# OmegaConf resolves the section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


ACTIONS = ("warn", "raise", "rollback")


@dataclass
class NaNConfig:
    """The ``nan`` section: see :class:`NaNDetector` (``action: rollback`` needs checkpoints)."""

    enabled: bool = True
    max_consecutive: int = 5  # bad steps in a row that trigger a rollback
    check_grad_norm: bool = True  # a non-finite gradient norm is bad too, not only the loss
    action: str = "rollback"  # warn (veto and log), raise (stop, exit 76) or rollback
    max_rollbacks: int = 3  # rollbacks allowed in a run; the next request stops it (exit 76)
    skip_data_on_rollback: bool = True  # after a rollback, go on past the bad data, not rewind it
    spike_factor: Optional[float] = None  # a loss above this x the median good loss is bad; null: off
    spike_window: int = 100  # recent good losses the spike median is taken over

    def validate(self, prefix: str = "nan") -> None:
        """The only copy of the detector's rules (its constructor calls this too)."""
        p = prefix
        check_bool(dotted(p, "enabled"), self.enabled)
        check_int(dotted(p, "max_consecutive"), self.max_consecutive)
        check_bool(dotted(p, "check_grad_norm"), self.check_grad_norm)
        check_choice(dotted(p, "action"), self.action, ACTIONS)
        check_int(dotted(p, "max_rollbacks"), self.max_rollbacks, low=0)
        check_bool(dotted(p, "skip_data_on_rollback"), self.skip_data_on_rollback)
        check_number(
            dotted(p, "spike_factor"),
            self.spike_factor,
            above=1,
            allow_none=True,
            hint="a multiple of the median loss",
        )
        check_int(dotted(p, "spike_window"), self.spike_window)
