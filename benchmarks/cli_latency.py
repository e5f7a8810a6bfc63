"""Wall time of ``hookloop`` commands a user waits on, against ``python -c "import torch"`` measured
in the same run: the answers that need no torch (``--help``, ``config``, a config resolved, an
unknown key, a wrong value, a held run directory, a run with nothing left to train; each also run
once under ``python -X importtime`` to say whether torch was imported), and ``check`` and ``train``
to the first step against importing torch and building the same model by hand. Fresh
interpreters, alternated, medians over repeats.

    python benchmarks/cli_latency.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "gpt_tiny.yaml"
# One step, nothing saved or validated: the start of a run, not its work.
ONE_STEP = [
    "step_scheduler.max_steps=1",
    "lr.warmup_steps=0",
    "step_scheduler.ckpt_every_steps=1000",
    "step_scheduler.val_every_steps=1000",
]
BY_HAND = (
    "import torch\n"
    "from hookloop.models.gpt import build\n"
    "model = build(n_layers=4, d_model=128, n_heads=4, seq_len=64)\n"
    "torch.optim.AdamW(model.parameters(), lr=0.003)\n"
)
HOLD = (
    "import sys, time\n"
    "from hookloop.engine.run_lock import RunDirLock\n"
    "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(3600)\n"
)


def wall(cmd: list[str], cwd: Path, expect: int | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if expect is not None and proc.returncode != expect:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}, expected {expect}\n{proc.stderr[-2000:]}")
    return elapsed


def until_first_step(cmd: list[str], cwd: Path) -> float:
    """Wall seconds until ``train`` says its first step is done (the start of a run, not its end:
    the last step's validation and save and the shutdown come after); the run then ends as usual."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    elapsed, seen = None, []
    for line in proc.stdout:
        seen.append(line)
        if elapsed is None and "first step (compile/warm-up) took" in line:
            elapsed = time.perf_counter() - start
    if proc.wait() != 0 or elapsed is None:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}, no first step\n{''.join(seen)[-2000:]}")
    return elapsed


def imports_torch(cmd: list[str], cwd: Path) -> bool:
    """Whether ``cmd`` (a ``python -m hookloop ...`` command) imports torch, from ``-X importtime``."""
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], cwd=cwd, capture_output=True, text=True)
    return any(re.search(r"\|\s*torch$", line) for line in proc.stderr.splitlines())


#: The answers that must need no torch (issue 43, item 2).
WITHOUT_TORCH = (
    "hookloop --help",
    "hookloop config",
    "hookloop config CONFIG",
    "an unknown key",
    "a wrong value",
    "a held run directory",
    "a finished run",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write the figures here (benchmarks/run.py format)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    hookloop = [sys.executable, "-m", "hookloop"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = f"data.cache_dir={work / 'data'}"
        held, finished = work / "held", work / "finished"
        # A finished run: trained to max_steps once, then started again (nothing left to train).
        done = [str(CONFIG), f"train.run_dir={finished}", data, *ONE_STEP[:2]]
        done.append("step_scheduler.ckpt_every_steps=1")
        wall([*hookloop, "train", *done], work, expect=0)
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            cases = {
                "import torch": ([sys.executable, "-c", "import torch"], 0),
                "hookloop --help": ([*hookloop, "--help"], 0),
                "hookloop config": ([*hookloop, "config"], 0),
                "hookloop config CONFIG": ([*hookloop, "config", str(CONFIG), "nan.action=raise"], 0),
                "an unknown key": ([*hookloop, "check", str(CONFIG), "train.bogus=1"], 2),
                "a wrong value": ([*hookloop, "train", str(CONFIG), "nan.action=foo"], 2),
                "a held run directory": ([*hookloop, "train", str(CONFIG), f"train.run_dir={held}"], 2),
                "a finished run": ([*hookloop, "train", *done], 0),
                "torch + the model by hand": ([sys.executable, "-c", BY_HAND], 0),
                "hookloop check": ([*hookloop, "check", str(CONFIG), data], 0),
                "hookloop train, one step": (
                    [*hookloop, "train", str(CONFIG), f"train.run_dir={work / 'one'}", data, *ONE_STEP],
                    0,
                ),
                "hookloop train, to its first step": (
                    [*hookloop, "train", str(CONFIG), f"train.run_dir={work / 'one'}", data, *ONE_STEP],
                    0,
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in cases}
            for r in range(repeats):
                names = list(cases) if r % 2 == 0 else list(cases)[::-1]
                for name in names:
                    cmd, code = cases[name]
                    if name == "hookloop train, to its first step":
                        times[name].append(until_first_step(cmd, work))
                    else:
                        times[name].append(wall(cmd, work, expect=code))
                    if name.startswith("hookloop train,"):
                        subprocess.run(["rm", "-rf", str(work / "one")], check=True)
            torch_in = {name: imports_torch(cases[name][0], work) for name in WITHOUT_TORCH}
        finally:
            holder.kill()
            holder.wait()
    med = {name: statistics.median(t) for name, t in times.items()}
    torch_s, by_hand = med["import torch"], med["torch + the model by hand"]
    print(f"\n{repeats} repeats, fresh interpreter each, wall seconds ({os.cpu_count()} cores)")
    print(f"{'case':28s} {'median s':>9s} {'min s':>7s} {'x import torch':>15s} {'torch imported':>15s}")
    for name, t in times.items():
        imported = {True: "yes", False: "no"}.get(torch_in.get(name), "")
        print(f"{name:28s} {med[name]:9.3f} {min(t):7.3f} {med[name] / torch_s:15.3f} {imported:>15s}")
    figures = [
        {
            "figure": f"{name} (refused or answered{', torch imported' if torch_in[name] else ', no torch'})",
            "hookloop": med[name],
            "reference": torch_s,
            "ratio": med[name] / torch_s,
            "target": "< 1 s, no torch",
            "met": med[name] < 1.0 and not torch_in[name],
            "unit": "s",
        }
        for name in WITHOUT_TORCH
    ]
    figures += [
        {
            "figure": f"{name} vs torch + the model by hand",
            "hookloop": med[name],
            "reference": by_hand,
            "ratio": med[name] / by_hand,
            "target": "<= 1.3",
            "met": med[name] / by_hand <= 1.3,
            "unit": "s",
        }
        for name in ("hookloop check", "hookloop train, to its first step")
    ]
    if args.json:
        result = {
            "benchmark": "cli_latency",
            "repeats": repeats,
            "rows": {
                name: {"median_s": med[name], "min_s": min(t), "torch_imported": torch_in.get(name)}
                for name, t in times.items()
            },
            "figures": figures,
            "notes": "Wall seconds of fresh `python -m hookloop ...` processes; the refusals' reference "
            "is `python -c 'import torch'`, check's and train's is torch + the GPT built by hand.",
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
