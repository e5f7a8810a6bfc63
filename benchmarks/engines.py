"""Head-to-head: the same tiny GPT, data, seed, batch and optimizer trained by

1. a hand-written PyTorch loop (the floor),
2. a hookloop Trainer with no handlers,
3. a hookloop Trainer with the default handler set (StepScheduler, NaNDetector, MetricsTracker +
   JSONL logger),
4. a raw ignite Engine running the same step function,
5. PyTorch Lightning's Trainer (logger, checkpointing, progress bar and model summary off), when
   the optional ``bench`` extra is installed.

Every contender records a timestamp at the end of each optimizer step; the figure is the median
step interval (steady state, set-up excluded), and each ratio is taken against the hand-written
loop within the same round, then the median over rounds. Threads are pinned the same way for all.

    python benchmarks/engines.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import ACCUM, tiny_gpt, token_microbatches, write_result  # noqa: E402

from hookloop.engine import Events, Priority, Trainer  # noqa: E402
from hookloop.models.gpt import cross_entropy_loss  # noqa: E402

CLIP = 1.0
LR = 1e-3


def setup(seed: int = 0):
    model = tiny_gpt(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def median_interval(stamps: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, group: list) -> None:
    """One optimizer step written by hand: the floor, and the raw ignite Engine's step function."""
    for x, y in group:
        (cross_entropy_loss(model(x), y) / len(group)).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def hand_written(data: list) -> float:
    model, opt = setup()
    stamps = []
    for i in range(0, len(data), ACCUM):
        plain_step(model, opt, data[i : i + ACCUM])
        stamps.append(time.perf_counter())
    return median_interval(stamps)


def hookloop_bare(data: list) -> float:
    model, opt = setup()
    trainer = Trainer(model, opt, cross_entropy_loss, grad_accum_steps=ACCUM, grad_clip_norm=CLIP)
    stamps: list[float] = []
    trainer.add_event_handler(
        Events.STEP_END, lambda: stamps.append(time.perf_counter()), priority=Priority.CLEANUP
    )
    trainer.run(data, max_epochs=1)
    return median_interval(stamps)


def hookloop_default_handlers(data: list) -> float | None:
    try:
        from hookloop.handlers.jsonl_logger import JSONLLogger
        from hookloop.handlers.metrics import MetricsTracker
        from hookloop.handlers.nan_detector import NaNDetector
        from hookloop.handlers.step_scheduler import StepScheduler
    except ImportError as e:
        print(f"  (default handler set unavailable: {e})")
        return None
    model, opt = setup()
    trainer = Trainer(model, opt, cross_entropy_loss, grad_clip_norm=CLIP)
    StepScheduler(
        global_batch_size=8 * ACCUM,
        local_batch_size=8,
        dp_size=1,
        dataloader=data,
        max_steps=len(data) // ACCUM,
    ).attach(trainer)
    NaNDetector(action="warn").attach(trainer)
    with tempfile.TemporaryDirectory() as tmp:
        MetricsTracker(log_interval=1, run_dir=tmp).attach(trainer)
        JSONLLogger(Path(tmp) / "metrics.jsonl").attach(trainer)
        stamps: list[float] = []
        trainer.add_event_handler(
            Events.STEP_END, lambda: stamps.append(time.perf_counter()), priority=Priority.CLEANUP
        )
        trainer.run(data)
    return median_interval(stamps)


def raw_ignite(data: list) -> float:
    from ignite.engine import Engine
    from ignite.engine import Events as IgniteEvents

    model, opt = setup()
    engine = Engine(lambda _engine, group: plain_step(model, opt, group))
    stamps: list[float] = []
    engine.add_event_handler(IgniteEvents.ITERATION_COMPLETED, lambda: stamps.append(time.perf_counter()))
    groups = [data[i : i + ACCUM] for i in range(0, len(data), ACCUM)]
    engine.run(groups, max_epochs=1)
    return median_interval(stamps)


def lightning_trainer(data: list) -> float | None:
    try:
        import lightning as L
    except ImportError:
        print("  (Lightning not installed: pip install -e '.[bench]' to include it)")
        return None
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, _ = setup()

        def training_step(self, batch, _idx):
            x, y = batch
            return cross_entropy_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=LR)

    stamps: list[float] = []

    class Stamp(L.Callback):
        def on_before_zero_grad(self, *_args) -> None:
            stamps.append(time.perf_counter())

    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=CLIP,
        callbacks=[Stamp()],
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), loader)
    return median_interval(stamps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 15, 2
    torch.set_num_threads(args.threads)
    data = token_microbatches(args.steps)
    contenders = {
        "hand-written loop": hand_written,
        "hookloop, no handlers": hookloop_bare,
        "hookloop, default handlers": hookloop_default_handlers,
        "raw ignite Engine": raw_ignite,
        "Lightning Trainer": lightning_trainer,
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for name, fn in contenders.items():  # warm-up, and find who is available
        if fn(data) is None:
            times.pop(name)
    for _ in range(args.repeats):
        for name in times:
            times[name].append(contenders[name](data))
    base = times["hand-written loop"]
    rows = {}
    print(f"{'contender':30s} {'median ms/step':>15s} {'spread ms':>10s} {'ratio':>7s}")
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base))
        rows[name] = {
            "median_ms": statistics.median(ts) * 1e3,
            "spread_ms": (max(ts) - min(ts)) * 1e3,
            "ratio": ratio,
        }
        print(f"{name:30s} {rows[name]['median_ms']:15.3f} {rows[name]['spread_ms']:10.3f} {ratio:7.3f}")
    targets = {"hookloop, no handlers": 1.02, "hookloop, default handlers": 1.05}
    figures = []
    for name, row in rows.items():
        if name == "hand-written loop":
            continue
        target = targets.get(name)
        figures.append(
            {
                "figure": f"step time, {name}",
                "hookloop": row["median_ms"] if name.startswith("hookloop") else None,
                "reference": rows["hand-written loop"]["median_ms"],
                "ratio": row["ratio"],
                "target": f"<= {target}" if target else None,
                "met": (row["ratio"] <= target) if target else None,
                "unit": "ms",
            }
        )
    if "Lightning Trainer" in rows:
        lightning = rows["Lightning Trainer"]["ratio"]
        bare = rows["hookloop, no handlers"]["ratio"]
        figures.append(
            {
                "figure": "hookloop (no handlers) / Lightning, step time",
                "hookloop": bare,
                "reference": lightning,
                "ratio": bare / lightning,
                "target": "< 1 (ahead of Lightning)",
                "met": bare < lightning,
            }
        )
    result = {
        "benchmark": "engines",
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
        "figures": figures,
        "notes": "Ratios against the hand-written loop: same model, data, seed, optimizer.",
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
