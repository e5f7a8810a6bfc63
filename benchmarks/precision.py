"""Mixed precision: step time of the tiny GPT with ``precision="bf16-mixed"`` against fp32.

Both contenders are bare Trainers on the same model, data and seed; they alternate over
``--repeats`` rounds and the figure is the median per-step time, with the ratio taken per round.
On a CPU without native bf16 matrix units autocast adds casts and gains nothing: a ratio above 1 is
expected here; the figure exists to see the cost, not to meet a target.

    python benchmarks/precision.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import ACCUM, seconds_per_step, tiny_gpt, token_microbatches, write_result  # noqa: E402

from hookloop.engine import Trainer  # noqa: E402
from hookloop.models.gpt import cross_entropy_loss  # noqa: E402


def step_time(data: list, precision: str) -> float:
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(
        model,
        opt,
        cross_entropy_loss,
        grad_accum_steps=ACCUM,
        grad_clip_norm=1.0,
        hang_timeout_s=None,
        precision=precision,
    )
    return seconds_per_step(trainer, data)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 10, 3
    torch.set_num_threads(args.threads)
    data = token_microbatches(args.steps)
    names = ("fp32", "bf16-mixed")
    for name in names:  # warm-up
        step_time(data, name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            times[name].append(step_time(data, name))
    ratio = statistics.median(b / f for b, f in zip(times["bf16-mixed"], times["fp32"]))
    rows = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    print(f"{'precision':12s} {'median ms/step':>15s}")
    for name, ms in rows.items():
        print(f"{name:12s} {ms:15.3f}")
    print(f"bf16-mixed / fp32: {ratio:.3f} (median of per-round ratios, {args.threads} thread(s))")
    result = {
        "benchmark": "precision",
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "rows": rows,
        "figures": [
            {
                "figure": "bf16-mixed vs fp32 step time on the tiny GPT",
                "hookloop": rows["bf16-mixed"],
                "reference": rows["fp32"],
                "ratio": ratio,
                "target": None,
                "met": None,
                "unit": "ms",
            }
        ],
        "notes": "Reference: the same Trainer in fp32. CPU run: bf16 autocast is not expected to be faster.",
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
