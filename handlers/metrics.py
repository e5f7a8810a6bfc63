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
and appends one line to ``<run_dir>/progress.jsonl`` on rank 0. Token and sample counts come from the
trainer, which already sums them over data-parallel ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

import torch
from ignite.engine import Events as IgniteEvents

from hookloop.engine import parallel
from hookloop.engine.checks import check_bool, check_int, check_number, dotted
from hookloop.engine.events import Events, Priority
from hookloop.engine.handler import Handler, checked_settings
from hookloop.engine.running_mean import RunningMean

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


@dataclass
class MetricsConfig:
    """The ``metrics`` section: see :class:`MetricsTracker` (which publishes every
    ``logging.log_interval`` steps). ``flops_per_token`` null asks the model, 0 turns FLOP figures
    off; ``peak_flops_per_device`` null looks the accelerator up."""

    flops_per_token: Optional[float] = None
    peak_flops_per_device: Optional[float] = None
    enabled: bool = True

    def validate(self, prefix: str = "metrics") -> None:
        """The only copy of the tracker's rules for these settings (its constructor calls this)."""
        check_number(dotted(prefix, "flops_per_token"), self.flops_per_token, low=0, allow_none=True)
        check_number(
            dotted(prefix, "peak_flops_per_device"), self.peak_flops_per_device, low=0, allow_none=True
        )
        check_bool(dotted(prefix, "enabled"), self.enabled)


# Dense bf16/fp16 tensor-core peak FLOP/s per device, by a substring of the CUDA device name.
# Checked in order, so more specific names come first.
_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)

# one encoder for every line: json.dumps with non-default separators builds a new one per call
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


