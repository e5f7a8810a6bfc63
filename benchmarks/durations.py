"""The durations the README states, measured: each command as a user types it, on an idle machine
and beside a competing torch job (``benchmarks/threads.py``'s: a process multiplying matrices with
torch's defaults), wall time from start to exit, median over rounds.

    python benchmarks/durations.py [--rounds N] [--json PATH]

Each command runs in a fresh directory of its own (its run directory and token cache inside it), so
nothing is resumed; the token file of the standard library's documentation is built once first.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from threads import Competitor  # noqa: E402
from workload import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"


def engine_by_hand() -> str:
    """The README's first code block under "The engine by hand"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The engine by hand") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def commands(work: Path) -> dict[str, list[str]]:
    cache = f"data.cache_dir={work / 'data'}"
    hookloop = [sys.executable, "-m", "hookloop", "train"]
    return {
        "hookloop train gpt_tiny.yaml (600 steps)": [*hookloop, str(CONFIGS / "gpt_tiny.yaml"), cache],
        "hookloop train digits.yaml": [*hookloop, str(CONFIGS / "digits.yaml")],
        "hookloop train custom_hooks.yaml": [*hookloop, str(CONFIGS / "custom_hooks.yaml"), cache],
        "the engine by hand (README)": [sys.executable, "-c", engine_by_hand()],
        "bash examples/fault_tolerance_demo.sh": ["bash", str(ROOT / "examples" / "fault_tolerance_demo.sh")],
    }


def timed(name: str, command: list[str], work: Path) -> float:
    run = Path(tempfile.mkdtemp(dir=work))
    if name.startswith("hookloop"):
        command = [*command, f"train.run_dir={run / 'run'}"]
    elif name.startswith("bash"):
        command = [*command, str(run)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    start = time.perf_counter()
    cwd = run if name.startswith("the engine") else ROOT  # the configs name files from the repository root
    subprocess.run(command, cwd=cwd, env=env, check=True, timeout=1800, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="names (prefixes) of commands to time")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    idle: dict[str, list[float]] = {}
    shared: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        todo = {
            n: c
            for n, c in commands(work).items()
            if not args.only or any(n.startswith(o) for o in args.only)
        }
        first = next(iter(todo))  # builds the token cache the others share
        timed(first, todo[first], work)
        for r in range(args.rounds):
            for name, command in todo.items():
                idle.setdefault(name, []).append(timed(name, command, work))
                with Competitor():
                    shared.setdefault(name, []).append(timed(name, command, work))
                print(
                    f"round {r + 1} {name:45s} idle {idle[name][-1]:6.1f} s, shared {shared[name][-1]:6.1f} s"
                )
    print(f"\n{'command':45s} {'idle':>8s} {'beside a torch job':>19s}")
    figures = []
    for name in idle:
        a, b = statistics.median(idle[name]), statistics.median(shared[name])
        print(f"{name:45s} {a:7.1f}s {b:18.1f}s")
        figures.append(
            {
                "figure": f"durations: {name}, beside a torch job / idle",
                "hookloop": b,
                "reference": a,
                "ratio": b / a,
                "target": "-",
                "met": None,
                "unit": "s",
            }
        )
    result = {"benchmark": "durations", "figures": figures}
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
