"""Step-time overhead of logging every step: the default logging configuration, and with TensorBoard,
against a Trainer with no logging.

Contenders train the same tiny GPT (d_model 64, 2 layers, seq 32, batch 8, one microbatch a step)
on the same data from the same seed:

* no logging: a bare Trainer;
* default logging, every step: what ``hookloop train`` attaches with ``logging.log_interval=1`` and
  the other settings at their defaults (MetricsTracker with ``progress.jsonl``, JSONLLogger, and the
  console's plain lines, written to a file here as a CI log would be);
* the same with TensorBoard (``logging.tensorboard=true``).

A step's time is read where every contender reads its data (the time between fetching one step's
batch and the next), so all are timed by the same clock at the same places and no handler is added
to time them; the first step and the run's set-up are left out. Contenders alternate over
``--rounds`` rounds of ``--steps`` steps, the order turning each round. Per round, each contender's
median step (as ``overhead.py``; a step another process disturbed is left out); the ratio is the
median over rounds of the per-round ratio to no logging (rounds next to each other see the same
machine: this one's speed drifts by up to 50% over seconds). The clock is the CPU time of the whole
process (every thread): other processes on a shared machine stretch wall time far more than CPU
time. Work done on some steps only (a background thread writing a second's records) is in the
mean step, whose ratio is printed beside the median's, as is the wall-time ratio.

Then each shipped logger alone, logging every 10 steps (``logging.log_interval``'s default), on the
steps where it does not log: the MetricsTracker alone (it publishes every 10 steps and writes
``progress.jsonl``), and the tracker with one logger each: JSONL, the console's plain lines, the
console's progress bar, TensorBoard, and W&B offline (when ``wandb`` is installed; not with
``--quick``: its start-up takes seconds a run). Per round, each contender's median CPU step over
the steps that do not log (step ``k`` with ``k % 10 != 0``) over the median step without logging;
the median over rounds; target <= 1.01. "logger alone" is the same over the tracker-only
contender's non-log step: what the logger itself adds to a step it does not log.

    python benchmarks/logging_overhead.py [--quick] [--json PATH] [--profile]

``--profile`` also times each handler's callbacks (CPU time of the training thread) and the records'
background writing in separate runs (wrapping them costs a little; those runs are not in the ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import Stamped, write_result  # noqa: E402

from hookloop.engine import Events, Trainer  # noqa: E402
from hookloop.handlers.loggers import LoggingConfig, build_loggers  # noqa: E402
from hookloop.handlers.metrics import MetricsConfig, MetricsTracker  # noqa: E402
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402

TARGET = 1.03
BASE = "no logging"
CONTENDERS = {
    BASE: None,
    "default logging, every step": LoggingConfig(log_interval=1),
    "default logging + TensorBoard, every step": LoggingConfig(log_interval=1, tensorboard=True),
}
# the default interval, for the full run's table only
EVERY_10 = {"default logging + TensorBoard, every 10": LoggingConfig(log_interval=10, tensorboard=True)}

# Each shipped logger alone, logging every LOG_EVERY steps, timed on the steps it does not log.
LOG_EVERY = 10
NON_LOG_TARGET = 1.01
TRACKER_ONLY = "tracker alone (progress.jsonl)"
_ALONE = dict(log_interval=LOG_EVERY, jsonl=False, console=False)
SINGLE_LOGGERS = {
    TRACKER_ONLY: LoggingConfig(**_ALONE),
    "tracker + JSONL": LoggingConfig(**{**_ALONE, "jsonl": True}),
    "tracker + console lines": LoggingConfig(**{**_ALONE, "console": True, "progress_bar": False}),
    "tracker + console progress bar": LoggingConfig(**{**_ALONE, "console": True, "progress_bar": True}),
    "tracker + TensorBoard": LoggingConfig(**{**_ALONE, "tensorboard": True}),
    "tracker + W&B offline": LoggingConfig(**{**_ALONE, "wandb": True, "wandb_mode": "offline"}),
}


def make_data(steps: int, batch: int = 8, seq: int = 32) -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (steps * batch, seq + 1), generator=g)
    return [(x[i : i + batch, :-1], x[i : i + batch, 1:]) for i in range(0, steps * batch, batch)]


def attach_logging(trainer: Trainer, cfg: LoggingConfig, run_dir: Path) -> list:
    """The tracker and loggers ``hookloop train`` builds from these sections (its HANDLER_ORDER)."""
    handlers = [MetricsTracker.from_config(MetricsConfig(), run_dir=run_dir, log_interval=cfg.log_interval)]
    handlers += build_loggers(cfg, run_dir)
    for handler in handlers:
        if hasattr(handler, "stream"):  # the console: its lines into the run directory, not our printout
            handler.stream = open(run_dir / "console.log", "a")  # noqa: SIM115 (lives as long as the run)
        handler.attach(trainer)
    return handlers


def run(
    cfg: LoggingConfig | None, data: list, tmp: Path, spent: dict | None = None, only: Any = None
) -> Stamped:
    """One run of one contender; with ``spent``, nanoseconds inside each handler's callbacks add up
    there by handler class (on the steps ``only(step)`` accepts, when given)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=data[0][0].shape[1], n_layers=2, d_model=64, n_heads=4))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)
    if cfg is not None:
        handlers = attach_logging(trainer, cfg, Path(tempfile.mkdtemp(dir=tmp)))
        if spent is not None:
            _time_handlers(trainer, handlers, spent, only)
    stamped = Stamped(data, accum=1)
    trainer.run(stamped, max_epochs=1)
    return stamped