def peak_flops_for_device(device: torch.device | str | None = None) -> float | None:
    """Peak dense FLOP/s of a known accelerator, or None (always None on CPU: give it in config)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in _PEAK_FLOPS:
        if key in name:
            return peak
    return None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def estimate_flops_per_token(model: torch.nn.Module, seq_len: int | None = None) -> float:
    """Training FLOPs per token: ``6 * N`` (non-embedding parameters) plus the attention term
    ``12 * layers * d_model * seq_len`` when the model's config tells the shape.

    A model with its own ``flops_per_token()`` method is asked directly.
    """
    model = _unwrap(model)
    if callable(getattr(model, "flops_per_token", None)):
        return float(model.flops_per_token())
    embedding = sum(
        p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    )
    n = sum(p.numel() for p in model.parameters()) - embedding
    flops = 6.0 * n
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    layers = _first_attr(cfg, ("n_layers", "num_layers", "num_hidden_layers", "n_layer"))
    width = _first_attr(cfg, ("d_model", "hidden_size", "n_embd", "dim"))
    seq_len = seq_len or _first_attr(
        cfg, ("seq_len", "max_seq_len", "max_position_embeddings", "n_positions")
    )
    if layers and width and seq_len:
        flops += 12.0 * layers * width * seq_len
    return flops


def _first_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


_statm_fd: int | None = None


def _rss_mb() -> float:
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

    asks_after_agreement = False  # late decisions only from values every rank shares

    Config = MetricsConfig
    section = "metrics"
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
        self._owns_loss_avg = True
        self._reset_interval()
        self._t_start = self._t_data = 0.0
        self._data_time = 0.0
        self._job_start = time.time()
        self._progress: IO[str] | None = None

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
        # the data clock: the wait for the step's microbatches, before STEP_START
        started, completed = IgniteEvents.GET_BATCH_STARTED, IgniteEvents.GET_BATCH_COMPLETED
        trainer.add_event_handler(started, self._on_batch_started, priority=TIME)
        trainer.add_event_handler(completed, self._on_batch_completed, priority=TIME)
        # The step clock starts and stops ahead of every handler but the profiler, so step_time_s is
        # the step body alone.
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=TIME)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=TIME)
        # The reduction is a collective: after the HealthCheck's probe (a hung peer is reported by the
        # probe rather than blocking here), before validation.
        trainer.add_event_handler(Events.STEP_END, self._maybe_publish, priority=PUBLISH)
        # A partial interval is published at TRAIN_END before the loggers write and close.
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=TRACK_END)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_failed, priority=TRACK_END)
        # A rollback is recorded with the step it left (before the checkpointer restores, at RESUME)
        # and the step it went back to (after).
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_start, priority=TIME)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback_done, priority=TRACK)
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
        self._samples = 0

    def _on_train_start(self) -> None:
        state = self.trainer.state
        self._reset_interval()
        self._samples_mark = state.samples_seen
        self._job_start = time.time()
        self._first_step = True
        state.metrics_step = None
        # A StepScheduler publishes loss_avg every step over its own window: the tracker leaves it be.
        self._owns_loss_avg = self.trainer.get_handler("step_scheduler") is None

    def _on_run_started(self) -> None:
        state = self.trainer.state
        self._write_progress(
            {
                "event": "start",
                "step": state.step,
                "tokens_seen": state.tokens_seen,
                "world_size": parallel.world_size(),
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
            self._tokens = self._tokens + state.peek("step_tokens")  # a tensor stays unread
            self._samples += state.samples_seen - self._samples_mark
            self._samples_mark = state.samples_seen
        if self._owns_loss_avg:
            self._loss_window.push(state.peek("loss"))

    def _maybe_publish(self) -> None:
        state = self.trainer.state
        if state.step % self.log_interval == 0 or self.trainer.at_last_step:
            self._publish()

    def _publish(self) -> None:
        state = self.trainer.state
        if isinstance(self._tokens, torch.Tensor):  # counted on the device: read once per interval
            self._tokens = int(self._tokens.item())
        n = max(self._timed, 1)
        local = [self._step_time / n, self._interval_data_time / n, _rss_mb()]
        cuda = self.trainer.device.type == "cuda"
        if cuda:
            local.append(torch.cuda.max_memory_allocated(self.trainer.device) / 2**20)
        step_time, data_time, rss, *cuda_mem = _all_reduce_max(local, self.trainer.collective_device)
        # the interval as seen by the slowest rank (its timed steps: a run's first is apart)
        interval_s = (step_time + data_time) * self._timed
        self.train_time_s += interval_s
        m = state.metrics
        m["loss"] = state.loss
        if self._owns_loss_avg and ("loss_avg" not in m or m["loss_avg"] is self._written_loss_avg):
            # no StepScheduler, and no other handler writes the average: publish our own
            self._written_loss_avg = self._loss_window.mean
            m["loss_avg"] = self._written_loss_avg
        m["grad_norm"] = state.grad_norm
        m["lr"] = state.lr
        if self._timed:  # an interval of the first step alone has no timing figures
            m["step_time_s"] = step_time
            m["data_time_s"] = data_time
            if self._tokens:  # token models only: a float-input model has no tokens to count
                m["tokens_per_s"] = self._tokens / interval_s if interval_s > 0 else float("nan")
            m["samples_per_s"] = self._samples / interval_s if interval_s > 0 else float("nan")
        m["skipped_steps"] = state.skipped_steps
        m["tokens_seen"] = state.tokens_seen
        m["rss_mb"] = rss
        if cuda_mem:
            m["cuda_max_allocated_mb"] = cuda_mem[0]
        flops_per_s = None
        if self.flops_per_token and self._tokens:
            flops_per_s = self.flops_per_token * m["tokens_per_s"]
            m["tflops_per_device"] = flops_per_s / parallel.world_size() / 1e12
            if self.peak_flops_per_device:
                m["mfu"] = flops_per_s / (self.peak_flops_per_device * parallel.world_size())
        state.metrics_step = state.step
        record = {
            "event": "progress",
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "step_time_s": step_time if self._timed else None,
            "tokens_per_s": m.get("tokens_per_s") if self._timed else None,
            "train_time_s": self.train_time_s,
        }
        if "tflops_per_device" in m and self._tokens:
            record["flops"] = self.flops_per_token * state.tokens_seen
            record["tflops_per_device"] = m["tflops_per_device"]
            cumulative = record["flops"] / self.train_time_s if self.train_time_s > 0 else float("nan")
            record["cumulative_tflops_per_device"] = cumulative / parallel.world_size() / 1e12
            if "mfu" in m:
                record["mfu"] = m["mfu"]
        self._write_progress(record)
        self._reset_interval()

    def _write_progress(self, record: dict[str, Any]) -> None:
        if self.run_dir is None or parallel.rank() != 0:
            return
        record = {"time": time.time(), "job_start": self._job_start, **record}
        record = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        if self._progress is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # appended (history survives restarts), line-buffered (a crash loses no finished line)
            self._progress = open(self.run_dir / "progress.jsonl", "a", buffering=1)  # noqa: SIM115
        self._progress.write(_COMPACT_JSON.encode(record) + "\n")

    def close(self) -> None:
        """Close the progress log (done at TRAIN_END and on the exception path)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None


def _all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Elementwise MAX over ranks with one collective on ``device`` (identity in one process)."""
    if parallel.world_size() == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
