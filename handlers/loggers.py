"""What every metric logger shares: when to log, what, under which tag, on which rank, and closing.

A logger writes on *log steps*: the steps where a :class:`~handlers.metrics.MetricsTracker` published
fresh metrics (``state.metrics_step == state.step``), or, with no tracker attached, every
``every_steps`` steps from the trainer's state (loss, grad norm, lr, tokens). Validation results are
written on the step a validation ran. Everything in ``state.metrics`` that is a number is written;
names map to stable tags with :func:`metric_tag` (``loss`` -> ``train/loss``,
``tokens_per_s`` -> ``perf/tokens_per_s``, ``val_loss`` -> ``val/loss``; names with a ``/`` such as
``loss/<dataset>`` are kept as they are).

Loggers are active on rank 0 only unless ``all_ranks=True``; they flush and close at TRAIN_END and on
the exception path. Backends (tensorboard, wandb) are imported only when a logger is attached.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

from engine import parallel
from engine.errors import ConfigError
from engine.events import Events

__all__ = ["MetricLogger", "build_loggers", "is_validation_metric", "metric_tag"]

# Loggers run after the other STEP_END handlers (which may add metrics) and before the trainer's
# own last handler clears the step flags.
LOG_PRIORITY = -1000

_TAGS = {
    "loss": "train/loss",
    "loss_avg": "train/loss_avg",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "skipped_steps": "train/skipped_steps",
    "tokens_seen": "train/tokens_seen",
    "step_time_s": "perf/step_time_s",
    "data_time_s": "perf/data_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "rss_mb": "system/rss_mb",
    "cuda_max_allocated_mb": "system/cuda_max_allocated_mb",
    "val_loss": "val/loss",
}


def metric_tag(name: str) -> str:
    """The stable tag a metric is logged under."""
    if name in _TAGS:
        return _TAGS[name]
    if "/" in name:
        return name
    if name.startswith("val_"):
        return f"val/{name[4:]}"
    return f"train/{name}"


def is_validation_metric(name: str) -> bool:
    return name == "val_loss" or name.startswith(("val_", "val/"))


def _number(value: Any) -> float | int | None:
    """``value`` as a plain number (ints stay ints), or None when it is not a scalar number."""
    kind = type(value)
    if kind is float or kind is int:
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and hasattr(value, "numel") and value.numel() == 1:
        return value.item()
    return None


class MetricLogger:
    """Base class: decides the log steps and collects the metrics; subclasses write them.

    Subclasses implement :meth:`open` (called once, at attach, on active ranks), :meth:`write`
    (``step`` and a ``{name: float}`` dict) and :meth:`close`.

    Args:
        every_steps: with no MetricsTracker attached, log every this many steps (default 1).
        all_ranks: log on every rank instead of rank 0 only.
    """

    def __init__(self, *, every_steps: int | None = None, all_ranks: bool = False) -> None:
        if every_steps is not None and (
            isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1
        ):
            raise ConfigError("every_steps", f"must be a positive integer or None, got {every_steps!r}")
        self.every_steps = every_steps
        self.all_ranks = all_ranks
        self.trainer: Any = None
        self._closed = True
        self._seen_validations = 0
        self._train_logged = -1
        self._follow_tracker = False

    @property
    def active(self) -> bool:
        return self.all_ranks or parallel.rank() == 0

    # ------------------------------------------------------------------ backend interface
    def open(self) -> None:
        """Create files / runs. Called at attach on active ranks."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered records out."""

    def close(self) -> None:
        """Flush and release the backend; further writes are ignored."""

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer: Any) -> MetricLogger:
        self.trainer = trainer
        if not self.active:
            return self
        self.open()
        self._closed = False
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=LOG_PRIORITY)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=LOG_PRIORITY)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=LOG_PRIORITY)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_exception)
        return self

    def _on_train_start(self) -> None:
        state = self.trainer.state
        self._seen_validations = state.validations
        self._train_logged = -1
        # a MetricsTracker (attached anywhere) declares ``metrics_step`` at TRAIN_START before us
        self._follow_tracker = hasattr(state, "metrics_step")
        if self._closed:
            self.open()
            self._closed = False

    def is_log_step(self, state: Any) -> bool:
        """Fresh tracker metrics this step, or (no tracker) every ``every_steps`` steps."""
        if self._follow_tracker:
            return getattr(state, "metrics_step", None) == state.step
        return state.step % (self.every_steps or 1) == 0

    def collect(self, state: Any, *, train: bool, validation: bool) -> dict[str, float]:
        """The numbers to write this step: training metrics, validation metrics, or both."""
        out: dict[str, float] = {}
        if train and not self._follow_tracker:
            for name in ("loss", "grad_norm", "lr", "tokens_seen", "skipped_steps"):
                out[name] = getattr(state, name)
        for name, value in state.metrics.items():
            is_val = is_validation_metric(name)
            if (is_val and validation) or (not is_val and train):
                number = _number(value)
                if number is not None:
                    out[name] = number
        return out

    def _on_step_end(self) -> None:
        self._log_current(self.trainer.state)

    def _log_current(self, state: Any) -> None:
        if self._closed:
            return
        validated = state.validations != self._seen_validations
        self._seen_validations = state.validations
        train = self._train_logged != state.step and self.is_log_step(state)
        if not (train or validated):
            return
        metrics = self.collect(state, train=train, validation=validated)
        if train:
            self._train_logged = state.step
        if metrics:
            self.write(state.step, metrics)

    def _on_train_end(self) -> None:
        # a final partial interval the tracker published at TRAIN_END has not been written yet
        self._log_current(self.trainer.state)
        self._close()

    def _on_exception(self, _error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.close()


def build_loggers(logging_cfg: Any, run_dir: str | os.PathLike, *, config: Any = None) -> list[MetricLogger]:
    """The loggers the ``logging`` config section asks for (JSONL, TensorBoard, W&B, console).

    ``config`` (the whole run config, as a dict or dataclass) is recorded once by W&B.
    """
    run_dir = Path(run_dir)
    loggers: list[MetricLogger] = []
    if logging_cfg.jsonl:
        from handlers.jsonl_logger import JSONLLogger

        loggers.append(JSONLLogger.from_config(logging_cfg, run_dir))
    if logging_cfg.tensorboard:
        from handlers.tensorboard_logger import TensorBoardLogger

        loggers.append(TensorBoardLogger.from_config(logging_cfg, run_dir))
    if logging_cfg.wandb:
        from handlers.wandb_logger import WandBLogger

        loggers.append(WandBLogger.from_config(logging_cfg, run_dir, config=config))
    if logging_cfg.console:
        from handlers.console import ConsoleLogger

        loggers.append(ConsoleLogger.from_config(logging_cfg))
    return loggers
