"""ConsoleLogger: a progress bar on a terminal, plain periodic lines anywhere else (CI logs)."""

from __future__ import annotations

import math
import sys
from typing import IO, Any

from hookloop.engine.events import Events, Priority
from hookloop.engine.record_file import FLUSH_SECS, RecordFile
from hookloop.handlers.metric_logger import LoggingConfig, MetricLogger, is_validation_metric

__all__ = ["ConsoleLogger"]

#: Where the console logger records a step: the last of the shipped loggers.
LOG_CONSOLE = Priority.RECORD - 3


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else str(value)


def _validation_parts(metrics: dict[str, float]) -> list[str]:
    """``val_loss 2.3411``, then every other validation metric (``val_accuracy 0.4120``)."""
    names = sorted((n for n in metrics if is_validation_metric(n)), key=lambda n: n != "val_loss")
    return [
        f"{name} {metrics[name]}"
        if isinstance(metrics[name], int)
        else f"{name} {_fmt(metrics[name], '.4f')}"
        for name in names
    ]


class ConsoleLogger(MetricLogger):
    """Shows loss, lr and tokens/s as training runs.

    On a TTY (or ``progress_bar=True``) it shows one tqdm bar for the whole run: one tick per
    optimizer step across epochs, out of the run's steps (``max_steps``, or epochs x steps per epoch
    when only epochs limit the run; no total when neither is known), refreshed every
    ``refresh_every`` steps (tqdm redraws cost more than a tiny step). The rate and time left leave
    out the first step (warm-up, compilation). Otherwise it prints one plain line per log step to
    ``stream``, with ``val_loss`` and every ``val_<name>`` metric on a step that validated::

        step 120/1000 | loss 2.3411 (avg 2.4020) | lr 3.00e-04 | 18,204 tok/s | 0.0412 s/step
        step 200/1000 | val_loss 2.2950 | val_accuracy 0.3418

    The plain lines are formatted and written by a background thread (a
    :class:`~hookloop.engine.RecordFile` on the stream): each reaches the stream, flushed, within
    ``flush_secs`` seconds, when a checkpoint is published and at the end, in step order.
    """

    doc = "docs/metrics_and_loggers.md"  # its page (a shipped handler: handlers/declarations.py)
    switch = "console"  # the logging section's boolean that builds it

    priority = LOG_CONSOLE

    def __init__(
        self,
        *,
        stream: IO[str] | None = None,
        progress_bar: bool | None = None,
        refresh_every: int = 10,
        all_ranks: bool = False,
        flush_secs: float = FLUSH_SECS,
    ) -> None:
        super().__init__(all_ranks=all_ranks)
        self.stream = stream
        self.progress_bar = progress_bar
        self.refresh_every = refresh_every
        self.flush_secs = flush_secs
        self.pbar: Any = None
        self._plain = True
        self._lines: RecordFile | None = None

    @classmethod
    def from_config(cls, cfg: LoggingConfig) -> ConsoleLogger | None:
        """From the ``logging`` section, or None when ``cfg.console`` is false."""
        if not getattr(cfg, cls.switch):
            return None
        return cls(progress_bar=cfg.progress_bar)

    def _stream(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stdout

    def attach(self, trainer: Any) -> ConsoleLogger:
        use_bar = self.progress_bar
        if use_bar is None:
            stream = self.stream if self.stream is not None else sys.stderr
            use_bar = bool(getattr(stream, "isatty", lambda: False)())
        self._plain = not use_bar
        if use_bar and self.active:
            trainer.add_event_handler(Events.RUN_STARTED, self._open_bar, priority=self.priority)
            trainer.add_event_handler(Events.STEP_END, self._advance_bar, priority=self.priority)
        return super().attach(trainer)

    def _run_steps(self) -> int | None:
        """The steps this run ends at: ``max_steps``, else epochs x steps per epoch, else unknown."""
        trainer = self.trainer
        max_steps, max_epochs = trainer.limits
        if max_steps is not None:
            return max_steps
        epoch_length = getattr(trainer.state, "epoch_length", None)
        if max_epochs is not None and epoch_length:
            return max_epochs * epoch_length
        return None

    def _open_bar(self) -> None:
        from tqdm import tqdm

        self._close_bar()
        done = self.trainer.state.iteration  # a resumed run starts where it stopped
        self.pbar = tqdm(
            total=self._run_steps(),
            initial=done,
            desc="train",
            unit="step",
            file=self.stream,
            smoothing=0,  # the average rate since the clock restarted after the first step
            dynamic_ncols=True,
            mininterval=0,
        )
        self._bar_first = done + 1
        self._bar_shown = done

    def _advance_bar(self) -> None:
        bar = self.pbar
        if bar is None or bar.disable:  # disable: closed
            return
        state = self.trainer.state
        step = state.iteration
        if step == self._bar_first:
            # the first step pays for warm-up and compilation: the rate counts from its end
            bar.n = self._bar_shown = step
            bar.initial = step
            bar.start_t = bar.last_print_t = bar._time()
            bar.refresh()
            return
        if step % self.refresh_every and not self.trainer.at_last_step:
            return
        postfix = {"loss": _fmt(state.loss, ".4f"), "lr": _fmt(state.lr, ".2e")}
        if "tokens_per_s" in state.metrics:  # published by a MetricsTracker on its log steps
            postfix["tok/s"] = _fmt(state.metrics["tokens_per_s"], ",.0f")
        bar.set_postfix(postfix, refresh=False)
        bar.update(step - self._bar_shown)
        self._bar_shown = step

    def _close_bar(self) -> None:
        if self.pbar is not None:
            self.pbar.close()  # idempotent; the closed bar stays readable (its n, total, format_dict)

    def open(self) -> None:
        if self._plain:
            self._lines = RecordFile(self._stream(), flush_secs=self.flush_secs, encode=self._line)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.pbar is not None:
            validation = _validation_parts(metrics)
            if validation:
                self.pbar.write(" | ".join([f"step {step}", *validation]), file=self.stream)
        elif self._lines is not None:
            self._lines.write((step, self.trainer.limits[0], metrics))

    @staticmethod
    def _line(record: tuple[int, int | None, dict[str, float]]) -> str:
        step, max_steps, metrics = record
        parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
        if "loss" in metrics:
            loss = f"loss {_fmt(metrics['loss'], '.4f')}"
            if "loss_avg" in metrics:
                loss += f" (avg {_fmt(metrics['loss_avg'], '.4f')})"
            parts.append(loss)
        parts.extend(_validation_parts(metrics))
        if "lr" in metrics:
            parts.append(f"lr {_fmt(metrics['lr'], '.2e')}")
        if "tokens_per_s" in metrics:
            parts.append(f"{_fmt(metrics['tokens_per_s'], ',.0f')} tok/s")
        if "step_time_s" in metrics:
            parts.append(f"{_fmt(metrics['step_time_s'], '.4f')} s/step")
        if "mfu" in metrics:
            parts.append(f"mfu {_fmt(100 * metrics['mfu'], '.1f')}%")
        return " | ".join(parts)

    def flush(self) -> None:
        if self._lines is not None:
            self._lines.flush()

    def close(self) -> None:
        self._close_bar()  # the bar's last state stays on screen
        if self._lines is not None:
            self._lines.close()
            self._lines = None
        self._stream().flush()
