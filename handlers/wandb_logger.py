"""WandBLogger: metrics to Weights & Biases, online or as an offline run to sync later."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hookloop.engine.checks import check_choice
from hookloop.engine.events import Priority
from hookloop.handlers.metric_logger import WANDB_MODES, LoggingConfig, MetricLogger, metric_tag

__all__ = ["WandBLogger"]

#: Where the W&B logger records a step: after the TensorBoard logger.
LOG_WANDB = Priority.RECORD - 2


class WandBLogger(MetricLogger):
    """Logs the run's config once and its metrics under :func:`~handlers.metric_logger.metric_tag` names,
    on the log steps every logger shares (:mod:`handlers.metric_logger`).

    ``mode`` None leaves the choice to ``WANDB_MODE``; ``"offline"`` writes a local run directory
    under ``dir`` that ``wandb sync`` uploads later; ``"disabled"`` makes every call a no-op.
    ``wandb`` is imported when the logger is attached and ``wandb.init`` is called once the run has
    started (RUN_STARTED); extra keyword arguments go to ``wandb.init``
    (``settings=wandb.Settings(...)``, ``id``/``resume`` to continue a run, ``tags``, ...).
    """

    doc = "docs/metrics_and_loggers.md"  # its page (a shipped handler: handlers/declarations.py)
    switch = "wandb"  # the logging section's boolean that builds it

    priority = LOG_WANDB

    def __init__(
        self,
        project: str = "hookloop",
        *,
        name: str | None = None,
        dir: str | os.PathLike | None = None,
        mode: str | None = None,
        config: Any = None,
        all_ranks: bool = False,
        **init_kwargs: Any,
    ) -> None:
        super().__init__(all_ranks=all_ranks)
        check_choice("mode", mode, WANDB_MODES, allow_none=True)
        self.project = project
        self.name = name
        self.dir = Path(dir) if dir is not None else None
        self.mode = mode
        self.config = config
        self.init_kwargs = init_kwargs
        self.run: Any = None

    @classmethod
    def from_config(
        cls, cfg: LoggingConfig, *, run_dir: str | os.PathLike, config: Any = None
    ) -> WandBLogger | None:
        """From the ``logging`` section (``wandb_project``, ``wandb_mode``),
        or None when ``cfg.wandb`` is false; ``config`` (the whole run config) is recorded once."""
        if not getattr(cfg, cls.switch):
            return None
        return cls(
            cfg.wandb_project,
            dir=run_dir,
            mode=cfg.wandb_mode,
            config=config,
        )

    def attach(self, trainer: Any) -> WandBLogger:
        if self.active:  # a missing backend fails here, before the run starts; the W&B run at open()
            import wandb  # noqa: F401
        return super().attach(trainer)

    def open(self) -> None:
        import wandb

        config = self.config
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = dataclasses.asdict(config)
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        kwargs = dict(self.init_kwargs)
        if self.mode is not None:
            kwargs["mode"] = self.mode
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            dir=str(self.dir) if self.dir is not None else None,
            config=config,
            **kwargs,
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log({metric_tag(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    def _on_exception(self, _error: BaseException) -> None:
        if self.run is not None and not self._closed:
            self._closed = True
            self.run.finish(exit_code=1)
            self.run = None
