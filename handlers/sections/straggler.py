"""The ``straggler`` section: :class:`StragglerConfig`, read by
:class:`~hookloop.handlers.straggler.StragglerDetector`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hookloop.engine.checks import check_bool, check_int, check_number, dotted

__all__ = ["StragglerConfig"]

# OmegaConf resolves the section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


@dataclass
class StragglerConfig:
    """The ``straggler`` section: see :class:`StragglerDetector`."""

    enabled: bool = False
    every_steps: int = 100
    stop_threshold: Optional[float] = None

    def validate(self, prefix: str = "straggler") -> None:
        """The only copy of the detector's rules for these settings (its constructor calls this)."""
        check_bool(dotted(prefix, "enabled"), self.enabled)
        check_int(dotted(prefix, "every_steps"), self.every_steps)
        check_number(
            dotted(prefix, "stop_threshold"),
            self.stop_threshold,
            above=1,
            allow_none=True,
            hint="slowest / median step time",
        )
