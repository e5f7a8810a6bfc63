"""ReplicaCheck cost and reach: step time with the replicas compared every 100 steps vs not at all,
and the time from a flipped bit in one replica's weights to its detection.

    python benchmarks/replica_check.py [--quick] [--json PATH]

Two gloo ranks under DDP train the same tiny GPT on the same data from the same seed, with and
without the check (``every_steps=100``, the parameters' fingerprint); the contenders alternate over
rounds (ABBA order) and the figure is the median of per-round ratios. The check adds nine zeros to the step's
one all-reduce on other steps and, every 100 steps, fingerprints the weights (a pass over them).
Then a run whose rank 1 flips a mantissa bit at step 102, right after a compared step (the worst
case: the flip waits the whole interval), stops with exit code 79 at the next compared step, 201:
the time between is the detection time at N = 100.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import run_ranks  # noqa: E402
from workload import ACCUM, alternating, seconds_per_step, tiny_gpt, token_microbatches, write_result  # noqa: E402

EVERY = 100


def build(check: bool) -> tuple:
    from hookloop.engine import Trainer
    from hookloop.engine.parallel import wrap_data_parallel
    from hookloop.handlers.replica_check import ReplicaCheck
    from hookloop.models.gpt import cross_entropy_loss

    model = wrap_data_parallel(tiny_gpt(), "ddp")
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        cross_entropy_loss,
        grad_accum_steps=ACCUM,
        hang_timeout_s=None,
    )
    handler = ReplicaCheck(every_steps=EVERY, max_rollbacks=0).attach(trainer) if check else None
    return trainer, handler


def _rank(rank: int, world: int, steps: int, repeats: int) -> dict:
    from hookloop.engine import Events, init_distributed
    from hookloop.handlers.fault_injection import FaultInjector

    init_distributed("gloo")
    torch.set_num_threads(1)
    data = token_microbatches(steps)
    without, with_, _ = alternating(
        lambda: seconds_per_step(build(False)[0], data),
        lambda: seconds_per_step(build(True)[0], data),
        repeats,
    )
    fingerprint_s, slots_s = own_work(build(True), data)
    trainer, check = build(True)
    FaultInjector(kind="corruption", rank=1, step=EVERY + 2, bit=16).attach(trainer)
    stamps: dict = {}

    def note(engine) -> None:  # the flip's step starts at the same time on every rank (within a step)
        if engine.state.step == EVERY + 2 and "flip" not in stamps:
            stamps["flip"] = (engine.state.step, time.perf_counter())
        if check.mismatches and "found" not in stamps:
            stamps["found"] = (engine.state.step, time.perf_counter())

    trainer.add_event_handler(Events.STEP_START, note)
    trainer.add_event_handler(Events.STEP_END, note)
    trainer.run(token_microbatches(2 * EVERY + 10), max_epochs=1)
    return {
        "without": without,
        "with": with_,
        "flip_step": stamps["flip"][0],
        "found_step": stamps["found"][0],
        "detection_s": stamps["found"][1] - stamps["flip"][1],
        "code": int(trainer.control.exit_code),
        "fingerprint_s": fingerprint_s,
        "slots_s": slots_s,
    }


def own_work(built: tuple, data: list, repeats: int = 2000) -> tuple[float, float]:
    """The check's own work, measured alone: one fingerprint of the weights (median of 21), and, on
    a step that compares nothing, filling its nine values and taking the agreed sums back."""
    from hookloop.handlers.replica_check import fingerprint

    trainer, check = built
    trainer.run(data[: 2 * ACCUM], max_epochs=1)
    params = list(trainer.model.parameters())
    times = []
    for _ in range(21):
        start = time.perf_counter()
        fingerprint(params)
        times.append(time.perf_counter() - start)
    slots = [s for s in trainer.agreement.slots if s.name.startswith("replica_check.")]
    start = time.process_time()
    for _ in range(repeats):
        for slot in slots:
            slot.on_agreed(slot.fill())
    return statistics.median(times), (time.process_time() - start) / repeats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2 * EVERY)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 2
    r = run_ranks(_rank, 2, args.steps, args.repeats, timeout=1800)[0]
    ratio = statistics.median(w / b for w, b in zip(r["with"], r["without"]))
    a, b = statistics.median(r["with"]) * 1e3, statistics.median(r["without"]) * 1e3
    steps = r["found_step"] - r["flip_step"]
    work = (r["fingerprint_s"] / EVERY + r["slots_s"]) * 1e3
    print(f"2 ranks DDP, {args.steps} steps per run: without the check {b:.3f} ms/step, every {EVERY} steps "
          f"{a:.3f} ms/step, ratio {ratio:.4f}")  # fmt: skip
    print(f"the check's own work: one fingerprint {r['fingerprint_s'] * 1e3:.3f} ms, its values on any step "
          f"{r['slots_s'] * 1e6:.1f} us: {work:.4f} ms per step = {work / b:.5f} of a step")  # fmt: skip
    print(f"bit flipped at step {r['flip_step']}, found at step {r['found_step']} ({steps} steps later, "
          f"{r['detection_s']:.2f} s), exit code {r['code']}")  # fmt: skip
    result = {
        "benchmark": "replica_check",
        "figures": [
            {
                "figure": f"step time with the replica check every {EVERY} steps vs none, 2 ranks DDP",
                "hookloop": a,
                "reference": b,
                "ratio": ratio,
                "target": "<= 1.01",
                "met": ratio <= 1.01,
                "unit": "ms",
            },
            {
                "figure": f"the check's own work per step (every {EVERY} steps) vs one step",
                "hookloop": work,
                "reference": b,
                "ratio": 1 + work / b,
                "target": "<= 1.01",
                "met": 1 + work / b <= 1.01,
                "unit": "ms",
            },
            {
                "figure": f"time from a flipped bit to detection at every_steps={EVERY} (worst case)",
                "hookloop": r["detection_s"],
                "steps": steps,
                "unit": "s",
            },
        ],
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