def _time_handlers(trainer: Trainer, handlers: list, spent: dict, only: Any = None) -> None:
    state = trainer.state

    def timed(fn, name):
        def wrapper(*args, **kwargs):
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if only is None or only(state.step):
                    spent[name] += time.thread_time_ns() - start

        return wrapper

    for event in {getattr(Events, name) for name in dir(Events) if name.isupper()}:
        for entry in trainer.events.entries(event):  # the registry's own entries: wrap in place
            owner = getattr(entry.original, "__self__", None)
            if owner in handlers:
                entry.func = timed(entry.original, type(owner).__name__)


@contextlib.contextmanager
def _timed_background_writing(spent: dict):
    """Add the CPU time RecordFiles spend writing records out (on their threads, or at a flush or
    close on the training thread) to ``spent``."""
    from hookloop.engine.record_file import RecordFile

    drain = RecordFile._drain

    def timed(self):
        start = time.thread_time_ns()
        try:
            drain(self)
        finally:
            spent["writing records (background)"] += time.thread_time_ns() - start

    RecordFile._drain = timed
    try:
        yield
    finally:
        RecordFile._drain = drain


def non_log_steps(stamped: Stamped) -> list[float]:
    """CPU seconds of the steps that do not log (``step_times`` starts at step 2; the last step
    publishes too)."""
    last = len(stamped.data) // stamped.accum
    return [t for k, t in enumerate(stamped.step_times("cpu"), start=2) if k % LOG_EVERY and k < last]


