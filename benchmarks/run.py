"""Run every benchmark, each in a fresh process, and print one table.

    python benchmarks/run.py [--quick] [--only NAME ...] [--no-write]

Each benchmark script accepts ``--quick`` and ``--json PATH`` and writes
``{"benchmark": ..., "figures": [{"figure", "hookloop", "reference", "ratio", "target", "met",
"unit"}, ...]}``. The table (figure, hookloop, reference, ratio, target, met) is printed, written to
``benchmarks/results/latest.json``, and ``benchmarks/RESULTS.md`` is regenerated with the machine
(cores, CPU model, torch version), the date, the table and each benchmark's own printout.
Timings are medians over repeats; every ratio is measured side by side in one run.

``--quick`` runs are smoke-sized: their table goes to ``benchmarks/results/quick.json`` (not
committed) and the committed RESULTS.md and latest.json are left alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_MD = HERE / "RESULTS.md"
LATEST = HERE / "results" / "latest.json"
QUICK = HERE / "results" / "quick.json"  # smoke-sized figures, never committed

# name -> script; the order is the table's order.
BENCHMARKS = {
    "overhead": "overhead.py",
    "engines": "engines.py",
    "event_bus": "event_bus.py",
    "import_time": "import_time.py",
    "startup": "startup.py",
    "cli_latency": "cli_latency.py",
    "logging": "logging_overhead.py",
    "nan_detector": "nan_overhead.py",
    "ema": "ema.py",
    "checkpoint": "checkpoint.py",
    "checkpoint_throughput": "checkpoint_throughput.py",
    "checkpoint_pickle": "checkpoint_pickle.py",
    "export": "export.py",
    "data": "data.py",
    "prepare": "prepare.py",
    "pipeline": "pipeline.py",
    "tensor_parallel": "tensor_parallel.py",
    "activation_memory": "activation_memory.py",
    "precision": "precision.py",
    "step_budget": "step_budget.py",
    "live_recovery": "live_recovery.py",
}
# Benchmarks that measure what a user gets with torch's default thread count: OMP_NUM_THREADS is
# left as the caller had it (the others run with one thread, for steadier ratios).
DEFAULT_THREADS = {"checkpoint_throughput"}
# Benchmarks that need longer than the default timeout: name -> (quick, full) seconds.
TIMEOUTS = {
    "checkpoint_throughput": (240.0, 1200.0),
    "tensor_parallel": (240.0, 1200.0),
    "live_recovery": (240.0, 1800.0),
}


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def run_one(name: str, script: str, quick: bool, timeout: float) -> dict:
    path = HERE / script
    if not path.exists():
        return {"benchmark": name, "error": f"{script} not found", "figures": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(path), "--json", str(out)] + (["--quick"] if quick else [])
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        if name not in DEFAULT_THREADS:
            env["OMP_NUM_THREADS"] = "1"
        # benchmarks.* resolve from this checkout; hookloop is the installed (editable) package.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE.parent
            )
        except subprocess.TimeoutExpired:
            return {"benchmark": name, "error": f"timed out after {timeout:.0f}s", "figures": []}
        elapsed = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            return {"benchmark": name, "error": f"exit code {proc.returncode}: {tail}", "figures": []}
        result = json.loads(out.read_text())
    result["seconds"] = elapsed
    result["printout"] = proc.stdout
    result.setdefault("figures", [])
    return result


def fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def table(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["benchmark"], "error", "", "", "", r["error"].splitlines()[0][:80]])
            continue
        for f in r["figures"]:
            unit = f.get("unit", "")
            met = f.get("met")
            rows.append(
                [
                    f"{r['benchmark']}: {f['figure']}",
                    fmt(f.get("hookloop"), unit),
                    fmt(f.get("reference"), unit),
                    fmt(f.get("ratio")),
                    f.get("target") or "-",
                    "-" if met is None else ("met" if met else "NOT met"),
                ]
            )
    return rows


HEAD = ["figure", "hookloop", "reference", "ratio", "target", "met"]

#: Figures printed again under the table, side by side (``bars``-style): the default handler set's
#: step and HF Trainer's over the hand-written loop's, and the throughput each of the hand loop,
#: HF Trainer and hookloop keeps while saving, all measured in the same run of
#: ``checkpoint_throughput.py`` (its ``VS_HAND`` and ``KEPT``).
HEADLINE = {
    "checkpoint_throughput": (
        "step without saves / hand-written loop's, same round",
        "throughput kept saving every",
    )
}


def headline(results: list[dict]) -> list[list[str]]:
    """The table's rows of the :data:`HEADLINE` figures, in the order the benchmarks reported them."""
    picked = [
        {**r, "figures": [f for f in r["figures"] if f["figure"].startswith(HEADLINE[r["benchmark"]])]}
        for r in results
        if r["benchmark"] in HEADLINE and not r.get("error")
    ]
    return table(picked)


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(HEAD, *rows)]
    for row in [HEAD, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def write_markdown(results: list[dict], rows: list[list[str]], info: dict) -> None:
    lines = [
        "# Benchmark results",
        "",
        "Regenerated by `python benchmarks/run.py`. Ratios are measured side by",
        "side in one run (the machine is shared and noisy: absolute times mean little); timings are",
        "medians over repeats. No test asserts any of these numbers.",
        "",
        f"Machine: {info['cores']} cores, {info['cpu']}, Python {info['python']}, torch {info['torch']}. "
        f"Date: {info['date']}.",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "---|" * len(HEAD),
    ]
    lines += ["| " + " | ".join(str(x).replace("|", "/") for x in row) + " |" for row in rows]
    for r in results:
        lines += ["", f"## {r['benchmark']}", ""]
        if r.get("notes"):
            lines += [r["notes"], ""]
        if r.get("error"):
            lines += ["Failed: " + r["error"].splitlines()[0]]
            continue
        took = f" ({r['seconds']:.0f} s)" if "seconds" in r else ""  # older results did not record it
        lines += [f"`benchmarks/{BENCHMARKS[r['benchmark']]}`{took}:", "", "```"]
        lines += r["printout"].rstrip().splitlines() + ["```"]
    RESULTS_MD.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke-sized runs (each within its --quick timeout: 120 s, 240 s for the longest)",
    )
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), help="run only these")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results file")
    parser.add_argument("--timeout", type=float, default=None, help="per benchmark, seconds")
    args = parser.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    info = machine()
    results = []
    for name in names:
        print(f"running {name} ...", flush=True)
        timeout = args.timeout or TIMEOUTS.get(name, (120.0, 600.0))[0 if args.quick else 1]
        results.append(run_one(name, BENCHMARKS[name], args.quick, timeout))
    print()
    print_table(table(results))
    side_by_side = headline(results)
    if side_by_side:
        print(
            "\nside by side, measured in one run: the step over a hand-written loop's, "
            "and the throughput kept saving"
        )
        print_table(side_by_side)
    failed = any(r.get("error") for r in results)
    if args.no_write:
        return 1 if failed else 0
    # Quick figures are smoke-sized: they go to their own file, never over the committed results.
    target = QUICK if args.quick else LATEST
    if args.only and target.exists():
        # A partial run refreshes its own benchmarks and keeps the others' last figures.
        previous = json.loads(target.read_text())
        if previous.get("quick") == args.quick:
            fresh = {r["benchmark"]: r for r in results}
            kept = {r["benchmark"]: r for r in previous["results"] if r["benchmark"] in BENCHMARKS}
            kept.update(fresh)
            results = [kept[name] for name in BENCHMARKS if name in kept]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"machine": info, "quick": args.quick, "results": results}, indent=2))
    written = [target]
    if not args.quick:
        write_markdown(results, table(results), info)
        written.append(RESULTS_MD)
    print("\nwrote " + " and ".join(str(p.relative_to(HERE.parent)) for p in written))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
