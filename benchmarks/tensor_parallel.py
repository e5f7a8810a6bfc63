"""Step time of a tensor-parallel (tp=2) GPT: a bare hookloop Trainer against a hand-written loop over
the same DTensor-parallelized model.

Two gloo processes (one thread each) parallelize the example GPT with its shipped plan
(:func:`hookloop.models.gpt.tp_plan`: column/row-parallel projections, vocabulary-parallel
embedding and head, sequence parallelism on) and train it with AdamW, gradient clipping at the
global norm and gradient accumulation, once through a :class:`~hookloop.engine.Trainer` with no
handlers and once through a loop written by hand: forward, backward, the global gradient norm
(per-placement norms made whole, as the Trainer does), clipping, optimizer step, the loss read
once per step. The two contenders alternate over ``--repeats`` rounds, each round a fresh model
from the same seed, and the figure is the median over rounds of the per-step time ratio.

Usage: ``python benchmarks/tensor_parallel.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TP = 2
ACCUM = 2
CLIP = 1.0


def _model_cfg(quick: bool) -> dict:
    if quick:
        return dict(vocab_size=256, seq_len=64, n_layers=2, d_model=64, n_heads=4)
    return dict(vocab_size=512, seq_len=128, n_layers=4, d_model=256, n_heads=8)


def _batches(n: int, cfg: dict, batch: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg["vocab_size"], (batch, cfg["seq_len"] + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _parallel_model(cfg: dict, tp_mesh):
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.models.gpt import GPT, GPTConfig, tp_plan

    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    apply_tensor_parallel(model, tp_mesh, tp_plan, sequence_parallel=True)
    return model


def _hand_written(model, data: list, warmup: int) -> float:
    """Seconds per step after ``warmup`` steps."""
    from hookloop.engine.tensor_parallel import clip_grads_with_norm, grad_norm
    from hookloop.models.gpt import cross_entropy_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    steps = len(data) // ACCUM
    start = 0.0
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        total = 0.0
        for x, y in data[step * ACCUM : (step + 1) * ACCUM]:
            loss = cross_entropy_loss(model(x), y)
            (loss / ACCUM).backward()
            total = total + loss.detach()
        norm = grad_norm([p.grad for p in params if p.grad is not None])
        clip_grads_with_norm(params, CLIP, norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(total)  # the loss, read once per step
    return (time.perf_counter() - start) / (steps - warmup)


def _bare_trainer(model, clip: float = CLIP):
    """A Trainer with no handlers: AdamW, ``ACCUM`` microbatches a step, clipping at ``clip``."""
    from hookloop.engine import Trainer
    from hookloop.models.gpt import cross_entropy_loss

    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        cross_entropy_loss,
        grad_accum_steps=ACCUM,
        grad_clip_norm=clip,
        hang_timeout_s=None,
        graceful_sigint=False,
    )


def _trainer(model, data: list, warmup: int) -> float:
    from hookloop.engine import Events

    trainer = _bare_trainer(model)
    start = [0.0]

    def mark() -> None:
        if trainer.state.step == warmup:
            start[0] = time.perf_counter()

    trainer.add_event_handler(Events.STEP_END, mark)
    steps = len(data) // ACCUM
    trainer.run(data, max_steps=steps)
    float(trainer.state.loss)
    return (time.perf_counter() - start[0]) / (steps - warmup)


def collectives_per_step(model, data: list, clip: float = CLIP) -> tuple[list[int], list[str]]:
    """Small ``torch.distributed`` collectives in each step of a bare Trainer over ``data``
    (``ACCUM`` microbatches a step) and where they were called from; the layers' own communication
    is DTensor's functional collectives on the tp group, not counted here."""
    from benchmarks.step_budget import CollectiveCounter
    from hookloop.engine import Events

    trainer = _bare_trainer(model, clip)
    totals: list[int] = []

    class Count:
        asks_after_agreement = False  # a reader: it needs no second collective

        def record(self) -> None:
            totals.append(sum(counter.counts.values()))

    with CollectiveCounter() as counter:
        trainer.add_event_handler(Events.STEP_END, Count().record)
        trainer.run(data, max_steps=len(data) // ACCUM)
    return [b - a for a, b in zip(totals, totals[1:])], sorted(counter.sites)


def _worker(rank: int, world: int, cfg: dict, batch: int, warmup: int, steps: int, repeats: int) -> dict:
    from hookloop.engine import init_distributed
    from hookloop.engine.parallel import parallel_mesh

    info = init_distributed("gloo", **parallel_mesh(world, TP))
    tp_mesh = info.mesh_dim("tp")
    data = _batches(ACCUM * (warmup + steps), cfg, batch)
    times: dict[str, list[float]] = {"hand": [], "trainer": []}
    for r in range(repeats):
        order = ("hand", "trainer") if r % 2 == 0 else ("trainer", "hand")
        for name in order:
            model = _parallel_model(cfg, tp_mesh)
            run = _hand_written if name == "hand" else _trainer
            times[name].append(run(model, data, warmup))
    times["collectives"] = collectives_per_step(_parallel_model(cfg, tp_mesh), data)[0]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--json", type=Path, default=None, help="write the figures for benchmarks/run.py here"
    )
    args = parser.parse_args()
    from benchmarks.launch import run_ranks

    torch.set_num_threads(1)
    cfg = _model_cfg(args.quick)
    batch, warmup, steps, repeats = (4, 1, 4, 3) if args.quick else (8, 2, 10, args.repeats)
    start = time.perf_counter()
    per_rank = run_ranks(_worker, TP, cfg, batch, warmup, steps, repeats, timeout=1200)
    times = per_rank[0]
    hand, trainer = statistics.median(times["hand"]), statistics.median(times["trainer"])
    ratio = statistics.median(t / h for t, h in zip(times["trainer"], times["hand"]))
    target = 1.02
    figures = [
        {
            "figure": f"tp={TP} step, bare Trainer vs hand-written loop",
            "hookloop": trainer * 1e3,
            "reference": hand * 1e3,
            "ratio": ratio,
            "target": target,
            "met": ratio <= target,
            "unit": "ms",
        },
        {
            "figure": f"small collectives per step for control, bare Trainer, tp={TP} (most of any step)",
            "hookloop": max(times["collectives"]),
            "target": 1,
            "met": max(times["collectives"]) <= 1,
        },
    ]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rounds = ", ".join(f"{t / h:.3f}" for t, h in zip(times["trainer"], times["hand"]))
    text = (
        f"Tensor parallel, tp = {TP} ranks (gloo, 1 thread each, sequence parallel), GPT {cfg}, "
        f"microbatch {batch} samples, {ACCUM} microbatches per step, {steps} timed steps after {warmup}.\n\n"
        "| contender | ms per step (median of rounds) |\n|---|---|\n"
        f"| hand-written loop | {hand * 1e3:.1f} |\n"
        f"| hookloop Trainer (no handlers) | {trainer * 1e3:.1f} |\n\n"
        f"Trainer / hand-written, median of per-round ratios: {ratio:.3f} (target <= {target}); "
        f"rounds: {rounds}.\n\n"
        f"Small torch.distributed collectives per step (the step's agreement; DTensor's own "
        f"communication aside): {times['collectives']}.\n\n"
        f"Machine: {platform.python_version()}, torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; "
        f"{time.perf_counter() - start:.0f} s; load average at the end {load} on {os.cpu_count()} cores.\n"
    )
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "tensor_parallel", "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
