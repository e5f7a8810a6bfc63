"""Live recovery across replica groups (``fault_tolerance``, torchft) against today's paths.

    python benchmarks/live_recovery.py [--quick] [--json PATH]

Everything is ``hookloop train`` in real processes on gloo, one process per replica group, a
lighthouse in this process (heartbeat timeout 500 ms), a small GPT on the standard library's
documentation:

- **Step time without failures**: 2 replica groups (and 3, full run only) against plain DDP over
  the same number of processes under torchrun, same model and global batch; the median of the
  per-step times the runs log (``metrics.jsonl`` with ``logging.log_interval=1``), the first steps
  left out, interleaved rounds, the median over rounds. Target: <= 1.05.
- **Work lost per failure**: the training time a SIGKILL of one process costs, measured as the
  time from the kill until the run has trained ``M`` more steps than it had when killed, minus ``M``
  steps at the speed the run has after the failure (the median step from there on: a survivor
  alone steps faster than two groups did, which must not hide its stall). Live recovery: one of 2
  groups killed, the survivor goes on (the killed group's restart and heal do not hold it up).
  Restart from a checkpoint (today's path): one of 2 DDP workers killed, torchrun ends the job, the
  same command is started again and resumes from the last checkpoint (every ``K`` steps),
  replaying the steps since. Target: live recovery loses at least 5x less (ratio <= 0.2).

``--quick`` is a smoke test (about 20 s on 2 idle cores): no interleaved rounds (the step times
come from the failure runs before their kills) and one process for the restart path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch import free_port  # noqa: E402
from benchmarks.workload import write_result  # noqa: E402

CONFIG = """
model:
  target: hookloop.models.gpt:recipe
  n_layers: {layers}
  d_model: {d_model}
  n_heads: 4
train:
  seq_len: {seq_len}
  local_batch_size: {batch}
step_scheduler:
  global_batch_size: {global_batch}
  max_steps: {max_steps}
  num_epochs: null
  ckpt_every_steps: {ckpt_every}
  val_every_steps: null
lr:
  warmup_steps: 0
logging:
  log_interval: 1
nan:
  action: warn
metrics:
  enabled: true
data:
  datasets: {{docs: docs.u8}}
  val_samples: 0
fault_tolerance:
  num_replica_groups: 2
  timeout_s: 10
  quorum_timeout_s: 60
"""
WAIT_S = 300.0


class Proc:
    """A process in a session of its own, output to a file; killed with its session on close."""

    def __init__(self, cmd: list[str], cwd: Path, log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.log = log

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.log.name} did not end in {timeout:.0f} s") from None


def rows(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, wall time it was logged)`` of every line (a resumed run logs replayed steps again);
    lines reach the file within a second (``engine.record_file``)."""
    out = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                row = json.loads(line)
                out.append((int(row["step"]), float(row["time"])))
    return out


def step_times(run_dir: Path) -> dict[int, float]:
    """``{step: wall time}``, a replayed step's last."""
    return dict(rows(run_dir))


