"""Engine overhead: the same training run by a hand-written loop, a bare Trainer, and a Trainer with
10 no-op handlers on every event.

Each contender trains the same tiny GPT on the same data from the same seed for ``--steps`` steps;
contenders alternate over ``--repeats`` rounds, the order turning each round. A step's time is read
where every contender reads its data (the time between fetching the first microbatch of one step
and of the next), so the three are timed by the same clock at the same places and no handler is
added to time the engine; the first step and the run's set-up are left out (start-up has a
benchmark of its own). Per round, each contender's median step; the ratio is the median over rounds
of the per-round ratio to the hand-written loop (rounds next to each other see the same machine:
this one's speed drifts by up to 50% over seconds).

    python benchmarks/overhead.py [--quick] [--json PATH]
    python benchmarks/overhead.py --by-callback   # the default set's Python, callback by callback
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import ACCUM, Stamped, tiny_gpt, token_microbatches, write_result  # noqa: E402

from hookloop.engine import Events, Trainer  # noqa: E402
from hookloop.models.gpt import cross_entropy_loss  # noqa: E402

CLIP = 1.0
EVENTS = [
    Events.TRAIN_START,
    Events.EPOCH_START,
    Events.STEP_START,
    Events.MICROBATCH,
    Events.BEFORE_OPTIMIZER_STEP,
    Events.STEP_END,
    Events.EPOCH_END,
    Events.TRAIN_END,
]


def setup(seed: int = 0):
    model = tiny_gpt(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def hand_written(data: list) -> float:
    model, opt, sched = setup()
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    stamped = Stamped(data)
    batches = iter(stamped)
    for _ in range(len(data) // ACCUM):
        group = [next(batches) for _ in range(ACCUM)]
        total = 0.0
        for x, y in group:
            loss = cross_entropy_loss(model(x), y)
            (loss / len(group)).backward()
            total += float(loss.detach())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, CLIP, norm, foreach=True)
        float(norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    for _ in batches:  # the end stamp
        pass
    return stamped.step_seconds()


def hookloop(data: list, n_handlers: int = 0) -> float:
    model, opt, sched = setup()
    trainer = Trainer(
        model, opt, cross_entropy_loss, lr_scheduler=sched, grad_accum_steps=ACCUM, grad_clip_norm=CLIP
    )
    for _ in range(n_handlers):
        for event in EVENTS:
            trainer.add_event_handler(event, lambda: None)
    stamped = Stamped(data)
    trainer.run(stamped, max_epochs=1)
    return stamped.step_seconds()


# ------------------------------------------------------------------------------ Python per step
TRIVIAL_STEPS = 300
LOG_EVERY = 10  # logging.log_interval's default


def _trivial_data() -> list:
    g = torch.Generator().manual_seed(0)
    pairs = range(TRIVIAL_STEPS * ACCUM)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in pairs]


def _per_step(stamps: list[float]) -> dict[str, float]:
    """Median CPU seconds of steps that log and of steps that do not (step k ends at stamps[k - 1];
    the first 20 steps and the last 5 left out)."""
    steps = {k: b - a for k, (a, b) in enumerate(zip(stamps, stamps[1:]), start=2)}
    kept = {k: v for k, v in steps.items() if 20 < k < TRIVIAL_STEPS - 5}
    return {
        "plain": statistics.median(v for k, v in kept.items() if k % LOG_EVERY),
        "log": statistics.median(v for k, v in kept.items() if not k % LOG_EVERY),
    }


def python_per_step(config: str, data: list, directory: str, before_run: Any = None) -> dict[str, float]:
    """CPU time per step of the training thread on a model too small to cost anything (Linear(8, 8)):
    the Python of the loop itself. ``config``: "hand" (a hand-written loop), "bare" (a Trainer) or
    "default" (the handlers ``hookloop train`` attaches by default: step scheduler, checkpointer,
    NaN detector, metrics, JSONL and console loggers, logging every 10 steps; no periodic saves)."""
    import logging
    import time

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    mse = torch.nn.functional.mse_loss
    stamps: list[float] = []
    if config == "hand":
        params = list(model.parameters())
        for s in range(TRIVIAL_STEPS):
            for x, y in data[s * ACCUM : (s + 1) * ACCUM]:
                (mse(model(x), y) / ACCUM).backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            torch.nn.utils.clip_grads_with_norm_(params, CLIP, norm, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.append(time.thread_time())
        return _per_step(stamps)
    trainer = Trainer(model, opt, mse, grad_accum_steps=ACCUM, grad_clip_norm=CLIP)
    attached: list = []
    if config == "default":
        from hookloop.handlers import attach_handlers, load_run_config

        logging.getLogger("hookloop").setLevel(logging.WARNING)  # the console logger's lines
        overrides = [
            f"train.run_dir={directory}",
            "train.local_batch_size=8",
            f"step_scheduler.global_batch_size={8 * ACCUM}",
            f"step_scheduler.max_steps={TRIVIAL_STEPS}",
            "step_scheduler.num_epochs=null",
            "step_scheduler.ckpt_every_steps=null",
            "step_scheduler.val_every_steps=null",
            "checkpoint.resume=null",
        ]
        attached = attach_handlers(trainer, load_run_config(None, overrides), dataloader=data, dp_size=1)
    trainer.add_event_handler(Events.STEP_END, lambda: stamps.append(time.thread_time()))
    if before_run is not None:
        before_run(trainer)
    trainer.run(data, max_steps=TRIVIAL_STEPS)
    for handler in attached:
        getattr(handler, "close", lambda: None)()
    return _per_step(stamps)


def by_callback(data: list, directory: str, runs: int = 3) -> dict[str, tuple[float, float]]:
    """Where the default set's Python goes: CPU seconds of the training thread inside each registered
    callback (``EVENT Class.method``) per step that does not log and per step that logs (steps
    21 .. TRIVIAL_STEPS - 5), the median over ``runs`` runs of :func:`python_per_step`'s "default"
    configuration after one to warm up. Each callback is wrapped in place from step 5 on (so those
    a handler adds at TRAIN_START count too); the wrapper's own clock reads cost a little."""
    import collections
    import time

    from hookloop.engine.events import _handler_name

    counted = range(21, TRIVIAL_STEPS - 4)
    steps = (sum(1 for k in counted if k % LOG_EVERY), sum(1 for k in counted if not k % LOG_EVERY))

    def one(spent: dict[str, list[float]]) -> Callable:
        def wrap_all(trainer: Any) -> None:
            state = trainer.state
            own = "python_per_step.<locals>."  # the harness's own clock is not the set's

            def timed(func: Callable, name: str) -> Callable:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    start = time.thread_time()
                    try:
                        return func(*args, **kwargs)
                    finally:
                        if 20 < state.step < TRIVIAL_STEPS - 4:
                            spent[name][0 if state.step % LOG_EVERY else 1] += time.thread_time() - start

                return wrapper

            def wrap() -> None:
                for event in trainer.events.events():
                    for entry in trainer.events.entries(event):  # the registry's own entries
                        mine = getattr(entry.original, "__qualname__", "").startswith(own)
                        if not getattr(entry.func, "_timed", False) and not mine:
                            name = f"{getattr(event, 'name', event)} {_handler_name(entry.original)}"
                            entry.func = timed(entry.func, name)
                            entry.func._timed = True

            trainer.add_event_handler(Events.STEP_START(once=5), wrap)

        return wrap_all

    results = []
    for r in range(runs + 1):
        spent: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        python_per_step("default", data, os.path.join(directory, f"callbacks-{r}"), one(spent))
        if r:
            results.append({name: (v[0] / steps[0], v[1] / steps[1]) for name, v in spent.items()})
    names = sorted(
        set().union(*results), key=lambda n: -statistics.median(r.get(n, (0, 0))[0] for r in results)
    )
    return {
        n: tuple(statistics.median(r.get(n, (0.0, 0.0))[i] for r in results) for i in (0, 1)) for n in names
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--by-callback",
        action="store_true",
        help="only print where the default handler set's Python goes, callback by callback",
    )
    args = parser.parse_args(argv)
    if args.by_callback:
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            spent = by_callback(_trivial_data(), directory)
        print("CPU us per step inside each callback, default handler set, Linear(8, 8): no log / log")
        for name, (plain, log) in spent.items():
            print(f"{plain * 1e6:9.1f} {log * 1e6:9.1f}  {name}")
        total = [sum(v[i] for v in spent.values()) * 1e6 for i in (0, 1)]
        print(f"{total[0]:9.1f} {total[1]:9.1f}  total")
        return {"benchmark": "overhead", "callbacks": spent}
    if args.quick:
        args.steps, args.repeats = 10, 3
    torch.set_num_threads(args.threads)
    data = token_microbatches(args.steps)
    contenders = {
        "hand-written loop": lambda: hand_written(data),
        "Trainer, no handlers": lambda: hookloop(data, 0),
        "Trainer, 10 no-op handlers x 8 events": lambda: hookloop(data, 10),
    }
    for fn in contenders.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(contenders[name]())
    base = statistics.median(times["hand-written loop"])
    rows = {}
    print(f"{'contender':42s} {'median ms/step':>15s} {'spread ms':>10s} {'ratio':>7s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        spread = (max(ts) - min(ts)) * 1e3
        # Ratio per round (same round, same machine load), then the median over rounds.
        ratio = statistics.median(t / b for t, b in zip(ts, times["hand-written loop"]))
        rows[name] = {"median_ms": med * 1e3, "spread_ms": spread, "ratio": ratio}
        print(f"{name:42s} {med * 1e3:15.3f} {spread:10.3f} {ratio:7.3f}")
    print(
        f"target: bare <= 1.02 (got {rows['Trainer, no handlers']['ratio']:.3f}), "
        f"10 handlers <= 1.05 (got {rows['Trainer, 10 no-op handlers x 8 events']['ratio']:.3f}); "
        f"hand-written loop {base * 1e3:.3f} ms/step"
    )
    import tempfile

    trivial = _trivial_data()
    python: dict[str, list[dict[str, float]]] = {"hand": [], "bare": [], "default": []}
    with tempfile.TemporaryDirectory() as directory:
        for r in range(1 + max(2, args.repeats // 5)):  # round 0 warms up
            for config in python:
                measured = python_per_step(config, trivial, os.path.join(directory, f"{config}-{r}"))
                if r:
                    python[config].append(measured)
    cpu = {
        c: {k: statistics.median(m[k] for m in got) for k in ("plain", "log")} for c, got in python.items()
    }
    extra = {
        "bare": cpu["bare"]["plain"] - cpu["hand"]["plain"],
        "default, a step that does not log": cpu["default"]["plain"] - cpu["hand"]["plain"],
        "default, a step that logs": cpu["default"]["log"] - cpu["hand"]["plain"],
    }
    print(
        "Python per step (CPU of the training thread, Linear(8, 8)): hand-written loop "
        f"{cpu['hand']['plain'] * 1e6:.0f} us; extra: "
        + ", ".join(f"{k} {v * 1e6:+.0f} us" for k, v in extra.items())
        + f"; as a share of this run's hand-written tiny GPT step ({base * 1e3:.1f} ms): "
        + ", ".join(f"{k} {1 + v / base:.4f}" for k, v in extra.items())
    )
    ms = lambda name: rows[name]["median_ms"]  # noqa: E731
    bare, hooked = "Trainer, no handlers", "Trainer, 10 no-op handlers x 8 events"
    figures = [
        {
            "figure": "step time, Trainer with no handlers",
            "hookloop": ms(bare),
            "reference": base * 1e3,
            "ratio": rows[bare]["ratio"],
            "target": "<= 1.02",
            "met": rows[bare]["ratio"] <= 1.02,
            "unit": "ms",
        },
        {
            "figure": "step time, Trainer + 10 no-op handlers on every event",
            "hookloop": ms(hooked),
            "reference": base * 1e3,
            "ratio": rows[hooked]["ratio"],
            "target": "<= 1.05",
            "met": rows[hooked]["ratio"] <= 1.05,
            "unit": "ms",
        },
    ]
    for name, seconds in extra.items():
        target = 1.01 if name.endswith("does not log") else None
        figures.append(
            {
                "figure": f"Python per step over a hand-written loop's, {name} (CPU, as a share of the "
                "tiny GPT's hand-written step)",
                "hookloop": seconds * 1e6,
                "reference": base * 1e6,
                "ratio": 1 + seconds / base,
                "target": f"<= {target}" if target else None,
                "met": 1 + seconds / base <= target if target else None,
                "unit": "us",
            }
        )
    result = {
        "benchmark": "overhead",
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "rows": rows,
        "figures": figures,
        "notes": (
            "Reference: a hand-written loop doing the same accumulation, clipping and optimizer steps. "
            "Steady-state steps (the first step and set-up left out), median of per-round ratios."
        ),
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
