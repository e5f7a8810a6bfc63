"""The ``fault_injection`` section (:class:`hookloop.handlers.fault_injection.FaultInjector`), torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hookloop.engine.checks import check_bool, check_choice, check_int, dotted
from hookloop.engine.errors import ConfigError

__all__ = ["FaultInjectionConfig"]

KINDS = ("transient", "data", "corruption", "nan")

# OmegaConf resolves the config section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


@dataclass
class FaultInjectionConfig:
    """The ``fault_injection`` section: a fault made on purpose, to see the run handle it.

    ``transient``: rank ``rank`` computes a NaN output once, in the forward of step ``step``.
    ``data``: the sample ``sample`` (``"<dataset>:<index>"``) has NaN features wherever and whenever
    it is trained. ``corruption``: at the start of step ``step``, bit ``bit`` of the first element
    of parameter ``parameter`` flips on rank ``rank`` only (one replica's weights silently differ).
    ``nan``: the training loss of each microbatch in ``microbatches`` (0-based over the run,
    ``state.microbatches_seen``, which a rollback never rewinds) is NaN on every rank.
    """

    enabled: bool = False
    kind: str = "transient"  # transient, data, corruption or nan
    rank: int = 0  # the rank a transient or corruption fault happens on
    step: int = 1  # the step a transient or corruption fault happens at (1-based)
    sample: Optional[str] = None  # data: the sample id "<dataset>:<index>" that is always bad
    parameter: Optional[str] = None  # corruption: the parameter's name (null: the first one)
    bit: int = 30  # corruption: the bit of the element's float32 pattern that flips (30: exponent)
    microbatches: List[int] = field(default_factory=list)  # nan: microbatches whose loss becomes NaN

    def validate(self, prefix: str = "fault_injection") -> None:
        """The only copy of the section's rules."""
        check_bool(dotted(prefix, "enabled"), self.enabled)
        check_choice(dotted(prefix, "kind"), self.kind, KINDS)
        check_int(dotted(prefix, "rank"), self.rank, low=0)
        check_int(dotted(prefix, "step"), self.step)
        check_int(dotted(prefix, "bit"), self.bit, low=0, high=31, hint="a bit of a float32")
        for i, index in enumerate(self.microbatches):
            check_int(f"{dotted(prefix, 'microbatches')}[{i}]", index, low=0, hint="a microbatch index")
        if self.kind == "nan" and not self.microbatches:
            raise ConfigError(
                dotted(prefix, "microbatches"), "kind 'nan' needs the microbatches to poison, e.g. [80, 81]"
            )
        if self.kind == "data":
            name, _, index = (self.sample or "").partition(":")
            if not name or not index.isdigit():
                raise ConfigError(
                    dotted(prefix, "sample"),
                    f"kind 'data' needs a sample id '<dataset>:<index>' (as the sample trace writes), "
                    f"got {self.sample!r}",
                )

    def cross_check(self, cfg: Any, prefix: str) -> None:
        if self.enabled and self.kind == "nan" and cfg.distributed.pp_size > 1:
            raise ConfigError(
                dotted(prefix, "kind"),
                "'nan' is not supported with distributed.pp_size > 1 (the schedule computes the loss)",
            )