def median_step(times: dict[int, float], skip: int, upto: int | None = None) -> float:
    steps = sorted(s for s in times if s > skip and (upto is None or s <= upto))
    gaps = [times[b] - times[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
    return statistics.median(gaps)


def wait_step(run_dir: Path, step: int, procs: list[Proc], after: float = 0.0) -> float:
    """Wait until a step >= ``step`` is logged at a time after ``after``; that time."""
    deadline = time.monotonic() + WAIT_S
    while True:
        times = [t for s, t in rows(run_dir) if s >= step and t > after]
        if times:
            return min(times)
        if any(p.proc.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            logs = "\n".join(p.log.read_text()[-1500:] for p in procs)
            raise RuntimeError(f"step {step} never logged in {run_dir}:\n{logs}")
        time.sleep(0.05)


def reached_before(run_dir: Path, killed: float) -> int:
    """The last step logged before the kill (read once the lines of that time are in the file)."""
    return max(s for s, t in rows(run_dir) if t <= killed)


def lost_seconds(run_dir: Path, killed: float, reached: int, more: int) -> float:
    """Seconds from the kill to ``more`` steps past ``reached``, beyond ``more`` steps at the speed
    the run has after the failure."""
    done = min(t for s, t in rows(run_dir) if s >= reached + more and t > killed)
    after = {s: t for s, t in rows(run_dir) if t > killed}
    return max(0.0, done - killed - more * median_step(after, reached, upto=reached + more))


class Bench:
    def __init__(self, root: Path, quick: bool) -> None:
        self.root, self.quick = root, quick
        self.procs: list[Proc] = []
        self.runs = 0

    def start(self, cmd: list[str], name: str) -> Proc:
        proc = Proc(cmd, self.root, self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.kill()

    def run_dir(self, tag: str) -> Path:
        self.runs += 1
        return self.root / "runs" / f"{tag}{self.runs}"

    def ddp(self, nproc: int, run_dir: Path, *overrides: str) -> Proc:
        """``hookloop train`` under torchrun with ``nproc`` processes (1: no torchrun)."""
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
            cmd += [f"--master-port={free_port()}"]
        cmd += ["-m", "hookloop", "train", "run.yaml"]
        return self.start([*cmd, f"train.run_dir={run_dir}", *overrides], run_dir.name)

    def group(self, g: int, groups: int, lighthouse: str, run_dir: Path, *overrides: str) -> Proc:
        cmd = [sys.executable, "-m", "hookloop", "train", "run.yaml", f"train.run_dir={run_dir}"]
        cmd += ["fault_tolerance.enabled=true", f"fault_tolerance.replica_group_id={g}"]
        cmd += [f"fault_tolerance.num_replica_groups={groups}", f"fault_tolerance.lighthouse={lighthouse}"]
        return self.start([*cmd, *overrides], f"{run_dir.name}-g{g}")


def lighthouse(min_replicas: int) -> tuple[object, str]:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=2000, heartbeat_timeout_ms=500
    )
    port = server.address().rsplit(":", 1)[1].rstrip("/")
    return server, f"http://127.0.0.1:{port}"


def step_time_round(bench: Bench, groups: int, steps: int, warmup: int) -> tuple[float, float]:
    """Median seconds per step: (replica groups, DDP over as many processes)."""
    limit = f"step_scheduler.max_steps={steps}"
    run = bench.run_dir(f"ddp{groups}_")
    batch = f"step_scheduler.global_batch_size={groups * BATCH_SHARE}"
    if bench.ddp(groups, run, limit, batch).wait() != 0:
        raise RuntimeError(f"the DDP run failed: {bench.procs[-1].log.read_text()[-2000:]}")
    ddp = median_step(step_times(run), warmup)
    server, address = lighthouse(groups)  # every group from the first step on
    try:
        run = bench.run_dir(f"ft{groups}_")
        extra = (limit, batch, f"fault_tolerance.min_replicas={groups}")
        procs = [bench.group(g, groups, address, run, *extra) for g in range(groups)]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"a replica group failed: {p.log.read_text()[-2000:]}")
    finally:
        server.shutdown()
    ft = statistics.median(median_step(step_times(run / f"replica_group_{g}"), warmup) for g in range(groups))
    return ft, ddp


def lost_live(bench: Bench, kill_at: int, more: int, warmup: int) -> tuple[float, float]:
    """Seconds of training lost by the survivor when one of 2 groups is SIGKILLed, and the median
    step while both trained (after ``warmup`` steps of both)."""
    server, address = lighthouse(1)
    try:
        run = bench.run_dir("ftkill")
        g0 = bench.group(0, 2, address, run, "fault_tolerance.min_replicas=1")
        g1 = bench.group(1, 2, address, run, "fault_tolerance.min_replicas=1")
        dirs = [run / f"replica_group_{g}" for g in (0, 1)]
        for d in dirs:  # both groups training (the later one healed in from the first)
            wait_step(d, 0, [g0, g1])
        both = max(min(step_times(d)) for d in dirs)  # the first step the later group logged
        wait_step(dirs[1], both + warmup + kill_at, [g0, g1])
        g1.kill()
        killed = time.time()
        survivor = run / "replica_group_0"
        wait_step(survivor, 0, [g0], after=killed + 1.5)  # the lines before the kill are written
        reached = reached_before(survivor, killed)
        wait_step(survivor, reached + more, [g0], after=killed)
        g0.proc.send_signal(signal.SIGTERM)
        g0.wait()
    finally:
        server.shutdown()
    two = median_step(step_times(dirs[1]), both + warmup)  # group 1's steps: all with group 0
    return lost_seconds(survivor, killed, reached, more), two


def lost_restart(
    bench: Bench, kill_at: int, more: int, warmup: int, every: int, nproc: int = 2
) -> tuple[float, float]:
    """Seconds lost when one of ``nproc`` DDP workers is SIGKILLed and the job restarts from its
    checkpoint, and the median step before the kill (after ``warmup`` steps)."""
    run = bench.run_dir("ddpkill")
    ckpt = f"step_scheduler.ckpt_every_steps={every}"
    batch = f"step_scheduler.global_batch_size={nproc * BATCH_SHARE}"
    job = bench.ddp(nproc, run, ckpt, batch)
    wait_step(run, warmup + kill_at, [job])
    workers = _children(job.proc.pid) if nproc > 1 else [job.proc.pid]
    os.kill(workers[-1], signal.SIGKILL)  # one worker: torchrun then ends the job (exit 1)
    killed = time.time()
    job.wait()
    print(f"  restart path: the job ended {time.time() - killed:.1f} s after the kill", flush=True)
    reached = reached_before(run, killed)
    before = median_step(step_times(run), warmup, upto=reached)
    again = bench.ddp(nproc, run, ckpt, batch)  # what a requeued job does: the same command
    wait_step(run, reached + more, [again], after=killed)
    again.proc.send_signal(signal.SIGTERM)
    again.wait()
    return lost_seconds(run, killed, reached, more), before


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


BATCH_SHARE = 16  # samples per process per step: local batch 8 x 2 microbatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    quick = args.quick
    os.environ.setdefault("RUST_LOG", "warn")
    from hookloop.engine.data import prepare_tokens, stdlib_docs_text

    shape = dict(layers=1, d_model=32, seq_len=32) if quick else dict(layers=2, d_model=128, seq_len=64)
    steps, warmup, rounds = (12, 3, 0) if quick else (120, 20, 3)
    kill_at, more, every = (8, 5, 4) if quick else (40, 20, 20)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_tokens([stdlib_docs_text()[:200_000]], root / "docs.u8")
        (root / "run.yaml").write_text(
            CONFIG.format(
                **shape, batch=8, global_batch=2 * BATCH_SHARE, max_steps=100_000, ckpt_every="null"
            )
        )
        bench = Bench(root, quick)
        try:
            figures_by_groups: dict[int, list[tuple[float, float]]] = {2: []}
            if not quick:
                figures_by_groups[3] = []
            for _ in range(rounds):
                for groups in figures_by_groups:
                    figures_by_groups[groups].append(step_time_round(bench, groups, steps, warmup))
            live, ft_step = lost_live(bench, kill_at, more, warmup)
            # smoke-sized: one process stands for the DDP job (a torchrun launch costs seconds here)
            restart, ddp_step = lost_restart(bench, kill_at, more, warmup, every, nproc=1 if quick else 2)
            if quick:  # smoke-sized: the step times of the failure runs, before their kills
                figures_by_groups[2].append((ft_step, ddp_step))
        finally:
            bench.close()
    figures = []
    how = f"{rounds} interleaved round(s)" if rounds else "the failure runs before their kills"
    print(f"step time, median of per-step times after {warmup} steps, {how}:")
    for groups, pairs in figures_by_groups.items():
        ft = statistics.median(p[0] for p in pairs) * 1000
        ddp = statistics.median(p[1] for p in pairs) * 1000
        ratio = ft / ddp
        ref = "one process (smoke-sized)" if quick else f"DDP over {groups} processes"
        print(f"  {groups} replica groups {ft:.1f} ms, {ref} {ddp:.1f} ms: {ratio:.2f}")
        figures.append(
            {
                "figure": f"live recovery: step ms, {groups} replica groups vs DDP",
                "hookloop": ft,
                "reference": ddp,
                "ratio": ratio,
                "target": "<= 1.05",
                "met": ratio <= 1.05,
                "unit": "ms",
            }
        )
    ratio = live / restart if restart > 0 else 0.0
    print(f"work lost per failure (SIGKILL after ~{warmup + kill_at} steps, back {more} steps further):")
    print(f"  live recovery {live:.2f} s; restart from a checkpoint every {every} steps {restart:.2f} s")
    figures.append(
        {
            "figure": "live recovery: work lost per failure vs restart from checkpoint",
            "hookloop": live,
            "reference": restart,
            "ratio": ratio,
            "target": "<= 0.2",
            "met": ratio <= 0.2,
            "unit": "s",
        }
    )
    write_result(args.json, {"benchmark": "live_recovery", "figures": figures})


if __name__ == "__main__":
    main()
