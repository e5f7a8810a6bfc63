"""The ``health`` section: :class:`HealthConfig`, read by
:class:`~hookloop.handlers.health_check.HealthCheck`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass

from hookloop.engine.checks import check_bool, check_int, check_number, dotted

__all__ = ["HealthConfig"]


@dataclass
class HealthConfig:
    """The ``health`` section: see :class:`HealthCheck`."""

    enabled: bool = False
    every_steps: int = 100
    timeout_s: float = 60.0

    def validate(self, prefix: str = "health") -> None:
        """The only copy of the health check's rules (its constructor calls this too)."""
        check_bool(dotted(prefix, "enabled"), self.enabled)
        check_int(dotted(prefix, "every_steps"), self.every_steps)
        check_number(dotted(prefix, "timeout_s"), self.timeout_s, positive=True, hint="seconds")
