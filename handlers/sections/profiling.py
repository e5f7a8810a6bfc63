"""The ``profiling`` section: :class:`ProfilingConfig`, read by
:class:`~hookloop.handlers.profiler.ProfilerWindow`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import List, Optional

from hookloop.engine.checks import check_bool, check_int, check_str, dotted
from hookloop.engine.errors import ConfigError

__all__ = ["ProfilingConfig"]

# OmegaConf resolves the section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


@dataclass
class ProfilingConfig:
    """The ``profiling`` section: see :class:`ProfilerWindow`. ``ranks`` null traces every rank;
    ``output_dir`` null means ``<run_dir>/profile``."""

    enabled: bool = False
    start_step: int = 5
    end_step: int = 8
    ranks: Optional[List[int]] = field(default_factory=lambda: [0])
    output_dir: Optional[str] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def validate(self, prefix: str = "profiling") -> None:
        """The only copy of the profiler window's rules (its constructor calls this too)."""
        p = prefix
        check_bool(dotted(p, "enabled"), self.enabled)
        check_int(dotted(p, "start_step"), self.start_step, hint="steps are 1-based")
        check_int(dotted(p, "end_step"), self.end_step, hint="steps are 1-based")
        if self.end_step <= self.start_step:
            raise ConfigError(
                dotted(p, "end_step"),
                f"must be larger than start_step ({self.start_step}), got {self.end_step}: the window is "
                "[start, end)",
            )
        ranks = self.ranks
        if ranks is not None:
            if isinstance(ranks, str) or not isinstance(ranks, Sequence):
                raise ConfigError(
                    dotted(p, "ranks"), f"must be a list of ranks or null (every rank), got {ranks!r}"
                )
            for r in ranks:
                check_int(dotted(p, "ranks"), r, low=0, hint="a list of ranks; null for every rank")
        check_str(dotted(p, "output_dir"), self.output_dir, allow_none=True, what="a directory path")
        for name in ("record_shapes", "profile_memory", "with_stack"):
            check_bool(dotted(p, name), getattr(self, name))
