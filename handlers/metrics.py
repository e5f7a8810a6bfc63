"""MetricsTracker: step time, throughput, MFU and memory, published for the loggers.

Timing contract (what ``step_time_s`` means):

* The clock starts at STEP_START and stops when the step body has finished, at STEP_END before any
  other handler (both at ``TIME``, the CLOCK phase; only the profiler steps earlier). Validation (the
  trainer runs it at STEP_END after that point) and anything other handlers do at STEP_END are
  therefore outside the step time.
* Checkpoint handlers that block training *inside* the step (e.g. waiting for staging before the
  optimizer step) add the seconds they block to ``state.times["checkpoint"]``
  (``state.times["checkpoint"] = state.times.get("checkpoint", 0.0) + seconds``). The tracker zeroes
  that entry at STEP_START and subtracts what it holds at the end of the step body, so throughput
  never counts checkpoint time.
* ``data_time_s`` is the wait for the step's microbatches (ignite's GET_BATCH events), which happens
  before STEP_START. Throughput divides by step time plus data time: a slow loader shows up.
* The first step of every run (also of a resumed one) is warm-up: ``torch.compile`` compiles there,
  allocators and loader workers start. Its time (step plus data) is reported once, as
  ``state.times["first_step"]`` and an info log line, and left out of ``step_time_s``,
  ``data_time_s``, ``tokens_per_s``, ``samples_per_s``, TFLOP/s and MFU (its tokens too); an
  interval holding no other step publishes none of those. The cumulative ``train_time_s`` includes
  it.

Every ``log_interval`` steps (and at the last step) the tracker reduces its interval averages across
ranks with one all-reduce (MAX: the job runs at the pace of its slowest rank), writes them into
``state.metrics``, sets ``state.metrics_step`` to the step (so loggers know the metrics are fresh)
and appends one line to ``<run_dir>/progress.jsonl`` on rank 0 (a :class:`RecordFile`: on disk within
a second, at every published checkpoint and at the end; cut back to the step a run resumes from, so
it holds each step once). Token and sample counts come from the
trainer, which already sums them over data-parallel ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Events as IgniteEvents

from hookloop.engine import parallel
from hookloop.engine.checks import check_int
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.flops import estimate_flops_per_token, peak_flops_for_device
from hookloop.engine.handler import Handler, checked_settings
from hookloop.engine.record_file import RecordFile, step_row
from hookloop.engine.running_mean import RunningMean
from hookloop.handlers.sections.metrics import MetricsConfig

__all__ = ["MetricsConfig", "MetricsTracker", "estimate_flops_per_token", "peak_flops_for_device"]

# Where the metrics tracker runs, relative to the phases of an event (engine.Priority).
#: Its clocks (data, step, rollback): CLOCK, so they time every other handler's work.
TIME = Priority.CLOCK
#: STEP_END: the step's metrics into the state, before validation and everything that reads them.
PUBLISH = Priority.OBSERVE + 50
#: TRAIN_START / ROLLBACK: start the clocks after the restore and user setup, before loggers open.
TRACK = Priority.DEFAULT - 100
#: TRAIN_END / TRAIN_FAILED: close progress.jsonl after the last sums, before the loggers close.
TRACK_END = Priority.DECIDE

logger = logging.getLogger(__name__)

# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


# one encoder for every line: json.dumps with non-default separators builds a new one per call
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


_statm_fd: int | None = None
_rss_read: tuple[float, float] = (-1.0, 0.0)  # (monotonic time, MB) of the last reading


def _rss_mb() -> float:
    """Resident set size of this process, read at most once a second (reading it costs a system
    call as dear as the rest of a publication)."""
    global _rss_read
    now = time.monotonic()
    if now - _rss_read[0] >= 1.0 or _rss_read[0] < 0:
        _rss_read = (now, _read_rss_mb())
    return _rss_read[1]


def _read_rss_mb() -> float:
    """Resident set size of this process now (Linux ``/proc/self/statm``, kept open), else its peak."""
    global _statm_fd
    try:
        if _statm_fd is None:
            _statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
        pages = int(os.pread(_statm_fd, 128, 0).split()[1])
        return pages * _PAGE_SIZE / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MetricsTracker(Handler):
    """Measures each step and publishes interval metrics into ``state.metrics``.

    Keys: ``loss``, ``loss_avg``, ``grad_norm``, ``lr``, ``step_time_s``, ``data_time_s``,
    ``tokens_per_s``, ``samples_per_s``, ``skipped_steps``, ``tokens_seen``, ``rss_mb``
    (``cuda_max_allocated_mb`` with CUDA), ``tflops_per_device`` when FLOPs per token are known and
    ``mfu`` only when the peak FLOP/s is known too (never guessed on CPU).

    Args:
        log_interval: publish every this many steps (and at the last step).
        run_dir: where ``progress.jsonl`` goes (None: no progress log).
        flops_per_token: training FLOPs per token; None asks the model (``flops_per_token()``) or
            estimates ``6N`` + attention term; 0 disables FLOP figures.
        peak_flops_per_device: peak FLOP/s of one device; None looks the accelerator up.
        state_key: key for the checkpointed cumulative train time (None: not checkpointed).
    """

    Config = MetricsConfig
    section = "metrics"
    doc = "docs/metrics_and_loggers.md"  # its page (a shipped handler: handlers/declarations.py)
    state_key = "metrics_tracker"

    def __init__(
        self,
        log_interval: int = 10,
        *,
        run_dir: str | os.PathLike | None = None,
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
        state_key: str | None = "metrics_tracker",
    ) -> None:
        check_int("log_interval", log_interval)
        checked_settings(MetricsConfig, locals())
        self.log_interval = log_interval
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        # state_key None: not in checkpoints; the tracker is still registered as "metrics_tracker"
        self.checkpointed = state_key is not None
        self.state_key = state_key if state_key is not None else type(self).state_key
        self.train_time_s = 0.0  # cumulative over restarts (checkpointed)
        self._loss_window = RunningMean(log_interval)
        self._written_loss_avg: Any = None
        self._reset_interval()
        self._t_start = self._t_data = 0.0
        self._data_time = 0.0
        self._job_start = time.time()
        self._progress: RecordFile | None = None
        self._world, self._cuda = 1, False

    @classmethod
    def from_config(
        cls,
        cfg: MetricsConfig,
        *,
        run_dir: str | os.PathLike | None = None,
        log_interval: int = 10,
        flops_per_token: float | None = None,
    ) -> MetricsTracker | None:
        """Build from the ``metrics`` section, or None when ``cfg.enabled`` is false.

        ``log_interval`` is the logging section's (``logging.log_interval``); ``flops_per_token``
        (e.g. the model's own count, before any pipeline split) is used when the section leaves it
        null; ``run_dir`` gets ``progress.jsonl``."""
        if not cfg.enabled:
            return None
        return cls(
            log_interval,
            run_dir=run_dir,
            flops_per_token=cfg.flops_per_token if cfg.flops_per_token is not None else flops_per_token,
            peak_flops_per_device=cfg.peak_flops_per_device,
        )

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"train_time_s": self.train_time_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_time_s = float(state.get("train_time_s", 0.0))

    # ------------------------------------------------------------------ attaching
    def attach(self, trainer: Any) -> MetricsTracker:
        if self.flops_per_token is None:
            self.flops_per_token = estimate_flops_per_token(trainer.model)
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = peak_flops_for_device(trainer.device)
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=TRACK)
        # progress.jsonl says the run started only once it has (a refused start writes nothing)
        trainer.add_event_handler(Events.RUN_STARTED, self._on_run_started, priority=TRACK)
        started, completed = IgniteEvents.GET_BATCH_STARTED, IgniteEvents.GET_BATCH_COMPLETED
        trainer.add_event_handler(started, self._on_batch_started, priority=TIME)
        trainer.add_event_handler(completed, self._on_batch_completed, priority=TIME)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=TIME)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=TIME)
        # The reduction is a collective: after the HealthCheck's probe (a hung peer is reported by the
        # probe rather than blocking here), before validation.
        trainer.add_event_handler(Events.STEP_END, self._maybe_publish, priority=PUBLISH)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=TRACK_END)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_failed, priority=TRACK_END)
        # A rollback is recorded with the step it left (before the checkpointer restores, at RESUME)
        # and the step it went back to (after).
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_start, priority=TIME)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_done, priority=TRACK)
        trainer.add_event_handler(Events.CHECKPOINT_SAVED, self._flush, priority=TRACK)
        return super().attach(trainer)

    def _on_rollback_start(self) -> None:
        self._rollback_from = self.trainer.state.step

    def _on_rollback_done(self) -> None:
        step = self.trainer.state.step
        self._write_progress({"event": "rollback", "step": step, "from": self._rollback_from, "to": step})

    # ------------------------------------------------------------------ per step
    def _reset_interval(self) -> None:
        self._n = 0
        self._timed = 0  # steps in the timing figures: all but a run's first
        self._step_time = 0.0
        self._interval_data_time = 0.0
        self._tokens = 0
        self._token_counts: list[torch.Tensor] = []
        self._samples = 0

    def _on_train_start(self) -> None:
        state = self.trainer.state
        self._reset_interval()
        self._samples_mark = state.samples_seen
        self._job_start = time.time()
        self._first_step = True
        state.metrics_step = -1  # a publisher is here: loggers write on the steps it publishes
        self._world, self._cuda = parallel.world_size(), self.trainer.device.type == "cuda"

    def _on_run_started(self) -> None:
        state = self.trainer.state
        if self._progress is None and self.run_dir is not None and parallel.rank() == 0:
            self._progress = RecordFile(self.run_dir / "progress.jsonl", encode=_progress_line)
        if self._progress is not None:  # each step once: a killed run's lines after its checkpoint go
            self._progress.cut(state.step, row=_reached)
        self._write_progress(
            {
                "event": "start",
                "step": state.step,
                "tokens_seen": state.tokens_seen,
                "world_size": self._world,
            }
        )
        if state.step > 0:  # the checkpointer (earlier at TRAIN_START) restored a checkpoint
            self._write_progress({"event": "resume", "step": state.step})

    def _on_train_end(self) -> None:
        # a run that stopped between log steps still publishes its last partial interval
        if self._n:
            self._publish()
        self.close()

    def _on_failed(self, _error: BaseException) -> None:
        self.close()

    def _on_batch_started(self) -> None:
        self._t_data = time.perf_counter()

    def _on_batch_completed(self) -> None:
        self._data_time = time.perf_counter() - self._t_data

    def _on_step_start(self) -> None:
        self.trainer.state.times["checkpoint"] = 0.0
        self._t_start = time.perf_counter()

    def _on_step_end(self) -> None:
        elapsed = time.perf_counter() - self._t_start
        state = self.trainer.state
        blocked = state.times.get("checkpoint") or 0.0
        step_time, data_time = max(elapsed - blocked, 0.0), self._data_time
        self._data_time = 0.0
        self._n += 1
        if self._first_step:  # warm-up (compilation): reported once, outside the averages
            self._first_step = False
            self._samples_mark = state.samples_seen
            state.times["first_step"] = step_time + data_time
            self.train_time_s += step_time + data_time
            logger.info("first step (compile/warm-up) took %.3f s", step_time + data_time)
        else:
            self._step_time += step_time
            self._interval_data_time += data_time
            self._timed += 1
            tokens = state.peek("step_tokens")
            if isinstance(tokens, torch.Tensor):  # counted on the device: left unread until publishing
                self._token_counts.append(tokens)
            else:
                self._tokens += tokens
            self._samples += state.samples_seen - self._samples_mark
            self._samples_mark = state.samples_seen

    def publishes_now(self) -> bool:
        """Whether this step is a log step: the tracker publishes its metrics at its end (every
        ``log_interval`` steps and at the last step)."""
        return every(self.log_interval, self.trainer.state.step) or self.trainer.at_last_step

    def _maybe_publish(self) -> None:
        state = self.trainer.state
        publish = self.publishes_now()
        if self._owns_loss_avg():  # the loss unread (a tensor stays one) unless it is published now
            self._loss_window.push(state.loss if publish else state.peek("loss"))
        if publish:
            self._publish()

    def _owns_loss_avg(self) -> bool:
        """``loss_avg`` is computed once: a handler that publishes it every step before the tracker
        (a StepScheduler) owns it; else the tracker averages over ``log_interval``."""
        m = self.trainer.state.metrics
        return "loss_avg" not in m or m["loss_avg"] is self._written_loss_avg

    def _publish(self) -> None:
        state, world = self.trainer.state, self._world
        if self._token_counts:  # counted on the device: read once per interval
            counts = self._token_counts
            self._tokens += int((counts[0] if len(counts) == 1 else torch.stack(counts).sum()).item())
        tokens, timed, n = self._tokens, self._timed, max(self._timed, 1)
        local = [self._step_time / n, self._interval_data_time / n, _rss_mb()]
        if self._cuda:
            local.append(torch.cuda.max_memory_allocated(self.trainer.device) / 2**20)
        if world > 1:
            local = _all_reduce_max(local, self.trainer.collective_device)
        step_time, data_time, rss, *cuda_mem = local
        # the interval as seen by the slowest rank (its timed steps: a run's first is apart)
        interval_s = (step_time + data_time) * timed
        self.train_time_s += interval_s
        m = state.metrics
        m["loss"] = state.loss
        if self._owns_loss_avg():
            self._written_loss_avg = m["loss_avg"] = self._loss_window.mean
        m["grad_norm"] = state.grad_norm
        m["lr"] = state.lr
        tokens_per_s = None
        if timed:  # an interval of the first step alone has no timing figures
            m["step_time_s"] = step_time
            m["data_time_s"] = data_time
            if tokens:  # token models only: a float-input model has no tokens to count
                m["tokens_per_s"] = tokens_per_s = tokens / interval_s if interval_s > 0 else math.nan
            m["samples_per_s"] = self._samples / interval_s if interval_s > 0 else math.nan
        m["skipped_steps"] = state.skipped_steps
        m["tokens_seen"] = tokens_seen = state.tokens_seen
        m["rss_mb"] = rss
        if cuda_mem:
            m["cuda_max_allocated_mb"] = cuda_mem[0]
        if self.flops_per_token and tokens:
            flops_per_s = self.flops_per_token * m["tokens_per_s"]
            m["tflops_per_device"] = flops_per_s / world / 1e12
            if self.peak_flops_per_device:
                m["mfu"] = flops_per_s / (self.peak_flops_per_device * world)
        state.metrics_step = state.step
        if self._progress is not None:
            record = {
                "event": "progress",
                "step": state.step,
                "tokens_seen": tokens_seen,
                "step_time_s": step_time if timed else None,
                "tokens_per_s": tokens_per_s,
                "train_time_s": self.train_time_s,
            }
            if "tflops_per_device" in m and tokens:
                record["flops"] = flops = self.flops_per_token * tokens_seen
                record["tflops_per_device"] = m["tflops_per_device"]
                cumulative = flops / self.train_time_s if self.train_time_s > 0 else math.nan
                record["cumulative_tflops_per_device"] = cumulative / world / 1e12
                if "mfu" in m:
                    record["mfu"] = m["mfu"]
            self._write_progress(record)
        self._reset_interval()

    def _write_progress(self, record: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.write({"time": time.time(), "job_start": self._job_start, **record})

    def _flush(self, *_saved: Any) -> None:
        """A checkpoint was published: the lines up to its step go to disk now."""
        if self._progress is not None:
            self._progress.flush()

    def close(self) -> None:
        """Close the progress log (done at TRAIN_END and on the exception path)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None


def _progress_line(record: dict[str, Any]) -> str:
    """A progress record as its line: compact, a non-finite number as null."""
    return _COMPACT_JSON.encode(
        {k: None if type(v) is float and not math.isfinite(v) else v for k, v in record.items()}
    )


def _all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Elementwise MAX over ranks with one collective on ``device``."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _reached(line: bytes) -> dict | None:
    """A progress line read for the cut at the step the run had reached when it was written: a
    rollback's is the step it left (written after it), not the step it went back to."""
    row = step_row(line)
    if row is not None and row.get("event") == "rollback" and isinstance(row.get("from"), int):
        return {**row, "step": row["from"]}
    return row
