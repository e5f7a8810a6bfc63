"""The ``fault_injection`` section (:class:`hookloop.handlers.fault_injection.FaultInjector`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hookloop.engine.checks import check_bool, check_choice, check_int, dotted
from hookloop.engine.errors import ConfigError

__all__ = ["FaultInjectionConfig"]

KINDS = ("transient", "data", "corruption")

# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


@dataclass
class FaultInjectionConfig:
    """The ``fault_injection`` section: a fault made on purpose, to see the run handle it.

    ``transient``: rank ``rank`` computes a NaN output once, in the forward of step ``step``.
    ``data``: the sample ``sample`` (``"<dataset>:<index>"``) has NaN features wherever and whenever
    it is trained. ``corruption``: at the start of step ``step``, bit ``bit`` of the first element
    of parameter ``parameter`` flips on rank ``rank`` only (one replica's weights silently differ).
    """

    enabled: bool = False
    kind: str = "transient"  # transient, data or corruption
    rank: int = 0  # the rank a transient or corruption fault happens on
    step: int = 1  # the step a transient or corruption fault happens at (1-based)
    sample: Optional[str] = None  # data: the sample id "<dataset>:<index>" that is always bad
    parameter: Optional[str] = None  # corruption: the parameter's name (null: the first one)
    bit: int = 30  # corruption: the bit of the element's float32 pattern that flips (30: exponent)

    def validate(self, prefix: str = "fault_injection") -> None:
        """The only copy of the section's rules."""
        check_bool(dotted(prefix, "enabled"), self.enabled)
        check_choice(dotted(prefix, "kind"), self.kind, KINDS)
        check_int(dotted(prefix, "rank"), self.rank, low=0)
        check_int(dotted(prefix, "step"), self.step)
        check_int(dotted(prefix, "bit"), self.bit, low=0, high=31, hint="a bit of a float32")
        if self.kind == "data":
            name, _, index = (self.sample or "").partition(":")
            if not name or not index.isdigit():
                raise ConfigError(
                    dotted(prefix, "sample"),
                    f"kind 'data' needs a sample id '<dataset>:<index>' (as the sample trace writes), "
                    f"got {self.sample!r}",
                )
