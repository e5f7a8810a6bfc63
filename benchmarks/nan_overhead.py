"""NaNDetector overhead: step time of the same run with and without the detector attached.

    python benchmarks/nan_overhead.py [--quick] [--json PATH]

Both contenders train the same tiny GPT on the same data from the same seed; they alternate over
rounds and the figure is the median of per-round ratios. Single process, so the detector's
all-reduce is the identity: on several ranks it adds one 4-byte all-reduce per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import ACCUM, alternating, seconds_per_step, tiny_gpt, token_microbatches, write_result  # noqa: E402

from hookloop.engine import Trainer  # noqa: E402
from hookloop.handlers.nan_detector import NaNDetector  # noqa: E402
from hookloop.models.gpt import cross_entropy_loss  # noqa: E402


def run(data: list, detector: bool) -> float:
    model = tiny_gpt()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        cross_entropy_loss,
        grad_accum_steps=ACCUM,
        grad_clip_norm=1.0,
    )
    if detector:
        NaNDetector(action="warn", spike_factor=10.0).attach(trainer)
    return seconds_per_step(trainer, data)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 20, 3
    torch.set_num_threads(1)
    data = token_microbatches(args.steps)
    without, with_, ratio = alternating(lambda: run(data, False), lambda: run(data, True), args.repeats)
    a, b = statistics.median(with_) * 1e3, statistics.median(without) * 1e3
    print(
        f"without detector {b:.3f} ms/step, with detector {a:.3f} ms/step, ratio {ratio:.4f} (target <= 1.02)"
    )
    result = {
        "benchmark": "nan_detector",
        "figures": [
            {
                "figure": "step time with NaNDetector (spike check on)",
                "hookloop": a,
                "reference": b,
                "ratio": ratio,
                "target": "<= 1.02",
                "met": ratio <= 1.02,
                "unit": "ms",
            }
        ],
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
