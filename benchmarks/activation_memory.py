"""Activation checkpointing and compile: memory saved for backward, and what they cost in time.

    python benchmarks/activation_memory.py [--quick] [--json PATH]

Memory: bytes of activations one forward pass keeps for backward
(:func:`engine.activation_checkpointing.saved_activation_bytes`: ``saved_tensors_hooks`` over the
forward, each tensor once, parameters left out, plus the inputs a checkpointed block keeps) on the
example's GPT (``examples/configs/gpt_tiny.yaml``: 4 layers, d_model 128, batch 8, seq 64) with no,
full and selective (every other block) activation checkpointing. The recomputation during backward
saves one block's activations again for a moment; that transient is not counted.

Time: forward + backward + AdamW step per optimizer step, the three modes alternating over rounds;
the figure is the median of per-round ratios to no checkpointing.

Compile (left out with ``--quick``): a smaller GPT compiled per block, the first step (compilation,
cold: inductor's caches off) timed alone, then step time after warm-up against the same model eager.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# The warm-up figure is a cold compile: inductor's on-disk caches would make a second run's fast.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import write_result  # noqa: E402

from hookloop.engine.activation_checkpointing import apply_activation_checkpointing, saved_activation_bytes  # noqa: E402
from hookloop.engine.compile import compile_model  # noqa: E402
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402

MODES = ("none", "full", "selective")
EXAMPLE = dict(vocab_size=256, seq_len=64, n_layers=4, d_model=128, n_heads=4)
BATCH = 8


def model_for(mode: str, cfg: dict) -> GPT:
    torch.manual_seed(0)
    return apply_activation_checkpointing(GPT(GPTConfig(**cfg)), mode)


def batch(cfg: dict, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg["vocab_size"], (BATCH, cfg["seq_len"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def step_seconds(model: torch.nn.Module, opt: torch.optim.Optimizer, data: tuple, steps: int) -> float:
    x, y = data
    start = time.perf_counter()
    for _ in range(steps):
        cross_entropy_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def measure_ac(steps: int, repeats: int) -> tuple[dict[str, int], dict[str, float], dict[str, float]]:
    data = batch(EXAMPLE)
    saved = {mode: saved_activation_bytes(model_for(mode, EXAMPLE), data[0]) for mode in MODES}
    models = {mode: model_for(mode, EXAMPLE) for mode in MODES}
    opts = {mode: torch.optim.AdamW(m.parameters(), lr=1e-3) for mode, m in models.items()}
    for mode in MODES:  # warm-up
        step_seconds(models[mode], opts[mode], data, 2)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            times[mode].append(step_seconds(models[mode], opts[mode], data, steps))
    ratios = {m: statistics.median(t / b for t, b in zip(times[m], times["none"])) for m in MODES}
    medians = {m: statistics.median(times[m]) for m in MODES}
    return saved, medians, ratios


def measure_compile(steps: int, repeats: int) -> dict[str, float]:
    cfg = dict(vocab_size=256, seq_len=32, n_layers=2, d_model=64, n_heads=4)
    data = batch(cfg)
    eager = model_for("none", cfg)
    compiled = compile_model(model_for("none", cfg), "blocks")
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    first = step_seconds(compiled, opt_c, data, 1)  # compiles forward and backward
    first_eager = step_seconds(eager, opt_e, data, 1)
    step_seconds(compiled, opt_c, data, 2)
    step_seconds(eager, opt_e, data, 2)
    e, c = [], []
    for _ in range(repeats):
        e.append(step_seconds(eager, opt_e, data, steps))
        c.append(step_seconds(compiled, opt_c, data, steps))
    return {
        "first": first,
        "first_eager": first_eager,
        "eager": statistics.median(e),
        "compiled": statistics.median(c),
        "ratio": statistics.median(a / b for a, b in zip(c, e)),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smaller timing, no compile figure")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 3
    torch.set_num_threads(1)
    saved, medians, ratios = measure_ac(args.steps, args.repeats)
    e = EXAMPLE
    shape = f"GPT {e['n_layers']} layers d_model {e['d_model']}, batch {BATCH} x seq {e['seq_len']}"
    print(f"{shape}, 1 thread, {args.repeats} rounds x {args.steps} steps")
    print(f"{'AC mode':<10} {'saved for backward MB':>22} {'vs none':>8} {'ms/step':>8} {'time ratio':>11}")
    for m in MODES:
        print(
            f"{m:<10} {saved[m] / 2**20:>22.2f} {saved[m] / saved['none']:>8.3f} "
            f"{medians[m] * 1e3:>8.2f} {ratios[m]:>11.3f}"
        )
    figures = []
    for m in ("full", "selective"):
        figures.append(
            {
                "figure": f"activations saved for backward per step, {m} AC vs none",
                "hookloop": saved[m] / 2**20,
                "reference": saved["none"] / 2**20,
                "ratio": saved[m] / saved["none"],
                "target": "< 1" if m == "full" else "-",
                "met": saved[m] < saved["none"] if m == "full" else None,
                "unit": "MB",
            }
        )
        figures.append(
            {
                "figure": f"step time, {m} AC vs none",
                "hookloop": medians[m] * 1e3,
                "reference": medians["none"] * 1e3,
                "ratio": ratios[m],
                "target": None,
                "met": None,
                "unit": "ms",
            }
        )
    if not args.quick:
        c = measure_compile(args.steps, args.repeats)
        print(
            f"compile (GPT 2 layers d_model 64, batch {BATCH} x seq 32, per block): first step "
            f"{c['first']:.1f} s (eager {c['first_eager'] * 1e3:.1f} ms); after warm-up "
            f"{c['compiled'] * 1e3:.2f} ms/step vs eager {c['eager'] * 1e3:.2f} ms/step "
            f"(ratio {c['ratio']:.3f})"
        )
        figures += [
            {
                "figure": "step time after warm-up, compiled per block vs eager",
                "hookloop": c["compiled"] * 1e3,
                "reference": c["eager"] * 1e3,
                "ratio": c["ratio"],
                "target": None,
                "met": None,
                "unit": "ms",
            },
            {
                "figure": "compile warm-up (first step), per block",
                "hookloop": c["first"],
                "reference": c["first_eager"],
                "ratio": None,
                "target": None,
                "met": None,
                "unit": "s",
            },
        ]
    result = {
        "benchmark": "activation_memory",
        "notes": "Saved bytes: activations one forward keeps for backward (saved_tensors_hooks, "
        "parameters left out, checkpointed blocks' inputs counted). Times: median per-round ratios.",
        "figures": figures,
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
