"""Intra-op threads for ``hookloop train``, on an idle machine and beside a competing torch job.

Each contender is ``python -m hookloop train`` of the example config (``gpt_tiny``, 0.87 M
parameters) or of a larger GPT (6 layers, width 384, 128 tokens; ~11 M parameters), with its
default handlers and a checkpoint every 10 steps, started with one thread setting in its
environment:

* ``torch default``: ``OMP_NUM_THREADS`` = the machine's cores and GNU OpenMP's own spin count
  (``GOMP_SPINCOUNT=300000``: a waiting thread spins ~3 ms before it sleeps), what a process that
  sets nothing gets,
* ``hookloop default``: nothing set, so the command's own default (``hookloop.threads``: torch's
  count, ``OMP_WAIT_POLICY=passive``, waiting threads sleep),
* ``N threads, spin 1k``: torch's count with ``GOMP_SPINCOUNT=1000``,
* ``1 thread``: ``OMP_NUM_THREADS=1``,
* with ``--torchrun``: two data-parallel processes, each with the command's default and each with
  the machine's cores.

Throughput is the tokens of steps 10 to the last over the wall time between those progress
records (saves included); a run still going after ``TIMEOUT`` is stopped and measured over the
steps it did. Each round runs every contender idle and then beside a competing torch job (a process
multiplying 512 x 512 matrices with torch's defaults, as a second user's job would), the order
turning each round. Reported per contender: the median idle throughput, "vs torch" (idle
throughput over the ``torch default`` contender's in the same round), "kept" (shared throughput
over idle throughput in the same round, median over rounds; two equal jobs sharing fairly keep 0.5;
target 0.35) and "other kept" (the competing job's rate beside the contender over its rate alone:
whether a contender keeps its share by taking the other's).

    python benchmarks/threads.py [--rounds N] [--workloads example larger] [--torchrun] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "configs" / "gpt_tiny.yaml"
WORKLOADS = {
    "example": (60, []),
    "larger": (25, ["model.n_layers=6", "model.d_model=384", "model.n_heads=6", "train.seq_len=128"]),
}
CORES = os.cpu_count() or 1
TIMEOUT = 90.0  # seconds a run may take; a run that needs more is reported from its progress so far
# torch's default is OpenMP's default waits: a policy must be named for the command not to set
# passive ones, and "active" with GNU OpenMP's default spin count (300,000) is what an unset policy
# gives a team no larger than the cores.
SETTINGS = {
    "torch default": {"OMP_NUM_THREADS": str(CORES), "OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"},
    f"hookloop default ({CORES} threads, passive)": {},
    f"{CORES} threads, spin 1k": {"OMP_NUM_THREADS": str(CORES), "GOMP_SPINCOUNT": "1000"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
TORCHRUN = {
    "torchrun x2, hookloop default": {},
    f"torchrun x2, {CORES} threads each": {"OMP_NUM_THREADS": str(CORES), "OMP_WAIT_POLICY": "active"},
}
COMPETITOR = """
import sys, time, torch
a = torch.randn(512, 512)
n, start = 0, time.perf_counter()
while True:
    a = torch.tanh(a @ a)
    n += 1
    if n % 20 == 0:
        print(n / (time.perf_counter() - start), flush=True)
"""


VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _env(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env.update(setting)
    return env


def train(workload: str, setting: dict[str, str], torchrun: bool, directory: str) -> float:
    """Tokens per second of steps 10 to the last, saves included."""
    steps, overrides = WORKLOADS[workload]
    run_dir = tempfile.mkdtemp(dir=directory)
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        if torchrun
        else [sys.executable]
    )
    command = [
        *launcher,
        "-m",
        "hookloop",
        "train",
        str(CONFIG),
        *overrides,
        f"step_scheduler.max_steps={steps}",
        "step_scheduler.ckpt_every_steps=10",
        "step_scheduler.val_every_steps=null",
        "logging.log_interval=5",
        f"train.run_dir={run_dir}",
    ]
    process = subprocess.Popen(
        command,
        env=_env(setting),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        process.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # an oversubscribed run crawls: take what it did until now
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    records = [json.loads(line) for line in open(os.path.join(run_dir, "progress.jsonl"))]
    progress = [r for r in records if r.get("event") == "progress" and r["step"] >= 2]
    counted = [r for r in progress if r["step"] >= 10]
    first, last = (counted[0], counted[-1]) if len(counted) > 1 else (progress[0], progress[-1])
    return (last["tokens_seen"] - first["tokens_seen"]) / max(last["time"] - first["time"], 1e-9)


class Competitor:
    """A second torch job with torch's defaults, multiplying matrices until stopped."""

    def __enter__(self) -> Competitor:
        env = _env({})
        self.process = subprocess.Popen(
            [sys.executable, "-c", COMPETITOR],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.process.stdout.readline()  # it is running
        return self

    def rate(self) -> float:
        os.killpg(self.process.pid, signal.SIGTERM)
        lines = self.process.stdout.read().split()
        return float(lines[-1]) if lines else float("nan")

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def competitor_alone(seconds: float = 8.0) -> float:
    with Competitor() as c:
        time.sleep(seconds)
        return c.rate()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torchrun", action="store_true", help="also two processes per machine")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="one round, the example only")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rounds, workloads = (1, ["example"]) if args.quick else (args.rounds, args.workloads)
    contenders = [(name, setting, False) for name, setting in SETTINGS.items()]
    if args.torchrun:
        contenders += [(name, setting, True) for name, setting in TORCHRUN.items()]
    quiet: dict = {}
    shared: dict = {}
    beside: dict = {}
    alone = []
    with tempfile.TemporaryDirectory() as directory:
        for r in range(rounds):
            alone.append(competitor_alone())
            for workload in workloads:
                turned = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
                for name, setting, torchrun in turned:
                    key = (workload, name)
                    quiet.setdefault(key, []).append(train(workload, setting, torchrun, directory))
                    with Competitor() as c:
                        shared.setdefault(key, []).append(train(workload, setting, torchrun, directory))
                        beside.setdefault(key, []).append(c.rate())
                    print(
                        f"round {r + 1} {workload:8s} {name:30s} idle {quiet[key][-1]:8.0f} tok/s, "
                        f"shared {shared[key][-1]:8.0f} tok/s, competitor {beside[key][-1]:6.1f}/s",
                        flush=True,
                    )
    figures = []
    print(f"\ncompeting job alone: {statistics.median(alone):.1f} products/s (median of {len(alone)})")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)")
    print(f"{'workload':9s} {'contender':30s} {'idle tok/s':>10s} {'vs torch':>9s}", end="")
    print(f" {'kept':>6s} {'other kept':>11s}")
    for (workload, name), values in quiet.items():
        kept = statistics.median(s / q for s, q in zip(shared[(workload, name)], values))
        torch_default = quiet[(workload, "torch default")]
        vs_torch = statistics.median(q / d for q, d in zip(values, torch_default))
        other = statistics.median(b / a for b, a in zip(beside[(workload, name)], alone))
        idle = statistics.median(values)
        print(f"{workload:9s} {name:30s} {idle:10.0f} {vs_torch:9.2f} {kept:6.2f} {other:11.2f}")
        figures.append(
            {
                "figure": f"threads: {workload}, {name}: beside a competing job / idle",
                "hookloop": statistics.median(shared[(workload, name)]),
                "reference": idle,
                "ratio": kept,
                "target": ">= 0.35" if "hookloop" in name else "-",
                "met": kept >= 0.35 if "hookloop" in name else None,
                "unit": "tok/s",
            }
        )
    result = {"benchmark": "threads", "figures": figures}
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
