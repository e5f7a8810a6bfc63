"""MetricsTracker: step time, throughput, MFU and memory, published for the loggers.

Timing contract (what ``step_time_s`` means):

* The clock starts at STEP_START and stops when the step body has finished, at STEP_END before any
  other handler (both with the highest priority). Validation (the trainer runs it at STEP_END after
  that point) and anything other handlers do at STEP_END are therefore outside the step time.
* Checkpoint handlers that block training *inside* the step (e.g. waiting for staging before the
  optimizer step) add the seconds they block to ``state.times["checkpoint"]``
  (``state.times["checkpoint"] = state.times.get("checkpoint", 0.0) + seconds``). The tracker zeroes
  that entry at STEP_START and subtracts what it holds at the end of the step body, so throughput
  never counts checkpoint time.
* ``data_time_s`` is the wait for the step's microbatches (ignite's GET_BATCH events), which happens
  before STEP_START. Throughput divides by step time plus data time: a slow loader shows up.

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
import statistics
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import torch
from ignite.engine import Events as IgniteEvents

from engine import parallel
from engine.errors import ConfigError
from engine.events import Events

__all__ = ["MetricsTracker", "estimate_flops_per_token", "peak_flops_for_device"]

logger = logging.getLogger(__name__)

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

_TIMER_PRIORITY = float("inf")
_START_PRIORITY = -100
# the reduction is a collective: after a HealthCheck's probe (5_000_000), so a hung peer is reported
# by the probe rather than blocking here; before validation (1_000_000)
_PUBLISH_PRIORITY = 1_500_000
# publish a partial interval at TRAIN_END before loggers write and close
_END_PRIORITY = 1000


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


class MetricsTracker:
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

    def __init__(
        self,
        log_interval: int = 10,
        *,
        run_dir: str | os.PathLike | None = None,
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
        state_key: str | None = "metrics_tracker",
    ) -> None:
        if isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 1:
            raise ConfigError("log_interval", f"must be a positive integer, got {log_interval!r}")
        for name, value in (
            ("flops_per_token", flops_per_token),
            ("peak_flops_per_device", peak_flops_per_device),
        ):
            if value is not None and not (
                isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)
            ):
                raise ConfigError(name, f"must be a finite number >= 0 or None, got {value!r}")
        self.log_interval = log_interval
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.flops_per_token = flops_per_token
        self.peak_flops_per_device = peak_flops_per_device
        self.state_key = state_key
        self.train_time_s = 0.0  # cumulative over restarts (checkpointed)
        self._trainer: Any = None
        self._loss_window: deque[float] = deque(maxlen=log_interval)
        self._written_loss_avg: Any = None
        self._reset_interval()
        self._t_start = self._t_data = 0.0
        self._data_time = 0.0
        self._job_start = time.time()
        self._progress: IO[str] | None = None

    @classmethod
    def from_config(
        cls, metrics_cfg: Any, logging_cfg: Any, run_dir: str | os.PathLike | None
    ) -> MetricsTracker:
        """Build from the ``metrics`` and ``logging`` config sections."""
        return cls(
            logging_cfg.log_interval,
            run_dir=run_dir,
            flops_per_token=metrics_cfg.flops_per_token,
            peak_flops_per_device=metrics_cfg.peak_flops_per_device,
        )

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"train_time_s": self.train_time_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_time_s = float(state.get("train_time_s", 0.0))

    # ------------------------------------------------------------------ attaching
    def attach(self, trainer: Any) -> MetricsTracker:
        self._trainer = trainer
        if self.flops_per_token is None:
            self.flops_per_token = estimate_flops_per_token(trainer.model)
        if self.peak_flops_per_device is None:
            self.peak_flops_per_device = peak_flops_for_device(trainer.device)
        if self.state_key is not None:
            trainer.register_stateful(self.state_key, self)
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=_START_PRIORITY)
        trainer.add_event_handler(IgniteEvents.GET_BATCH_STARTED, self._on_batch_started)
        trainer.add_event_handler(IgniteEvents.GET_BATCH_COMPLETED, self._on_batch_completed)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=_TIMER_PRIORITY)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=_TIMER_PRIORITY)
        trainer.add_event_handler(Events.STEP_END, self._maybe_publish, priority=_PUBLISH_PRIORITY)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=_END_PRIORITY)
        trainer.add_event_handler(Events.TRAIN_FAILED, lambda _e: self.close())
        return self

    # ------------------------------------------------------------------ per step
    def _reset_interval(self) -> None:
        self._n = 0
        self._step_time = 0.0
        self._interval_data_time = 0.0
        self._tokens = 0
        self._samples = 0

    def _on_train_start(self) -> None:
        state = self._trainer.state
        self._reset_interval()
        self._samples_mark = state.samples_seen
        self._job_start = time.time()
        state.metrics_step = None
        self._write_progress(
            {
                "event": "start",
                "step": state.step,
                "tokens_seen": state.tokens_seen,
                "world_size": parallel.world_size(),
            }
        )

    def _on_train_end(self) -> None:
        # a run that stopped between log steps still publishes its last partial interval
        if self._n:
            self._publish()
        self.close()

    def _on_batch_started(self) -> None:
        self._t_data = time.perf_counter()

    def _on_batch_completed(self) -> None:
        self._data_time = time.perf_counter() - self._t_data

    def _on_step_start(self) -> None:
        self._trainer.state.times["checkpoint"] = 0.0
        self._t_start = time.perf_counter()

    def _on_step_end(self) -> None:
        elapsed = time.perf_counter() - self._t_start
        state = self._trainer.state
        blocked = state.times.get("checkpoint") or 0.0
        self._step_time += max(elapsed - blocked, 0.0)
        self._interval_data_time += self._data_time
        self._data_time = 0.0
        self._n += 1
        self._tokens += state.step_tokens
        self._samples += state.samples_seen - self._samples_mark
        self._samples_mark = state.samples_seen
        if math.isfinite(state.loss):
            self._loss_window.append(state.loss)

    def _maybe_publish(self) -> None:
        state = self._trainer.state
        if state.step % self.log_interval == 0 or state.is_last_step or state.step == self._trainer.max_steps:
            self._publish()

    def _publish(self) -> None:
        state = self._trainer.state
        n = max(self._n, 1)
        local = [self._step_time / n, self._interval_data_time / n, _rss_mb()]
        cuda = self._trainer.device.type == "cuda"
        if cuda:
            local.append(torch.cuda.max_memory_allocated(self._trainer.device) / 2**20)
        step_time, data_time, rss, *cuda_mem = _all_reduce_max(local)
        # the interval as seen by the slowest rank
        interval_s = (step_time + data_time) * n
        self.train_time_s += interval_s
        m = state.metrics
        m["loss"] = state.loss
        if "loss_avg" not in m or m["loss_avg"] is self._written_loss_avg:
            # nobody else (a StepScheduler) keeps a windowed average: keep our own
            self._written_loss_avg = (
                statistics.fmean(self._loss_window) if self._loss_window else float("nan")
            )
            m["loss_avg"] = self._written_loss_avg
        m["grad_norm"] = state.grad_norm
        m["lr"] = state.lr
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
            "step_time_s": step_time,
            "tokens_per_s": m.get("tokens_per_s"),
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


def _all_reduce_max(values: list[float]) -> list[float]:
    """Elementwise MAX over ranks with one collective (identity in one process)."""
    if parallel.world_size() == 1:
        return values
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
