"""Index generation speed and resume cost of :class:`engine.data.MixtureSampler`.

Figures (medians over repeats):

* ``throughput_*`` -- indices per second a rank's iterator yields in steady state: one rank,
  one rank with a weight change every 1024 indices (a curriculum updating often), and rank 3 of 8.
* ``restore_at_*`` -- seconds to ``load_state_dict`` a snapshot taken ``N`` global draws into a
  run, and to get the first index after it. The snapshots at 1e3 and 1e6 come from real runs; the
  one at 1e8 is the 1e6 snapshot with every counter scaled by 100 (an equally valid position),
  since generating 1e8 draws just to snapshot them would dominate the benchmark.
* ``elastic_*`` -- the same restore for a resume on another data-parallel size: a snapshot of rank 0
  of a 2-rank run loaded into a 1-rank sampler (``2to1``) against one loaded into rank 0 of 2 ranks
  again (``2to2``), at draws 1e3 and 1e8 (load alone, and load plus the first index): the position
  is global, so a change of size costs what a same-size resume costs, whatever the depth.

Usage: ``python benchmarks/data.py [--quick]``. Only index generation is measured; no items are read.
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hookloop.engine.data import MixtureDataset, MixtureSampler  # noqa: E402

LENGTHS = {"web": 1_000_000, "code": 100_000, "math": 1_000}
WEIGHTS = {"web": 6.0, "code": 3.0, "math": 1.0}
OTHER_WEIGHTS = {"web": 2.0, "code": 3.0, "math": 5.0}


class Sized:
    """Stands in for a token dataset: only its length matters to the sampler."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def mixture() -> MixtureDataset:
    return MixtureDataset({name: Sized(n) for name, n in LENGTHS.items()})


def consume(iterator, n: int) -> None:
    collections.deque(itertools.islice(iterator, n), maxlen=0)


def throughput(n: int, repeats: int, *, rank: int = 0, world_size: int = 1, update_every: int = 0) -> float:
    """Median indices/s over ``repeats`` runs of ``n`` indices after a warm-up."""
    rates = []
    for repeat in range(repeats):
        sampler = MixtureSampler(mixture(), WEIGHTS, seed=repeat, rank=rank, world_size=world_size)
        it = iter(sampler)
        consume(it, 100_000)  # reach full chunk size, build first permutations
        start = time.perf_counter()
        if update_every:
            for step in range(n // update_every):
                sampler.update_weights(OTHER_WEIGHTS if step % 2 else WEIGHTS)
                consume(it, update_every)
        else:
            consume(it, n)
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def snapshot_at(draws: int, world_size: int = 1) -> dict:
    sampler = MixtureSampler(mixture(), WEIGHTS, seed=0, world_size=world_size)
    consume(iter(sampler), draws // world_size)
    return sampler.state_dict()


def scaled(state: dict, factor: int) -> dict:
    deep = copy.deepcopy(state)
    deep["draws"] *= factor
    for entry in deep["sources"].values():
        taken = (entry["epoch"] * entry["length"] + entry["cursor"]) * factor
        entry["epoch"], entry["cursor"] = divmod(taken, entry["length"])
        entry["yielded"] = taken
    return deep


def restore_times(state: dict, repeats: int, world_size: int = 1) -> tuple[float, float]:
    """Median seconds for load_state_dict alone, and for load plus the first index, into rank 0 of
    ``world_size`` ranks."""
    load, first = [], []
    for _ in range(repeats):
        sampler = MixtureSampler(mixture(), WEIGHTS, seed=0, world_size=world_size)
        start = time.perf_counter()
        sampler.load_state_dict(state)
        loaded = time.perf_counter()
        next(iter(sampler))
        done = time.perf_counter()
        load.append(loaded - start)
        first.append(done - start)
    return statistics.median(load), statistics.median(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, finishes in a few seconds")
    parser.add_argument("--json", type=Path, help="also write the figures here (see benchmarks/run.py)")
    args = parser.parse_args()
    n, repeats = (300_000, 3) if args.quick else (3_000_000, 7)

    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}")
    print(f"mixture lengths {LENGTHS}, weights {WEIGHTS}; {n} indices x {repeats} repeats")
    figures = {
        "throughput_1rank": throughput(n, repeats),
        "throughput_1rank_update_every_1024": throughput(n, repeats, update_every=1024),
        "throughput_rank3_of_8": throughput(n // 4, repeats, rank=3, world_size=8),
    }
    shallow, mid = snapshot_at(1_000), snapshot_at(1_000_000)
    for label, state in (("1e3", shallow), ("1e6", mid), ("1e8", scaled(mid, 100))):
        load, first = restore_times(state, repeats)
        figures[f"restore_at_{label}_load_s"] = load
        figures[f"restore_at_{label}_first_index_s"] = first
    two_shallow, two_mid = snapshot_at(1_000, 2), snapshot_at(1_000_000, 2)
    for label, state in (("1e3", two_shallow), ("1e8", scaled(two_mid, 100))):
        for target, world in (("2to1", 1), ("2to2", 2)):
            load, first = restore_times(state, repeats, world)
            figures[f"elastic_{target}_at_{label}_load_s"] = load
            figures[f"elastic_{target}_at_{label}_first_index_s"] = first
    for name, value in figures.items():
        unit = "indices/s" if name.startswith("throughput") else "s"
        print(f"{name}: {value:.4g} {unit}")
    if args.json:
        rate = figures["throughput_1rank"]
        shallow_load, deep_load = figures["restore_at_1e3_load_s"], figures["restore_at_1e8_load_s"]
        table = [
            {
                "figure": "sampler index generation, 1 rank",
                "hookloop": rate,
                "target": ">= 1e6",
                "met": rate >= 1e6,
                "unit": "indices/s",
            },
            {
                "figure": "sampler index generation, rank 3 of 8",
                "hookloop": figures["throughput_rank3_of_8"],
                "unit": "indices/s",
            },
            {
                "figure": "sampler restore at draw 1e8 vs at 1e3 (load_state_dict)",
                "hookloop": deep_load * 1e6,
                "reference": shallow_load * 1e6,
                "ratio": deep_load / shallow_load,
                "target": "independent of depth (<= 2)",
                "met": deep_load / shallow_load <= 2,
                "unit": "us",
            },
        ]
        other, same = (
            figures["elastic_2to1_at_1e8_first_index_s"],
            figures["elastic_2to2_at_1e8_first_index_s"],
        )
        deep_other, shallow_other = (
            figures["elastic_2to1_at_1e8_load_s"],
            figures["elastic_2to1_at_1e3_load_s"],
        )
        table += [
            {
                "figure": "resume on other dp size (2 -> 1) vs same (2 -> 2), draw 1e8 (load + 1st index)",
                "hookloop": other * 1e3,
                "reference": same * 1e3,
                "ratio": other / same,
                "target": "no dearer than a same-size resume (<= 2)",
                "met": other / same <= 2,
                "unit": "ms",
            },
            {
                "figure": "resume on another dp size (2 -> 1) at draw 1e8 vs at 1e3 (load_state_dict)",
                "hookloop": deep_other * 1e6,
                "reference": shallow_other * 1e6,
                "ratio": deep_other / shallow_other,
                "target": "independent of depth (<= 2)",
                "met": deep_other / shallow_other <= 2,
                "unit": "us",
            },
        ]
        args.json.write_text(json.dumps({"benchmark": "data", "figures": table, "raw": figures}, indent=2))


if __name__ == "__main__":
    main()
