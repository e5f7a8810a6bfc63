"""WeightEMA overhead: step time of the example's model with a moving average updated every step
against none.

    python benchmarks/ema.py [--quick] [--json PATH]

The model is the example's (``examples/configs/gpt_tiny.yaml``: GPT, 4 layers, d_model 128, 8 x 64
tokens per microbatch, 2 microbatches per step, AdamW, clipping); both contenders train it on the
same data from the same seed, alternating over rounds; the figure is the median of per-round
ratios. One process, one intra-op thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import ACCUM, alternating, seconds_per_step, token_microbatches, write_result  # noqa: E402

from hookloop.engine import Trainer  # noqa: E402
from hookloop.handlers.ema import WeightEMA  # noqa: E402
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402

TARGET = 1.05


def run(data: list, ema: bool) -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layers=4, d_model=128, n_heads=4))
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
        cross_entropy_loss,
        grad_accum_steps=ACCUM,
        grad_clip_norm=1.0,
    )
    if ema:
        WeightEMA(decay=0.999, every_steps=1).attach(trainer)
    return seconds_per_step(trainer, data)


def update_seconds(repeats: int = 200) -> float:
    """The average's update alone (one fused lerp over the example's parameters), per update: a
    figure that load on the machine moves far less than a step time ratio."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layers=4, d_model=128, n_heads=4))
    params = [p.detach() for p in model.parameters()]
    average = [p.clone() for p in params]
    for _ in range(10):
        torch._foreach_lerp_(average, params, 0.001)
    start = time.perf_counter()
    for _ in range(repeats):
        torch._foreach_lerp_(average, params, 0.001)
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 10, 3
    torch.set_num_threads(1)
    data = token_microbatches(args.steps)
    without, with_, ratio = alternating(lambda: run(data, False), lambda: run(data, True), args.repeats)
    a, b = statistics.median(with_) * 1e3, statistics.median(without) * 1e3
    alone = update_seconds() * 1e3
    print(
        f"without EMA {b:.3f} ms/step, with EMA every step {a:.3f} ms/step, ratio {ratio:.4f} "
        f"(target <= {TARGET})\n"
        f"the update alone: {alone:.3f} ms, {alone / b:.4f} of a step without EMA"
    )
    result = {
        "benchmark": "ema",
        "figures": [
            {
                "figure": "step time with WeightEMA updated every step (the example's model)",
                "hookloop": a,
                "reference": b,
                "ratio": ratio,
                "target": f"<= {TARGET}",
                "met": ratio <= TARGET,
                "unit": "ms",
            },
            {
                "figure": "WeightEMA update alone, per step (the example's model)",
                "hookloop": alone,
                "reference": b,
                "ratio": 1 + alone / b,
                "target": f"<= {TARGET}",
                "met": 1 + alone / b <= TARGET,
                "unit": "ms",
            },
        ],
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
