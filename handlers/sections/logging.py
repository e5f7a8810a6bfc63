"""The ``logging`` section: :class:`LoggingConfig`, read by
:class:`~hookloop.handlers.metric_logger.MetricLogger`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hookloop.engine.checks import check_bool, check_choice, check_int, check_str, dotted

__all__ = ["LoggingConfig", "WANDB_MODES"]

# OmegaConf resolves the section's annotations at run time: Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


#: W&B run modes (``None`` leaves the choice to the ``WANDB_MODE`` environment variable).
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggingConfig:
    """The ``logging`` section: the publication cadence (``log_interval``, the one for console,
    JSONL, TensorBoard and W&B) and which loggers to build (one boolean per logger; see
    ``docs/observability.md``). ``progress_bar`` None: a bar on a terminal, plain lines otherwise.
    """

    log_interval: int = 10  # publish metrics (and log them) every this many steps, and at the last
    jsonl: bool = True  # JSONLLogger: <run_dir>/metrics.jsonl
    tensorboard: bool = False  # TensorBoardLogger: <run_dir>/tensorboard (the tensorboard extra)
    wandb: bool = False  # WandBLogger (the wandb extra)
    wandb_project: str = "hookloop"  # the W&B project
    wandb_mode: Optional[str] = None  # online, offline or disabled; null: WANDB_MODE decides
    console: bool = True  # ConsoleLogger: one line per published step on rank 0
    progress_bar: Optional[bool] = None  # console as a tqdm bar; null: a bar on a terminal only

    def validate(self, prefix: str = "logging") -> None:
        """The only copy of the loggers' rules for these settings."""
        p = prefix
        check_int(dotted(p, "log_interval"), self.log_interval)
        for name in ("jsonl", "tensorboard", "wandb", "console"):
            check_bool(dotted(p, name), getattr(self, name))
        check_str(dotted(p, "wandb_project"), self.wandb_project, what="a W&B project name")
        check_choice(dotted(p, "wandb_mode"), self.wandb_mode, WANDB_MODES, allow_none=True)
        check_bool(dotted(p, "progress_bar"), self.progress_bar, allow_none=True)
