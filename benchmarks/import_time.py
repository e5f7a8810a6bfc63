"""Import time of ``import hookloop`` (with every handler and observability module) against
``import torch, ignite``, each in a fresh interpreter, alternated, medians over repeats.

    python benchmarks/import_time.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "python (empty)": "pass",
    "import torch": "import torch",
    "import torch, ignite": "import torch, ignite, ignite.engine",
    "import hookloop": "import hookloop",
    "import hookloop (all handlers)": (
        "import hookloop, hookloop.handlers, hookloop.handlers.metrics, hookloop.handlers.loggers, "
        "hookloop.handlers.jsonl_logger, hookloop.handlers.tensorboard_logger, "
        "hookloop.handlers.wandb_logger, hookloop.handlers.console, hookloop.handlers.profiler, "
        "hookloop.handlers.health_check, hookloop.handlers.straggler, hookloop.handlers.plot"
    ),
}


OWN = (
    "import time, hookloop, hookloop.handlers\n"
    "start = time.perf_counter()\n"
    "import hookloop.handlers.metrics, hookloop.handlers.loggers, hookloop.handlers.jsonl_logger, "
    "hookloop.handlers.tensorboard_logger, hookloop.handlers.wandb_logger, hookloop.handlers.console, "
    "hookloop.handlers.profiler, hookloop.handlers.health_check, hookloop.handlers.straggler, "
    "hookloop.handlers.plot\n"
    "print(time.perf_counter() - start)"
)


def time_own_modules() -> float:
    """Seconds to import the observability modules in a process that already imported hookloop."""
    out = subprocess.run([sys.executable, "-c", OWN], check=True, cwd=REPO, capture_output=True, text=True)
    return float(out.stdout.strip())


def time_import(code: str) -> float:
    """CPU seconds (user + system) of a fresh interpreter running ``code``: unlike wall time, it
    does not grow when other work shares the cores."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write the figures here (benchmarks/run.py format)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 9)
    if not args.quick:  # --quick only proves the benchmark runs: no warm-up round
        for code in CASES.values():  # warm the file cache
            time_import(code)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for r in range(repeats):
        names = list(CASES) if r % 2 == 0 else list(CASES)[::-1]
        for name in names:
            times[name].append(time_import(CASES[name]))
    own = [time_own_modules() for _ in range(repeats)]
    ref = statistics.median(times["import torch, ignite"])
    print(f"\n{repeats} repeats, fresh interpreter each (CPU time, user + system, of `python -c ...`)")
    print(f"{'case':28s} {'median s':>9s} {'min s':>7s} {'ratio to torch+ignite':>22s}")
    for name in CASES:
        med = statistics.median(times[name])
        print(f"{name:28s} {med:9.3f} {min(times[name]):7.3f} {med / ref:22.3f}")
    print(
        f"observability modules alone (imported after hookloop, in-process): median "
        f"{1e3 * statistics.median(own):.1f} ms, min {1e3 * min(own):.1f} ms"
    )
    if args.json:
        ours = statistics.median(times["import hookloop"])
        everything = statistics.median(times["import hookloop (all handlers)"])
        result = {
            "benchmark": "import_time",
            "repeats": repeats,
            "rows": {name: {"median_s": statistics.median(t), "min_s": min(t)} for name, t in times.items()},
            "observability_modules_ms": 1e3 * statistics.median(own),
            "figures": [
                {
                    "figure": "import hookloop",
                    "hookloop": ours,
                    "reference": ref,
                    "ratio": ours / ref,
                    "target": "<= 1.1",
                    "met": ours / ref <= 1.1,
                    "unit": "s",
                },
                {
                    "figure": "import hookloop with every handler module",
                    "hookloop": everything,
                    "reference": ref,
                    "ratio": everything / ref,
                    "target": "<= 1.1",
                    "met": everything / ref <= 1.1,
                    "unit": "s",
                },
            ],
            "notes": "Reference: import torch, ignite; a fresh interpreter per import; CPU seconds.",
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
