"""The ``checkpoint`` config section and the async modes a save can run in."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Optional

from hookloop.engine.checks import check_bool, check_choice, check_int, check_number, check_str, dotted
from hookloop.engine.errors import ConfigError

__all__ = ["METRIC_MODES", "MODES", "MODE_ALIASES", "AsyncMode", "CheckpointConfig"]


class AsyncMode(enum.StrEnum):
    """How a save runs beside training (see "Modes" in :mod:`hookloop.handlers.checkpoint`)."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_COPY = "async_copy"

    @classmethod
    def parse(cls, name: str) -> AsyncMode:
        """The mode ``name`` means, old names (:data:`MODE_ALIASES`) included."""
        return cls(MODE_ALIASES.get(name, name))


MODES = tuple(mode.value for mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_COPY, AsyncMode.SYNC))
# Old mode names configs may still hold -> the mode that behaves as they meant.
MODE_ALIASES = {"async_staged": "async"}
METRIC_MODES = ("min", "max")

# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


@dataclass
class CheckpointConfig:
    """The ``checkpoint`` section: see :class:`AsyncCheckpointer`. ``directory`` null means
    ``<run_dir>/checkpoints`` (the run directory is given to ``from_config``)."""

    enabled: bool = True
    directory: Optional[str] = None
    keep_last: int = 3
    keep_best: int = 0
    metric: str = "val_loss"
    metric_mode: str = "min"
    mode: str = "async"
    resume: Optional[str] = "auto"
    load_optimizer: bool = True
    finetune_from: Optional[str] = None
    wait_timeout_s: float = 600.0
    max_index_mb: float = 8.0

    def validate(self, prefix: str = "checkpoint") -> None:
        """The only copy of the checkpointer's rules (its constructor calls this too)."""
        p = prefix
        check_bool(dotted(p, "enabled"), self.enabled)
        check_str(dotted(p, "directory"), self.directory, allow_none=True, what="a directory path")
        check_int(dotted(p, "keep_last"), self.keep_last, hint="complete checkpoints to keep")
        check_int(
            dotted(p, "keep_best"), self.keep_best, low=0, hint="best checkpoints by the metric to keep"
        )
        check_str(dotted(p, "metric"), self.metric, what="a metric name in state.metrics (e.g. 'val_loss')")
        check_choice(dotted(p, "metric_mode"), self.metric_mode, METRIC_MODES)
        check_choice(dotted(p, "mode"), self.mode, (*MODES, *MODE_ALIASES))
        for name in ("resume", "finetune_from"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str | os.PathLike) or not os.fspath(value)):
                raise ConfigError(
                    dotted(p, name), f"must be a checkpoint directory path or null, got {value!r}"
                )
        check_bool(dotted(p, "load_optimizer"), self.load_optimizer)
        if self.finetune_from is not None and self.resume not in (None, "auto"):
            raise ConfigError(
                dotted(p, "finetune_from"),
                f"cannot be combined with an explicit {dotted(p, 'resume')} path; set resume to auto or null",
            )
        check_number(dotted(p, "wait_timeout_s"), self.wait_timeout_s, positive=True, hint="seconds")
        check_number(
            dotted(p, "max_index_mb"),
            self.max_index_mb,
            positive=True,
            hint="the largest .metadata a resume reads, in MiB",
        )
