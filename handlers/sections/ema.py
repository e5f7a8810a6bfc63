"""The ``ema`` section: :class:`EMAConfig` of :class:`hookloop.handlers.ema.WeightEMA` (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookloop.engine.checks import check_bool, check_int, check_number

__all__ = ["EMAConfig"]


@dataclass
class EMAConfig:
    """The ``ema`` section: an exponential moving average of the weights, updated after committed
    optimizer steps, validated beside the weights (``val_loss_ema``, ``val_<name>_ema``),
    checkpointed and exported (``hookloop export RUN_DIR --ema``); see docs/ema.md."""

    enabled: bool = False
    #: the average's weight on its past: ``ema = decay * ema + (1 - decay) * weights``
    decay: float = 0.999
    #: update the average every this many steps (the steps divisible by it)
    every_steps: int = 1
    #: until this step the average is the weights; it averages the steps after it
    start_step: int = 0

    def validate(self, prefix: str = "ema") -> None:
        """The only copy of the section's rules (the handler's constructor calls this too)."""
        check_bool(f"{prefix}.enabled", self.enabled)
        check_number(f"{prefix}.decay", self.decay, low=0, below=1, hint="e.g. 0.999")
        check_int(f"{prefix}.every_steps", self.every_steps, hint="steps between updates")
        check_int(f"{prefix}.start_step", self.start_step, low=0, hint="the step averaging starts after")

    def produces(self, cfg: Any) -> set[str]:
        """What ``checkpoint.metric`` may rank by: ``val_loss_ema`` and ``val_<name>_ema`` of every
        validation metric, when enabled and the run validates."""
        if not self.enabled:
            return set()
        return {f"{name}_ema" for name in cfg.validation.produces(cfg)}
