"""Step time of pipeline schedules at 2 stages (ranks) against the ideal bubble.

For each schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, and the other zero-bubble one)
and m = 2, 4, 8 microbatches per step, two gloo processes (one thread each) train the example GPT
through :func:`engine.pipeline.build_pipeline` and a :class:`engine.Trainer`; the figure is the
fastest step after warm-up (on a shared machine the minimum is what is least disturbed by other
processes; medians are printed too). The one-process reference is measured again next to each
schedule, in the same two processes, and its fastest step is used. Next to it:

* ``ideal bubble`` -- (p-1)/(m+p-1), the idle fraction of a single-stage-per-rank schedule with
  equal stage times and free communication; ``ideal (v)`` is (p-1)/(v*m+p-1) for v stages per rank.
* ``overhead`` -- 1 - T1 / (p * T_pp): the share of the two ranks' time not spent on the work one
  process does alone in T1 (same model, same m microbatches, grad accumulation, one thread). It
  holds the bubble, the send/recv cost and the schedule's own bookkeeping. T1 is measured in the
  same two processes right before the schedules (each runs the whole model), so both figures see
  the same machine load.

Usage: ``python benchmarks/pipeline.py [--quick] [--out benchmarks/results/pipeline.md] [--json PATH]``
(``--json`` writes the figures in the form ``benchmarks/run.py`` collects).
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

from hookloop.engine.pipeline import bubble_fraction  # noqa: E402

PP = 2
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
MICROBATCHES = (2, 4, 8)
QUICK_MICROBATCHES = (4,)  # --quick: every schedule, one microbatch count
MB_SIZE = 4


def _model_cfg(quick: bool) -> dict:
    if quick:
        return dict(vocab_size=256, seq_len=64, n_layers=4, d_model=96, n_heads=4)
    return dict(vocab_size=512, seq_len=128, n_layers=8, d_model=192, n_heads=4)


def _batches(n: int, cfg: dict) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg["vocab_size"], (MB_SIZE, cfg["seq_len"] + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _timed_steps(trainer, data: list, warmup: int, steps: int) -> tuple[float, float]:
    """(fastest, median) step time in seconds after ``warmup`` steps."""
    from hookloop.engine import Events

    times: list[float] = []
    start = [0.0]
    trainer.add_event_handler(Events.STEP_START, lambda: start.__setitem__(0, time.perf_counter()))
    trainer.add_event_handler(Events.STEP_END, lambda: times.append(time.perf_counter() - start[0]))
    trainer.run(data, max_steps=warmup + steps)
    return min(times[warmup:]), statistics.median(times[warmup:])


def _single_process(m: int, cfg: dict, warmup: int, steps: int) -> tuple[float, float]:
    from hookloop.engine import Trainer
    from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = Trainer(model, opt, cross_entropy_loss, grad_accum_steps=m)
    return _timed_steps(trainer, _batches(m * (warmup + steps), cfg), warmup, steps)


def _worker(rank: int, world: int, cfg: dict, warmup: int, steps: int, microbatches: tuple) -> dict:
    import warnings

    from hookloop.engine import Trainer, init_distributed
    from hookloop.engine.pipeline import PipelineConfig, build_pipeline
    from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss

    warnings.simplefilter("ignore", UserWarning)  # m < stages is measured on purpose
    info = init_distributed(mesh_shape=(1, world), mesh_dim_names=("dp", "pp"))
    out: dict = {}
    for m in microbatches:
        singles = []
        for name in SCHEDULES:
            # the one-process reference is re-measured next to every schedule; its fastest step wins
            singles.append(_single_process(m, cfg, warmup, steps))
            torch.manual_seed(0)
            model = GPT(GPTConfig(**cfg))
            pcfg = PipelineConfig(pp_schedule=name, pp_microbatch_size=MB_SIZE, pp_batch_size=MB_SIZE * m)
            try:
                runtime = build_pipeline(model, pcfg, info, cross_entropy_loss)
            except (ValueError, RuntimeError) as e:  # a schedule that refuses this m
                out[(name, m)] = (None, None, str(e).splitlines()[0])
                continue
            opt = torch.optim.AdamW(runtime.parameters(), lr=1e-4)
            trainer = Trainer(runtime.module, opt, cross_entropy_loss, step_body=runtime)
            t = _timed_steps(trainer, _batches(m * (warmup + steps), cfg), warmup, steps)
            out[(name, m)] = (t, runtime.num_stages // PP, None)  # t = (fastest, median)
        out[("single", m)] = (min(f for f, _ in singles), statistics.median(md for _, md in singles))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (< 1 minute)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the figures for benchmarks/run.py here"
    )
    args = parser.parse_args()
    from benchmarks.launch import run_ranks

    torch.set_num_threads(1)
    cfg = _model_cfg(args.quick)
    warmup, steps = (1, 4) if args.quick else (2, 6)
    start = time.perf_counter()
    microbatches = QUICK_MICROBATCHES if args.quick else MICROBATCHES
    results = run_ranks(_worker, PP, cfg, warmup, steps, microbatches, timeout=900)[0]
    single = {m: results[("single", m)] for m in microbatches}
    figures = []
    lines = [
        f"Pipeline schedules, p = {PP} ranks (gloo, 1 thread each), GPT {cfg}, microbatch {MB_SIZE} samples.",
        "",
        "| schedule | m | stages/rank | step ms (fastest / median) | 1-process ms (fastest / median) "
        "| ideal bubble (p-1)/(m+p-1) | ideal (v) | overhead (fastest) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in SCHEDULES:
        for m in microbatches:
            times, v, error = results[(name, m)]
            ideal = bubble_fraction(m, PP)
            one = f"{single[m][0] * 1e3:.1f} / {single[m][1] * 1e3:.1f}"
            if times is None:
                lines.append(f"| {name} | {m} | - | refused: {error} | {one} | {ideal:.0%} | - | - |")
                continue
            t, t_median = times
            overhead = 1 - single[m][0] / (PP * t)
            figures.append(
                {
                    "figure": f"{name} m={m} step, {PP} ranks vs 1 process",
                    "hookloop": t * 1e3,
                    "reference": single[m][0] * 1e3,
                    "ratio": t / single[m][0],
                    "target": None,
                    "met": None,
                    "unit": "ms",
                }
            )
            lines.append(
                f"| {name} | {m} | {v} | {t * 1e3:.1f} / {t_median * 1e3:.1f} | {one} | {ideal:.0%} | "
                f"{bubble_fraction(m, PP, v):.0%} | {overhead:.0%} |"
            )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    footer = (
        f"\nMachine: {torch.get_num_threads()} thread per process, {cpu}, {platform.python_version()}, "
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; {time.perf_counter() - start:.0f} s; "
        f"load average at the end {load} on {os.cpu_count()} cores."
    )
    text = "\n".join(lines) + "\n" + footer + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.json is not None:
        notes = "Ideal bubble (p-1)/(m+p-1) and the measured overhead per schedule are in the printout."
        args.json.write_text(
            json.dumps({"benchmark": "pipeline", "figures": figures, "notes": notes}, indent=2)
        )


if __name__ == "__main__":
    main()
