"""The ``metrics`` section: :class:`MetricsConfig`, read by
:class:`~hookloop.handlers.metrics.MetricsTracker`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hookloop.engine.checks import check_bool, check_number, dotted

__all__ = ["MetricsConfig"]

# OmegaConf resolves the section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


@dataclass
class MetricsConfig:
    """The ``metrics`` section: see :class:`MetricsTracker` (which publishes every
    ``logging.log_interval`` steps). ``flops_per_token`` null asks the model, 0 turns FLOP figures
    off; ``peak_flops_per_device`` null looks the accelerator up."""

    flops_per_token: Optional[float] = None
    peak_flops_per_device: Optional[float] = None
    enabled: bool = True

    def validate(self, prefix: str = "metrics") -> None:
        """The only copy of the tracker's rules for these settings (its constructor calls this)."""
        check_number(dotted(prefix, "flops_per_token"), self.flops_per_token, low=0, allow_none=True)
        check_number(
            dotted(prefix, "peak_flops_per_device"), self.peak_flops_per_device, low=0, allow_none=True
        )
        check_bool(dotted(prefix, "enabled"), self.enabled)

    def produces(self, cfg: Any) -> set[str]:
        """The interval's loss figures that can rank checkpoints."""
        return {"loss", "loss_avg", "grad_norm"} if self.enabled else set()
