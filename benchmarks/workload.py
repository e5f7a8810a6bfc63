"""The workload the step-time benchmarks share: one tiny GPT, one fixed token stream, and the
result file every benchmark writes for ``benchmarks/run.py``."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hookloop.models.gpt import GPT, GPTConfig  # noqa: E402

ACCUM = 2  # microbatches per optimizer step
BATCH = 8
SEQ_LEN = 64


def tiny_gpt(seed: int = 0) -> GPT:
    """The same model from the same seed for every contender."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, seq_len=SEQ_LEN, n_layers=2, d_model=64, n_heads=4))


def token_microbatches(steps: int, accum: int = ACCUM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps * accum`` microbatches of (inputs, next-token targets), always the same ones."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (steps * accum, BATCH, SEQ_LEN + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in x]


def seconds_per_step(trainer: Any, data: list, accum: int = ACCUM) -> float:
    """Train one pass over ``data`` and return the wall time per optimizer step."""
    start = time.perf_counter()
    trainer.run(data, max_epochs=1)
    return (time.perf_counter() - start) / (len(data) // accum)


class Stamped:
    """``data`` as an iterable that notes the time each step's first microbatch is fetched: the one
    place every contender (a hand-written loop, a Trainer with or without handlers) passes through
    at the same point of its step, so all are timed by the same clock with no handler added to time.

    ``wall`` holds ``time.perf_counter`` stamps, ``cpu`` ``time.process_time`` ones (every thread of
    the process, so work a handler hands to a thread of its own still counts)."""

    def __init__(self, data: list, accum: int = ACCUM) -> None:
        self.data, self.accum = data, accum
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __len__(self) -> int:
        return len(self.data)

    def _stamp(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def __iter__(self):
        for i, batch in enumerate(self.data):
            if i % self.accum == 0:
                self._stamp()
            yield batch
        self._stamp()

    def step_times(self, clock: str = "wall") -> list[float]:
        """Seconds per step by ``clock`` (``"wall"`` or ``"cpu"``), the first step left out."""
        stamps = self.wall if clock == "wall" else self.cpu
        return [b - a for a, b in zip(stamps[1:], stamps[2:])]

    def step_seconds(self) -> float:
        """Median wall seconds per step, the first step left out."""
        return statistics.median(self.step_times())


def alternating(
    reference: Callable[[], float], contender: Callable[[], float], repeats: int
) -> tuple[list[float], list[float], float]:
    """Time two contenders over ``repeats`` rounds after one untimed run of each, in ABBA order (the
    reference first in even rounds, second in odd ones), so that neither always runs first and
    inherits the other's warm caches or the quieter moment. Returns the reference's times, the
    contender's, and the median of the per-round ratios contender / reference."""
    reference(), contender()
    ref, con = [], []
    for i in range(repeats):
        if i % 2:
            con.append(contender())
            ref.append(reference())
        else:
            ref.append(reference())
            con.append(contender())
    return ref, con, statistics.median(c / r for c, r in zip(con, ref))


#: Offsets into a save's window whose median is the window's own step without the save's cost: from
#: the third step after the save on (an async save here is durable within one to two steps).
LOCAL_FROM = 3


def kept_local(durations: dict[int, float], saves: Iterable[int], every: int) -> float | None:
    """Throughput kept saving every ``every`` steps, read from the saving run alone: each window of
    ``every`` steps from a save in ``saves`` on (all of them in ``durations``, step -> seconds),
    against ``every`` times its own median step from :data:`LOCAL_FROM` steps after the save on;
    the sum over windows of those over the sum of the windows' steps. The reference runs in the same
    second as the save it is compared with: this machine's speed drifts by 10-40% between runs a few
    seconds apart, which a ratio of two runs compares across, while within a second it stays. A save
    that slows steps past :data:`LOCAL_FROM` counts only in part (it lifts the reference too). None
    when ``every`` leaves fewer than 3 steps for the reference or no window fits."""
    if every - LOCAL_FROM < 3:
        return None
    reference = spent = 0.0
    for window in _windows(durations, saves, every):
        reference += every * statistics.median(window[LOCAL_FROM:])
        spent += sum(window)
    return reference / spent if spent else None


def _windows(durations: dict[int, float], saves: Iterable[int], every: int) -> list[list[float]]:
    """The durations of each save's ``every`` steps from the save on, for the saves whose steps are
    all in ``durations``; none when ``every`` leaves fewer than 3 steps for a window's own median."""
    if every - LOCAL_FROM < 3:
        return []
    windows = ([durations.get(save + o) for o in range(every)] for save in saves)
    return [window for window in windows if None not in window]


def save_windows(durations: dict[int, float], saves: Iterable[int], every: int) -> list[list[float]]:
    """Each save's window of ``every`` steps (``durations``: step -> seconds), every step over the
    window's own median step from :data:`LOCAL_FROM` steps after the save on (as :func:`kept_local`
    reads it); windows that do not fit are left out."""
    scaled = []
    for window in _windows(durations, saves, every):
        reference = statistics.median(window[LOCAL_FROM:])
        scaled.append([d / reference for d in window])
    return scaled


#: Fewer windows than this give no reading per offset: a median of two is their mean.
OFFSET_WINDOWS = 5


def kept_by_offset(windows: list[list[float]]) -> float | None:
    """Throughput kept saving, read per offset from the save: the median over ``windows`` (of
    :func:`save_windows`, any number of runs) of each offset's step, ``every`` over their sum. A
    save's own cost comes at the same offsets every time and stays in the medians; a burst of slow
    steps from other processes, which lengthens one window's sum and so reads as a cost in
    :func:`kept_local` even in a run without saves, lands at one offset of one window and leaves
    the median there. None with fewer than :data:`OFFSET_WINDOWS` windows."""
    if len(windows) < OFFSET_WINDOWS:
        return None
    every = len(windows[0])
    return every / sum(statistics.median(w[o] for w in windows) for o in range(every))


def write_result(path: Path | None, result: dict[str, Any]) -> None:
    """Write a benchmark's ``{"benchmark", "figures", ...}`` result where ``--json`` asked."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
