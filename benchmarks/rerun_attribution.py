"""RerunAttribution cost: step time with and without it on good steps, and one rerun against one step.

    python benchmarks/rerun_attribution.py [--quick] [--json PATH]

Both contenders train the same tiny GPT on the same data from the same seed with the NaNDetector
attached (what attribution needs); they alternate over rounds and the figure is the median of
per-round ratios. On a good step attribution keeps the RNG state (a few KB copied) and adds one value
to the step's agreement; nothing else runs. Single process, so the rerun on a peer is not measured:
on several ranks a bad step also gathers the ranks' verdicts and, when the step reproduces, reruns
it once more on a peer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import ACCUM, alternating, seconds_per_step, tiny_gpt, token_microbatches, write_result  # noqa: E402

from hookloop.engine import Trainer  # noqa: E402
from hookloop.handlers.attribution import RerunAttribution  # noqa: E402
from hookloop.handlers.nan_detector import NaNDetector  # noqa: E402
from hookloop.models.gpt import cross_entropy_loss  # noqa: E402


def build(attribution: bool) -> tuple[Trainer, RerunAttribution | None]:
    model = tiny_gpt()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        cross_entropy_loss,
        grad_accum_steps=ACCUM,
        grad_clip_norm=1.0,
        hang_timeout_s=None,
    )
    NaNDetector(action="warn").attach(trainer)
    handler = RerunAttribution(quarantine=False).attach(trainer) if attribution else None
    return trainer, handler


def rerun_seconds(data: list, repeats: int) -> float:
    """Median wall time of one rerun of a step's microbatches (forward and backward, then judged)."""
    trainer, handler = build(True)
    trainer.run(data[: 2 * ACCUM], max_epochs=1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        handler._rerun(data[:ACCUM], None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def good_step_work_seconds(data: list, repeats: int = 2000) -> float:
    """CPU time of what attribution does on a good step, measured alone: keeping the RNG state at
    STEP_START and filling its slot of the agreement (one more value packed with the others)."""
    trainer, handler = build(True)
    trainer.run(data[: 2 * ACCUM], max_epochs=1)
    start = time.process_time()
    for _ in range(repeats):
        handler._keep_rng()
        handler._fill()
    return (time.process_time() - start) / repeats


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
    without, with_, ratio = alternating(
        lambda: seconds_per_step(build(False)[0], data),
        lambda: seconds_per_step(build(True)[0], data),
        args.repeats,
    )
    a, b = statistics.median(with_) * 1e3, statistics.median(without) * 1e3
    rerun = rerun_seconds(data, args.repeats) * 1e3
    work = good_step_work_seconds(data) * 1e3
    print(f"good steps: without attribution {b:.3f} ms/step, with {a:.3f} ms/step, ratio {ratio:.4f}")
    print(f"attribution's own work on a good step {work * 1e3:.1f} us = {work / b:.5f} of a step")
    print(f"one rerun of a step's microbatches {rerun:.3f} ms = {rerun / b:.2f} x a step")
    result = {
        "benchmark": "rerun_attribution",
        "figures": [
            {
                "figure": "step time with RerunAttribution, good steps",
                "hookloop": a,
                "reference": b,
                "ratio": ratio,
                "target": "<= 1.02",
                "met": ratio <= 1.02,
                "unit": "ms",
            },
            {
                "figure": "attribution's own work on a good step vs one step",
                "hookloop": work,
                "reference": b,
                "ratio": 1 + work / b,
                "target": "<= 1.02",
                "met": 1 + work / b <= 1.02,
                "unit": "ms",
            },
            {"figure": "one rerun vs one step", "hookloop": rerun, "reference": b, "ratio": rerun / b},
        ],
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
