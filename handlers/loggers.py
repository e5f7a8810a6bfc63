"""The run's metric loggers: :func:`build_loggers` builds those the ``logging`` section asks for.

The shared base (:class:`MetricLogger`, :func:`metric_tag`, :class:`LoggingConfig`) lives in
:mod:`handlers.metric_logger`, which the concrete loggers import; it is re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hookloop.handlers.console import ConsoleLogger
from hookloop.handlers.jsonl_logger import JSONLLogger
from hookloop.handlers.metric_logger import LoggingConfig, MetricLogger, metric_tag
from hookloop.handlers.tensorboard_logger import TensorBoardLogger
from hookloop.handlers.wandb_logger import WandBLogger

__all__ = ["LoggingConfig", "MetricLogger", "build_loggers", "metric_tag"]


def build_loggers(logging_cfg: Any, run_dir: str | os.PathLike, *, config: Any = None) -> list[MetricLogger]:
    """The loggers the ``logging`` config section asks for (JSONL, TensorBoard, W&B, console).

    ``config`` (the whole run config, as a dict or dataclass) is recorded once by W&B.
    """
    run_dir = Path(run_dir)
    built = [
        JSONLLogger.from_config(logging_cfg, run_dir=run_dir),
        TensorBoardLogger.from_config(logging_cfg, run_dir=run_dir),
        WandBLogger.from_config(logging_cfg, run_dir=run_dir, config=config),
        ConsoleLogger.from_config(logging_cfg),
    ]
    return [logger for logger in built if logger is not None]
