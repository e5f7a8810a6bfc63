"""TensorBoardLogger: scalars in real TensorBoard event files under stable tags."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import IO, Any

from handlers.loggers import MetricLogger, metric_tag

__all__ = ["TensorBoardLogger"]

_file_counter = itertools.count()
_crc_tables: tuple[list[int], list[int], list[int]] | None = None


def _tables() -> tuple[list[int], list[int], list[int]]:
    """CRC-32C (Castagnoli) lookup tables: the byte table, and two 16-bit tables that advance the
    CRC by a whole 32-bit word at a time (slicing-by-4 folded into two lookups). Built once."""
    global _crc_tables
    if _crc_tables is None:
        t0 = []
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            t0.append(c)
        t1 = [(t0[i] >> 8) ^ t0[t0[i] & 0xFF] for i in range(256)]
        t2 = [(t1[i] >> 8) ^ t0[t1[i] & 0xFF] for i in range(256)]
        t3 = [(t2[i] >> 8) ^ t0[t2[i] & 0xFF] for i in range(256)]
        low = [t3[x & 0xFF] ^ t2[x >> 8] for x in range(65536)]
        high = [t1[x & 0xFF] ^ t0[x >> 8] for x in range(65536)]
        _crc_tables = (t0, low, high)
    return _crc_tables


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C TFRecord framing uses; about 4x faster than TensorBoard's pure-Python
    byte loop, which dominated the cost of writing a step's scalars."""
    t0, low, high = _tables()
    crc = 0xFFFFFFFF
    whole = len(data) & ~3
    for (word,) in struct.iter_unpack("<I", data[:whole]):
        crc ^= word
        crc = low[crc & 0xFFFF] ^ high[crc >> 16]
    for byte in data[whole:]:
        crc = t0[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


class _EventFile:
    """An ``events.out.tfevents.*`` file written synchronously from the training thread.

    ``SummaryWriter`` hands every event to a writer thread; on a small machine the thread wake-up
    per event costs more than the write itself (see benchmarks/results/observability.md). The
    format is TensorBoard's own: a ``file_version`` event, then one ``Event`` per logged step, each
    in TFRecord framing (length, masked CRC-32C of the length, data, masked CRC-32C of the data).
    """

    def __init__(self, log_dir: Path, flush_secs: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        log_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.time():.6f}.{socket.gethostname()}.{os.getpid()}.{next(_file_counter)}"
        self.path = log_dir / f"events.out.tfevents.{stamp}"
        self._file: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._flush_secs = flush_secs
        self._last_flush = time.monotonic()
        self._write_record(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self.flush()

    def _write_record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
        )

    def add_scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._write_record(self._event(wall_time=time.time(), step=step, summary=summary).SerializeToString())
        if time.monotonic() - self._last_flush >= self._flush_secs:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._file.close()


class TensorBoardLogger(MetricLogger):
    """Writes every logged metric as a TensorBoard scalar under :func:`metric_tag`
    (``train/loss``, ``train/lr``, ``perf/tokens_per_s``, ``val/loss``, ``loss/<dataset>``), the x
    axis being the optimizer step; one event per logged step holds all its scalars.

    ``tensorboard`` is imported when the logger is attached. For images or histograms, open a
    ``torch.utils.tensorboard.SummaryWriter`` on the same ``log_dir``: TensorBoard merges the files.

    Args:
        log_dir: the event files' directory (``tensorboard --logdir`` it).
        flush_secs: flush the event file at least this often (and at TRAIN_END / on errors).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        every_steps: int | None = None,
        all_ranks: bool = False,
        flush_secs: float = 10.0,
    ) -> None:
        super().__init__(every_steps=every_steps, all_ranks=all_ranks)
        self.log_dir = Path(log_dir)
        self.flush_secs = flush_secs
        self.writer: _EventFile | None = None

    @classmethod
    def from_config(cls, logging_cfg: Any, run_dir: str | os.PathLike) -> TensorBoardLogger:
        return cls(Path(run_dir) / "tensorboard", every_steps=logging_cfg.log_interval)

    def open(self) -> None:
        log_dir = self.log_dir
        if self.all_ranks:
            from engine import parallel

            log_dir = log_dir / f"rank{parallel.rank()}"
        self.writer = _EventFile(log_dir, self.flush_secs)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is not None:
            self.writer.add_scalars(step, {metric_tag(k): float(v) for k, v in metrics.items()})

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
