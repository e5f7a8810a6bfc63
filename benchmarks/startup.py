"""Start-up to the first step: ``hookloop train examples/configs/gpt_tiny.yaml`` against the same
config trained by the example script of the release before the ``hookloop`` namespace
(``examples/train_gpt.py`` at commit ``d26a3fa``, its ``engine``/``handlers`` packages extracted
beside it with ``git archive``). Both runs train one step (no checkpoint, no validation), in fresh
interpreters, alternated; the figure is the median CPU time (user + system) of the whole process,
which other work on the machine does not inflate the way it does wall time.

    python benchmarks/startup.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE_COMMIT = "d26a3fa"
CONFIG = REPO / "examples" / "configs" / "gpt_tiny.yaml"


def extract_reference(where: Path) -> Path | None:
    """The pre-namespace tree (engine, handlers, examples) at :data:`REFERENCE_COMMIT`, or None
    when this checkout has no such history (a shallow clone)."""
    archive = where / "ref.tar"
    proc = subprocess.run(
        ["git", "archive", "-o", str(archive), REFERENCE_COMMIT, "engine", "handlers", "examples"],
        cwd=REPO,
        capture_output=True,
    )
    if proc.returncode != 0:
        return None
    root = where / "reference"
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return root


def overrides(tmp: Path, name: str) -> list[str]:
    return [
        f"train.run_dir={tmp / name}",
        f"data.cache_dir={tmp / 'data'}",
        "step_scheduler.max_steps=1",
        "step_scheduler.val_every_steps=null",
        "checkpoint.enabled=false",
        "nan.action=warn",
        "lr.warmup_steps=0",
    ]


def timed(cmd: list[str], env: dict, cwd: Path) -> float:
    """CPU seconds (user + system) of the whole process: unlike wall time, it does not grow when
    other work shares the cores."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    elapsed = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, help="also write the figures here (benchmarks/run.py format)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 7)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        reference = extract_reference(tmp)
        ours = [sys.executable, "-m", "hookloop", "train", str(CONFIG), *overrides(tmp, "ours")]
        cases = {"hookloop train": (ours, env)}
        if reference is not None:
            old_config = reference / "examples" / "configs" / "gpt_tiny.yaml"
            old = [sys.executable, str(reference / "examples" / "train_gpt.py"), "--config", str(old_config)]
            cases["examples/train_gpt.py (d26a3fa)"] = ([*old, *overrides(tmp, "old")], env)
        timed(ours, env, tmp)  # writes the token cache once, warms the file cache
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(repeats):
            for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
                cmd, case_env = cases[name]
                times[name].append(timed(cmd, case_env, tmp))
    print(f"\n{repeats} repeats, one training step each, fresh interpreter (CPU time)")
    for name, values in times.items():
        print(f"{name:34s} median {statistics.median(values):6.3f} s  min {min(values):6.3f} s")
    ours_s = statistics.median(times["hookloop train"])
    ref_name = "examples/train_gpt.py (d26a3fa)"
    ref_s = statistics.median(times[ref_name]) if ref_name in times else None
    if ref_s is None:
        print(f"(no reference: commit {REFERENCE_COMMIT} is not in this clone's history)")
    if args.json:
        figure = {
            "figure": "start-up to the first step, hookloop train (gpt_tiny, 1 step)",
            "hookloop": ours_s,
            "reference": ref_s,
            "ratio": ours_s / ref_s if ref_s else None,
            "target": "<= 1.05",
            "met": (ours_s / ref_s <= 1.05) if ref_s else None,
            "unit": "s",
        }
        result = {
            "benchmark": "startup",
            "repeats": repeats,
            "rows": {name: {"median_s": statistics.median(v), "min_s": min(v)} for name, v in times.items()},
            "figures": [figure],
            "notes": f"Reference: examples/train_gpt.py at {REFERENCE_COMMIT} on the same config.",
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
