"""Step-time overhead of observability: MetricsTracker + JSONL + TensorBoard vs no handlers.

Trains the same tiny GPT for N steps in one process, alternating configurations so drift on a
shared machine hits them alike; reports per configuration the median (over repeats) of the mean
step time, in wall time and in CPU time of the training thread (robust to other processes on the
machine), with ratios to the bare Trainer measured in the same run, and the CPU time spent inside
the handlers' own callbacks.

    python benchmarks/logging_overhead.py            # full (about a minute on 2 cores)
    python benchmarks/logging_overhead.py --quick    # well under a minute
    python benchmarks/logging_overhead.py --json out.json   # figures for benchmarks/run.py
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hookloop.engine import Events, Trainer  # noqa: E402
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402


def make_data(steps: int, batch: int, seq: int) -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (steps * batch, seq + 1), generator=g)
    return [(x[i : i + batch, :-1], x[i : i + batch, 1:]) for i in range(0, steps * batch, batch)]


def _time_handlers(trainer: Trainer, owners: tuple, spent: list[float]) -> None:
    """Wrap the event handlers bound to ``owners`` so the CPU time inside them adds up in ``spent``."""

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start

        return wrapper

    events = {getattr(Events, name) for name in dir(Events) if name.isupper()}
    for event in events:
        for entry in trainer.events.entries(event):  # the registry's own entries: wrap in place
            if getattr(entry.original, "__self__", None) in owners:
                entry.func = timed(entry.original)


def run(config: str, data: list, steps: int, log_dir: Path, spent: list | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the training thread) per step of one run of ``config``; with
    ``spent``, CPU time inside the handlers is added to ``spent[0]``."""
    from hookloop.handlers.jsonl_logger import JSONLLogger
    from hookloop.handlers.metrics import MetricsTracker
    from hookloop.handlers.tensorboard_logger import TensorBoardLogger

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=data[0][0].shape[1], n_layers=2, d_model=64, n_heads=4))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)
    if config != "bare":
        every = 1 if config.endswith("every step") else 10
        run_dir = Path(tempfile.mkdtemp(dir=log_dir))
        owners: tuple = (
            MetricsTracker(every, run_dir=run_dir).attach(trainer),
            JSONLLogger(run_dir / "metrics.jsonl").attach(trainer),
        )
        if "+tb" in config:
            owners += (TensorBoardLogger(run_dir / "tb").attach(trainer),)
        if spent is not None:
            _time_handlers(trainer, owners, spent)
    wall, cpu = time.perf_counter(), time.thread_time()
    trainer.run(data, max_steps=steps)
    return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write the figures here (benchmarks/run.py format)")
    args = parser.parse_args()
    steps = args.steps or (60 if args.quick else 200)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    data = make_data(steps, batch=8, seq=32)
    configs = [
        "bare",
        "tracker+jsonl, every step",
        "tracker+jsonl+tb, every step",
        "tracker+jsonl+tb, every 10",
    ]
    wall: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for c in configs:  # warm-up: imports, allocator, first event file
            run(c, data, min(steps, 10), Path(tmp))
        for r in range(repeats):
            for c in configs if r % 2 == 0 else configs[::-1]:
                w, u = run(c, data, steps, Path(tmp))
                wall[c].append(w)
                cpu[c].append(u)
        # CPU time spent inside the three handlers' callbacks, measured around each call
        inside: dict[str, float] = {"bare": 0.0}
        for c in configs[1:]:
            spent = [0.0]
            run(c, data, steps, Path(tmp), spent=spent)
            inside[c] = spent[0] / steps
    base_wall, base_cpu = statistics.median(wall["bare"]), statistics.median(cpu["bare"])
    print(f"\n{steps} steps x {repeats} repeats, GPT d_model=64 layers=2 seq=32 batch=8, 1 thread")
    print(
        f"{'configuration':32s} {'wall ms/step':>12s} {'ratio':>6s} {'CPU ms/step':>12s} {'ratio':>6s}"
        f" {'in handlers us/step':>20s} {'% of bare CPU step':>19s}"
    )
    for c in configs:
        mw, mc = statistics.median(wall[c]), statistics.median(cpu[c])
        print(
            f"{c:32s} {1e3 * mw:12.3f} {mw / base_wall:6.3f} {1e3 * mc:12.3f} {mc / base_cpu:6.3f}"
            f" {1e6 * inside[c]:20.1f} {100 * inside[c] / base_cpu:18.2f}%"
        )
    print(
        "wall / CPU: medians over repeats of the per-step mean; CPU = time.thread_time of the training thread"
    )
    print("in handlers: CPU time inside the MetricsTracker, JSONL (and TensorBoard) callbacks per step")
    if args.json:
        figures = []
        for c, target in (("tracker+jsonl+tb, every step", 1.03), ("tracker+jsonl+tb, every 10", None)):
            # training-thread CPU time: on a shared machine far steadier than wall time
            mc = statistics.median(cpu[c])
            figures.append(
                {
                    "figure": f"step CPU time, tracker + JSONL + TensorBoard logging {c.split(', ')[1]}",
                    "hookloop": 1e3 * mc,
                    "reference": 1e3 * base_cpu,
                    "ratio": mc / base_cpu,
                    "target": f"<= {target}" if target else None,
                    "met": (mc / base_cpu <= target) if target else None,
                    "unit": "ms",
                }
            )
        rows = {
            c: {
                "wall_ms": 1e3 * statistics.median(wall[c]),
                "cpu_ms": 1e3 * statistics.median(cpu[c]),
                "in_handlers_us": 1e6 * inside[c],
            }
            for c in configs
        }
        result = {
            "benchmark": "logging",
            "steps": steps,
            "repeats": repeats,
            "rows": rows,
            "figures": figures,
            "notes": "Reference: the bare Trainer on the same model and data in the same run.",
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
