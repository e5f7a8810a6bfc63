"""What every metric logger shares: when to log, what, under which tag, on which rank, and closing.

A logger writes on *log steps*: the steps where a :class:`~handlers.metrics.MetricsTracker` published
fresh metrics (``state.metrics_step == state.step``, every ``logging.log_interval`` steps and at the
last step: the one log cadence, for every logger). No logger counts steps: with no tracker attached,
nothing publishes and a logger writes the trainer's state (loss, grad norm, lr, tokens) every step.
Validation results are written on the step a validation ran. Everything in ``state.metrics`` that
is a number is written; names map to stable tags with :func:`metric_tag` (``loss`` -> ``train/loss``,
``tokens_per_s`` -> ``perf/tokens_per_s``, ``val_loss`` -> ``val/loss``; names with a ``/`` such as
``loss/<dataset>`` are kept as they are).

Loggers are active on rank 0 only unless ``all_ranks=True``; they flush when a checkpoint is
published (CHECKPOINT_SAVED: a run resumed from it finds every record up to its step), and flush and
close at TRAIN_END and, when the run fails, at TRAIN_FAILED. Backends (tensorboard, wandb) are
imported only when a logger is attached. The concrete loggers import this module;
:mod:`handlers.loggers` builds them from the ``logging`` section.
"""

from __future__ import annotations

import numbers
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.events import Events, Priority
from hookloop.engine.handler import Handler
from hookloop.handlers.sections.logging import WANDB_MODES, LoggingConfig

__all__ = ["WANDB_MODES", "LoggingConfig", "MetricLogger", "is_validation_metric", "metric_tag"]

#: Where a user's logger (a subclass that keeps the default) records a step: after the shipped ones.
LOG = Priority.RECORD - 500


# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


# the names not under train/ (or val/ for a val_ name)
_TAGS = {
    "step_time_s": "perf/step_time_s",
    "data_time_s": "perf/data_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "rss_mb": "system/rss_mb",
    "cuda_max_allocated_mb": "system/cuda_max_allocated_mb",
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


_VALIDATION_PREFIXES = ("val_", "val/")  # val_loss among them


def is_validation_metric(name: str) -> bool:
    return name.startswith(_VALIDATION_PREFIXES)


def _number(value: Any) -> float | int | None:
    """``value`` as a plain number (ints stay ints), or None when it is not a scalar number."""
    kind = type(value)
    if kind is float or kind is int:
        return value
    if isinstance(value, numbers.Integral):  # bool too
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and hasattr(value, "numel") and value.numel() == 1:
        return value.item()
    return None


class MetricLogger(Handler):
    """Base class: decides the log steps and collects the metrics; subclasses write them.

    Subclasses implement :meth:`open` (called on active ranks once the run has started, at
    RUN_STARTED: a refused start creates no file), :meth:`write`
    (``step`` and a ``{name: float}`` dict) and :meth:`close`, and may set :attr:`priority`.

    Args:
        all_ranks: log on every rank instead of rank 0 only.
    """

    # Every shipped logger is configured by the ``logging`` section (its own boolean turns it on).
    Config = LoggingConfig
    section = "logging"
    #: Where the logger runs at TRAIN_START, STEP_END, TRAIN_END and TRAIN_FAILED: after every other
    #: STEP_END handler (which may add metrics), before the NaNDetector's rollback request and the
    #: trainer's own last handler. Each shipped logger has its own; a user's subclass runs after them.
    priority: float = LOG

    def __init__(self, *, all_ranks: bool = False) -> None:
        self.all_ranks = all_ranks
        self._closed = True
        self._seen_validations = 0
        self._train_logged = -1
        self._follow_tracker = False

    @property
    def active(self) -> bool:
        return self.all_ranks or parallel.rank() == 0

    # ------------------------------------------------------------------ backend interface
    def open(self) -> None:
        """Create files / runs. Called on active ranks when the run has started (RUN_STARTED)."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered records out."""

    def close(self) -> None:
        """Flush and release the backend; further writes are ignored."""

    # ------------------------------------------------------------------ wiring
    def attach(self, trainer: Any) -> MetricLogger:
        if self.active:
            trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=self.priority)
            trainer.add_event_handler(Events.RUN_STARTED, self._on_run_started, priority=self.priority)
            trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=self.priority)
            trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=self.priority)
            trainer.add_event_handler(Events.TRAIN_FAILED, self._on_exception, priority=self.priority)
            trainer.add_event_handler(Events.CHECKPOINT_SAVED, self._on_checkpoint, priority=self.priority)
        return super().attach(trainer)

    def _on_train_start(self) -> None:
        state = self.trainer.state
        self._seen_validations = state.validations
        self._train_logged = -1
        # a publisher (the MetricsTracker, earlier at TRAIN_START) sets state.metrics_step on its log steps
        self._follow_tracker = state.metrics_step is not None

    def _on_run_started(self) -> None:
        if self._closed:
            self.open()
            self._closed = False

    def is_log_step(self, state: Any) -> bool:
        """Fresh tracker metrics this step (no tracker: every step; loggers count no steps)."""
        return not self._follow_tracker or state.metrics_step == state.step

    def collect(self, state: Any, *, train: bool, validation: bool) -> dict[str, float]:
        """The numbers to write this step: training metrics, validation metrics, or both."""
        out: dict[str, float] = {}
        if train and not self._follow_tracker:
            for name in ("loss", "grad_norm", "lr", "tokens_seen", "skipped_steps"):
                out[name] = getattr(state, name)
        for name, value in state.metrics.items():
            if validation if is_validation_metric(name) else train:
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

    def _on_checkpoint(self, *_saved: Any) -> None:
        if not self._closed:
            self.flush()

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