def single_loggers(data: list, rounds: int, quick: bool) -> dict[str, dict[str, float]]:
    """Each shipped logger alone (with the tracker), every LOG_EVERY steps, against no logging and
    against the tracker alone, on the steps that do not log: per round the contender's median
    non-log step over the reference's median step, then the median over rounds."""
    contenders = {BASE: None, **SINGLE_LOGGERS}
    try:
        import wandb  # noqa: F401
    except ImportError:
        contenders.pop("tracker + W&B offline")
        print("(W&B skipped: wandb is not installed; pip install -e '.[wandb]')")
    if quick:
        contenders.pop("tracker + W&B offline", None)  # its start-up takes seconds a run
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        contenders.pop("tracker + TensorBoard")
    names = list(contenders)
    steps: dict[str, list[float]] = {name: [] for name in names}  # per round: the median non-log step
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in contenders.values():  # warm-up
            run(cfg, data[: LOG_EVERY + 2], Path(tmp))
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                stamped = run(contenders[name], data, Path(tmp))
                steps[name].append(
                    statistics.median(non_log_steps(stamped) if name != BASE else stamped.step_times("cpu"))
                )
        # each handler's own callbacks on the steps that do not log: CPU time of the training
        # thread inside them, robust to other processes (separate runs; wrapping costs a little)
        last = len(data)
        profiled = 1 if quick else 3
        spent: dict[str, dict[str, int]] = {}
        for name in names[1:]:
            spent[name] = defaultdict(int)
            for _ in range(profiled):
                run(contenders[name], data, Path(tmp), spent[name], lambda k: k % LOG_EVERY and 1 < k < last)
    non_log = profiled * sum(1 for k in range(2, last) if k % LOG_EVERY)
    rows = {}
    for name in names[1:]:
        callbacks = {h: ns / non_log / 1e3 for h, ns in spent[name].items()}
        rows[name] = {
            "cpu_ms": 1e3 * statistics.median(steps[name]),
            "ratio": statistics.median(t / b for t, b in zip(steps[name], steps[BASE])),
            "alone_us": 1e6 * statistics.median(t - b for t, b in zip(steps[name], steps[TRACKER_ONLY])),
            "tracker_callbacks_us": callbacks.pop("MetricsTracker", 0.0),
            "logger_callbacks_us": sum(callbacks.values()),
        }
    print(
        f"\neach logger alone, logging every {LOG_EVERY} steps, on the steps it does not log "
        f"({rounds} rounds x {len(data) - 1} steps, order turning; CPU time)"
    )
    head = f"{'contender':34s} {'CPU ms/step':>12s} {'/ no logging':>13s} {'logger alone':>13s}"
    print(f"{head} {'in tracker':>11s} {'in logger':>10s} {'logger / step':>14s}")
    base_ms = 1e3 * statistics.median(steps[BASE])
    print(f"{BASE:34s} {base_ms:12.3f} {1.0:13.3f} {'-':>13s}")
    for name, row in rows.items():
        alone = "-" if name == TRACKER_ONLY else f"{row['alone_us']:+10.1f} us"
        share = 1 + row["logger_callbacks_us"] / (1e3 * base_ms)
        print(
            f"{name:34s} {row['cpu_ms']:12.3f} {row['ratio']:13.3f} {alone:>13s} "
            f"{row['tracker_callbacks_us']:8.1f} us {row['logger_callbacks_us']:7.1f} us {share:14.4f}"
        )
    print(
        f"/ no logging: median over rounds of the round's median non-log step over its median step "
        f"without logging (target <= {NON_LOG_TARGET}); logger alone: the same difference to the "
        "tracker alone (what the logger adds to a step it does not log); in tracker / in logger: CPU "
        "time inside their callbacks per non-log step (separate runs, 1 with --quick); logger / step: "
        "1 + in logger over the step without logging"
    )
    rows[BASE] = {"cpu_ms": 1e3 * statistics.median(steps[BASE])}
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (CI)")
    parser.add_argument("--profile", action="store_true", help="also time inside each handler")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 20, 10
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    contenders = dict(CONTENDERS) if args.quick else {**CONTENDERS, **EVERY_10}
    names = list(contenders)
    data = make_data(args.steps + 1)  # the first step is left out
    wall: dict[str, list[float]] = {name: [] for name in names}  # per round: the median step
    cpu: dict[str, list[float]] = {name: [] for name in names}
    cpu_mean: dict[str, list[float]] = {name: [] for name in names}  # per round: the mean step
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in contenders.values():  # warm-up: imports, allocator, the first event file
            run(cfg, data[:4], Path(tmp))
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                stamped = run(contenders[name], data, Path(tmp))
                wall[name].append(statistics.median(stamped.step_times("wall")))
                cpu[name].append(statistics.median(stamped.step_times("cpu")))
                cpu_mean[name].append(statistics.fmean(stamped.step_times("cpu")))
        spent: dict[str, dict[str, int]] = {}
        if args.profile:
            for name in names[1:]:
                spent[name] = defaultdict(int)
                with _timed_background_writing(spent[name]):
                    for _ in range(3):
                        run(contenders[name], data, Path(tmp), spent[name])

    def ratio(times: dict[str, list[float]], name: str) -> float:
        # per round (same round, same machine load), then the median over rounds
        return statistics.median(t / b for t, b in zip(times[name], times[BASE]))

    print(
        f"{args.rounds} rounds x {args.steps} steps per contender, order turning each round; "
        "GPT d_model=64 layers=2 seq=32 batch=8, 1 thread"
    )
    head = f"{'contender':42s} {'CPU ms/step':>12s} {'ratio':>6s} {'mean-step ratio':>15s}"
    print(f"{head} {'wall ms/step':>12s} {'ratio':>6s}")
    rows = {}
    for name in names:
        mw, mc = statistics.median(wall[name]), statistics.median(cpu[name])
        rows[name] = {
            "wall_ms": 1e3 * mw,
            "wall_ratio": ratio(wall, name),
            "cpu_ms": 1e3 * mc,
            "cpu_ratio": ratio(cpu, name),
            "cpu_mean_step_ratio": ratio(cpu_mean, name),
        }
        row = rows[name]
        cpu_part = f"{row['cpu_ms']:12.3f} {row['cpu_ratio']:6.3f} {row['cpu_mean_step_ratio']:15.3f}"
        print(f"{name:42s} {cpu_part} {row['wall_ms']:12.3f} {row['wall_ratio']:6.3f}")
    print(
        "ms/step: median over rounds of the round's median step; ratio: median over rounds of the "
        f"round's ratio to {BASE!r} (mean-step ratio: the same with each round's mean step); "
        f"target <= {TARGET} for logging every step"
    )
    for name, by_handler in spent.items():
        per_step = {h: ns / (3 * args.steps * 1e3) for h, ns in by_handler.items()}
        parts = ", ".join(f"{h} {us:.1f}" for h, us in per_step.items())
        print(f"in handlers, {name}: {sum(per_step.values()):.1f} us/step ({parts})")
    single_steps = (2 if args.quick else 4) * LOG_EVERY + 1
    single = single_loggers(
        make_data(single_steps), 2 if args.quick else max(3, args.rounds // 2), args.quick
    )

    figures = [
        {
            "figure": f"step CPU time, {name}",
            "hookloop": rows[name]["cpu_ms"],
            "reference": rows[BASE]["cpu_ms"],
            "ratio": rows[name]["cpu_ratio"],
            "target": f"<= {TARGET}",
            "met": rows[name]["cpu_ratio"] <= TARGET,
            "unit": "ms",
        }
        for name in CONTENDERS
        if name != BASE
    ]
    figures += [
        {
            "figure": f"step CPU time on steps it does not log, {name}, every {LOG_EVERY} steps",
            "hookloop": row["cpu_ms"],
            "reference": single[BASE]["cpu_ms"],
            "ratio": row["ratio"],
            "target": f"<= {NON_LOG_TARGET}",
            "met": row["ratio"] <= NON_LOG_TARGET,
            "unit": "ms",
        }
        for name, row in single.items()
        if name != BASE
    ]
    figures += [
        {
            "figure": f"CPU in the logger's callbacks on steps it does not log, {name}, every {LOG_EVERY} "
            "steps (1 + its share of the step without logging)",
            "hookloop": row["logger_callbacks_us"],
            "reference": 1e3 * single[BASE]["cpu_ms"],
            "ratio": 1 + row["logger_callbacks_us"] / (1e3 * single[BASE]["cpu_ms"]),
            "target": f"<= {NON_LOG_TARGET}",
            "met": 1 + row["logger_callbacks_us"] / (1e3 * single[BASE]["cpu_ms"]) <= NON_LOG_TARGET,
            "unit": "us",
        }
        for name, row in single.items()
        if name not in (BASE, TRACKER_ONLY)
    ]
    result = {
        "benchmark": "logging",
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
        "single_loggers": single,
        "figures": figures,
        "notes": (
            "Reference: a Trainer with no logging on the same model and data. Steady-state steps timed "
            "at data fetch by the process's CPU time (the first step and set-up left out), the round's "
            "median step, median of per-round ratios over rounds whose order turns."
        ),
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
