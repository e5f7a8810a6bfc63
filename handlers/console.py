"""ConsoleLogger: a progress bar on a terminal, plain periodic lines anywhere else (CI logs)."""

from __future__ import annotations

import math
import sys
from typing import IO, Any

from engine.events import Events, Priority
from handlers.metric_logger import LoggingConfig, MetricLogger

__all__ = ["ConsoleLogger"]


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else str(value)


class ConsoleLogger(MetricLogger):
    """Shows loss, lr and tokens/s as training runs.

    On a TTY (or ``progress_bar=True``) it attaches ignite's ``ProgressBar`` (tqdm), refreshed every
    ``refresh_every`` steps (tqdm redraws cost more than a tiny step). Otherwise it prints one plain
    line per log step to ``stream``::

        step 120/1000 | loss 2.3411 (avg 2.4020) | lr 3.00e-04 | 18,204 tok/s | 0.0412 s/step
    """

    priority = Priority.LOG_CONSOLE

    def __init__(
        self,
        *,
        stream: IO[str] | None = None,
        progress_bar: bool | None = None,
        refresh_every: int = 10,
        every_steps: int | None = None,
        all_ranks: bool = False,
    ) -> None:
        super().__init__(every_steps=every_steps, all_ranks=all_ranks)
        self.stream = stream
        self.progress_bar = progress_bar
        self.refresh_every = refresh_every
        self.pbar: Any = None

    @classmethod
    def from_config(cls, cfg: LoggingConfig) -> ConsoleLogger | None:
        """From the ``logging`` section, or None when ``cfg.console`` is false."""
        if not cfg.console:
            return None
        return cls(progress_bar=cfg.progress_bar, every_steps=cfg.log_interval)

    def _stream(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stdout

    def attach(self, trainer: Any) -> ConsoleLogger:
        use_bar = self.progress_bar
        if use_bar is None:
            stream = self.stream if self.stream is not None else sys.stderr
            use_bar = bool(getattr(stream, "isatty", lambda: False)())
        if use_bar and self.active:
            from ignite.handlers import ProgressBar

            def postfix(_output: Any) -> dict[str, float]:
                state = trainer.state
                return {
                    "loss": state.loss,
                    "lr": state.lr,
                    "tok/s": state.metrics.get("tokens_per_s", math.nan),
                }

            self.pbar = ProgressBar(persist=True, file=self.stream)
            self.pbar.attach(
                trainer, output_transform=postfix, event_name=Events.STEP_END(every=self.refresh_every)
            )
        return super().attach(trainer)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.pbar is not None:
            if "val_loss" in metrics:
                self.pbar.log_message(f"step {step} | val_loss {_fmt(metrics['val_loss'], '.4f')}")
            return
        max_steps = self.trainer.limits[0]
        parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
        if "loss" in metrics:
            loss = f"loss {_fmt(metrics['loss'], '.4f')}"
            if "loss_avg" in metrics:
                loss += f" (avg {_fmt(metrics['loss_avg'], '.4f')})"
            parts.append(loss)
        if "val_loss" in metrics:
            parts.append(f"val_loss {_fmt(metrics['val_loss'], '.4f')}")
        if "lr" in metrics:
            parts.append(f"lr {_fmt(metrics['lr'], '.2e')}")
        if "tokens_per_s" in metrics:
            parts.append(f"{_fmt(metrics['tokens_per_s'], ',.0f')} tok/s")
        if "step_time_s" in metrics:
            parts.append(f"{_fmt(metrics['step_time_s'], '.4f')} s/step")
        if "mfu" in metrics:
            parts.append(f"mfu {_fmt(100 * metrics['mfu'], '.1f')}%")
        stream = self._stream()
        stream.write(" | ".join(parts) + "\n")
        stream.flush()

    def close(self) -> None:
        bar = self.pbar.pbar if self.pbar is not None else None  # the tqdm bar, None once closed
        if bar is not None:  # the run stopped mid-epoch, before ignite closed the bar at EPOCH_END
            bar.close()
            self.pbar.pbar = None
        self._stream().flush()
