"""How long does a checkpoint block training, and what does saving cost in throughput?

A model of 4 x Linear(2048, 2048) trained with AdamW holds about 200 MB (parameters plus the two
moment buffers). For each mode (sync, async_copy, async: the default) the script trains ``--steps``
steps, saving every ``--every`` steps, and reports

* blocked: the time training waited for each save (median; from ``state.times["checkpoint"]`` over
  the steps from one save to the next: starting the save, an async save's staging wait before the
  next optimizer step (``async``: copying what the writer has not written from the live state yet),
  and publishing the previous save), its ratio to the sync save's in the same run, and the part of
  it spent in that wait before the optimizer step,
* durable: from the start of a save until its write finished on disk, checksummed for the
  manifest (median),
* checksums: the CRC-32s of the manifest, computed by a helper thread while the writer fsyncs the
  same files (median per save), and "exposed": how long the write waited for them after its own
  fsyncs were done. ``durable`` minus the exposed part is what the save cost without a manifest,
* throughput: steps/s of the run relative to the same run without checkpoints, and the CPU time
  per step relative to it (the CPU figure is robust to other processes on a shared machine; the
  wall-clock one is what a user sees).

Also timed once per mode: verifying the newest checkpoint against its manifest, the work a resume or
rollback adds before loading.

``--phases`` instead measures where a save's time goes (:class:`PhaseTimer`): the state dict, the
staging copy, DCP's planning, serialization, the writes, the CRC-32 checksums, the fsyncs, the
metadata and publishing, per save, in all threads and on the training thread, for the tiny Llama of
``checkpoint_throughput.py`` and the 200 MB state, ``sync`` and ``async``, alone and beside a
competing torch job (``benchmarks/threads.py``).

``--quick`` uses 4 x Linear(1024, 1024) (about 50 MB) and fewer steps (well under a minute).

Training uses one intra-op thread by default (``--threads``): on this 2-core machine two OpenMP
threads stall at every parallel region whenever another process takes a core, which made identical
runs 3 to 15 times slower at random and swamped the effect being measured; with one training thread
the writer has the other core. (Before the checkpointer's threads ran torch on one intra-op thread,
the writer's own OpenMP team also slowed every step after the first save with torch's default
thread count; see ``hookloop.engine.intra_op``.) ``benchmarks/checkpoint_throughput.py`` measures
throughput with torch's default thread count, as users run, beside HF Trainer and Lightning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from workload import LOCAL_FROM, kept_by_offset, kept_local, save_windows

from hookloop.engine import Events, Trainer
from hookloop.engine.checkpoint_format.manifest import CHECKSUM_ALGORITHM, RecordingWriter
from hookloop.engine.checkpoint_format.safe_read import verify_checkpoint
from hookloop.engine.events import every as fires
from hookloop.handlers import Places
from hookloop.handlers.checkpoint import AsyncCheckpointer

WRITERS: list[RecordingWriter] = []


def _keep_writers() -> None:
    """Keep every DCP writer the checkpointer makes, to read its checksum timings after the run."""
    init = RecordingWriter.__init__

    def keeping(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        WRITERS.append(self)

    RecordingWriter.__init__ = keeping


def build(width: int) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Trainer(model, optimizer, torch.nn.functional.mse_loss)


def state_megabytes(trainer: Trainer) -> float:
    n = sum(p.numel() for p in trainer.model.parameters())
    return 3 * n * 4 / 1e6  # parameters + exp_avg + exp_avg_sq, float32


def run(mode: str | None, width: int, steps: int, every: int, directory: str) -> dict:
    trainer = build(width)
    data = [(torch.randn(8, width), torch.randn(8, width)) for _ in range(16)]
    per_step: dict[int, float] = {}
    ends: dict[int, float] = {}  # each step's end, for the local reading of the throughput kept
    before_optimizer: dict[int, float] = {}  # the part of per_step spent before the optimizer step
    save_steps: list[int] = []
    durable: list[float] = []
    checkpointer = None
    if mode is not None:
        checkpointer = AsyncCheckpointer(directory, mode=mode, keep_last=2, resume=None)
        checkpointer.attach(trainer)

        @trainer.on(Events.STEP_START)
        def _save_cadence() -> None:  # what StepScheduler(ckpt_every_steps=every) asks for
            if fires(every, trainer.state.step):
                trainer.control.request_save(f"every {every} steps")

        @trainer.on(Events.BEFORE_OPTIMIZER_STEP, priority=Places.STAGING_WAIT - 1)
        def _staging_wait(engine: Trainer) -> None:
            before_optimizer[engine.state.step + 1] = engine.state.times.get("checkpoint", 0.0)

        @trainer.on(Events.STEP_END, priority=-100)
        def _account(engine: Trainer) -> None:
            step = engine.state.step
            per_step[step] = engine.state.times.get("checkpoint", 0.0)
            if checkpointer.last_saved_step != step:
                return
            save_steps.append(step)
            save = checkpointer._writer.inflight
            if save is None:  # sync: durable when the call returned
                durable.append(per_step[step])
                return
            started = time.perf_counter() - per_step[step]
            save.done.add_done_callback(lambda _f, s=started: durable.append(time.perf_counter() - s))

    @trainer.on(Events.STEP_END, priority=-101)
    def _stamp(engine: Trainer) -> None:
        ends[engine.state.step] = time.perf_counter()

    warmup = 2
    writers_before = len(WRITERS)
    trainer.run(data, max_steps=warmup)  # first-call costs (allocations, thread pools) out of the timing
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.run(data, max_steps=warmup + steps)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    verify = float("nan")
    if checkpointer is not None:
        checkpointer.close()
        start = time.perf_counter()
        problems, verified = verify_checkpoint(checkpointer.last_checkpoint)
        verify = time.perf_counter() - start
        assert verified and not problems, problems
    writers = WRITERS[writers_before:]
    checksums = [w.timings["checksum"] for w in writers]
    exposed = [w.timings["exposed"] for w in writers]
    # A save blocks at its own step, and (staged) before the next optimizer step or save.
    timed = [s for s in save_steps if s > warmup]
    windows = [range(s, s + every) for s in timed if s + every <= warmup + steps]
    blocked = [sum(per_step.get(t, 0.0) for t in w) for w in windows]
    waited = [sum(before_optimizer.get(t, 0.0) for t in w) for w in windows]
    durations = {k: ends[k] - ends[k - 1] for k in range(warmup + 2, warmup + steps + 1)}
    return {
        "steps_per_s": steps / elapsed,
        "cpu_per_step": cpu / steps,
        "blocked": statistics.median(blocked) if blocked else float("nan"),
        "waited": statistics.median(waited) if waited else float("nan"),
        "durable": statistics.median(durable) if durable else float("nan"),
        "checksums": statistics.median(checksums) if checksums else float("nan"),
        "exposed": statistics.median(exposed) if exposed else float("nan"),
        "verify": verify,
        "saves": len(durable),
        "mb": state_megabytes(trainer),
        "durations": durations,
        "timed": timed,
        "kept_local": kept_local(durations, timed, every),
    }


# ------------------------------------------------------------------------------ where a save's time goes
#: (phase, module, attribute): the functions timed for each phase of a save (wall time, per thread).
PHASE_FUNCTIONS = (
    ("state dict", "hookloop.handlers.checkpoint.writer", "get_state_dict"),
    ("state dict", "hookloop.handlers.checkpoint.optim_layout", "compact"),
    ("staging copy", "hookloop.handlers.checkpoint.host_copy", "HostCopy.freeze"),
    ("staging copy", "torch.distributed.checkpoint.staging", "DefaultStager.stage"),
    ("planning", "torch.distributed.checkpoint.default_planner", "DefaultSavePlanner.set_up_planner"),
    ("planning", "torch.distributed.checkpoint.default_planner", "DefaultSavePlanner.create_local_plan"),
    ("planning", "torch.distributed.checkpoint.default_planner", "DefaultSavePlanner.create_global_plan"),
    ("planning", "torch.distributed.checkpoint.default_planner", "DefaultSavePlanner.finish_plan"),
    ("serialization + writes", "hookloop.engine.checkpoint_format.manifest", "_write_entry"),
    ("writes", "hookloop.engine.checkpoint_format.durable_files", "_write_all"),
    ("writes", "hookloop.engine.checkpoint_format.durable_files", "_ChecksummingFile._write_direct"),
    ("fsyncs", "hookloop.engine.checkpoint_format.durable_files", "fsync_fd"),
    ("metadata", "hookloop.engine.checkpoint_format.manifest", "RecordingWriter.finish"),
    ("publishing", "hookloop.handlers.checkpoint.store", "CheckpointStore.publish"),
)
PHASES = (
    "state dict",
    "staging copy",
    "planning",
    "serialization",
    "writes",
    "checksums",
    "fsyncs",
    "metadata",
    "publishing",
)


class PhaseTimer:
    """Wall time spent in each phase of the saves made while entered (:data:`PHASE_FUNCTIONS`
    wrapped in place; an inner call of the same phase counts once), split by thread: the training
    thread's share is what training waits for directly. ``serialization`` is the time in the
    writer's ``_write_entry`` (a tensor's bytes, or a non-tensor entry's pickle) less the writes
    inside it; ``checksums`` the CRC-32s' own time (on a helper
    thread beside the writes, see ``durable_files``) from the writers' timings."""

    def __init__(self) -> None:
        import threading

        self.total: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.training: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._raw: dict[str, float] = {}
        self._main = threading.get_ident()
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []

    def _wrap(self, phase: str, fn: Any) -> Any:
        import functools
        import threading

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            inside = getattr(self._depth, phase, 0)
            setattr(self._depth, phase, inside + 1)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self._depth, phase, inside)
                if not inside:
                    spent = time.perf_counter() - start
                    with self._lock:
                        self._raw[phase] = self._raw.get(phase, 0.0) + spent
                        if threading.get_ident() == self._main:
                            key = f"{phase}@training"
                            self._raw[key] = self._raw.get(key, 0.0) + spent

        return timed

    def __enter__(self) -> PhaseTimer:
        import importlib

        for phase, module_name, attr in PHASE_FUNCTIONS:
            owner: Any = importlib.import_module(module_name)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(owner, name, self._wrap(phase, original))
        self._writers = len(WRITERS)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._patched:
            owner, name, original = self._patched.pop()
            setattr(owner, name, original)
        raw = self._raw
        for where, out in (("", self.total), ("@training", self.training)):
            for phase in PHASES:
                out[phase] = raw.get(phase + where, 0.0)
            out["serialization"] = max(
                raw.get("serialization + writes" + where, 0.0) - raw.get("writes" + where, 0.0), 0.0
            )
            out["writes"] = raw.get("writes" + where, 0.0)
        self.total["checksums"] = sum(w.timings["checksum"] for w in WRITERS[self._writers :])


def build_llama() -> tuple[Trainer, list]:
    """The tiny Llama of ``checkpoint_throughput.py`` (from a config, AdamW), and its microbatches."""
    from checkpoint_throughput import llama, microbatches

    model = llama()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), None)
    return trainer, microbatches(16)


def phases(kind: str, mode: str, saves: int, directory: str, shared: bool, every: int = 5) -> dict[str, Any]:
    """``saves`` saves of ``kind`` ("llama" or "200MB") in ``mode``, ``every`` steps apart (``--every``),
    after 2 untimed ones; the phases' time per save (all threads, and the training thread's share), the time
    the durable time per save."""
    from threads import Competitor

    if kind == "llama":
        trainer, data = build_llama()
    else:
        trainer = build(2048)
        data = [(torch.randn(8, 2048), torch.randn(8, 2048)) for _ in range(16)]
    checkpointer = AsyncCheckpointer(directory, mode=mode, keep_last=2, resume=None)
    checkpointer.attach(trainer)

    @trainer.on(Events.STEP_START)
    def _save_cadence() -> None:
        if fires(every, trainer.state.step):
            trainer.control.request_save(f"every {every} steps")

    warm = 2 * every
    trainer.run(data, max_steps=warm)
    checkpointer.wait()
    with contextlib.ExitStack() as stack:
        if shared:
            stack.enter_context(Competitor())
        timer = stack.enter_context(PhaseTimer())
        start = time.perf_counter()
        durable: list[float] = []

        @trainer.on(Events.STEP_END, priority=-100)
        def _durable(engine: Trainer) -> None:
            save = checkpointer._writer.inflight
            if checkpointer.last_saved_step == engine.state.step and save is not None:
                begun = time.perf_counter()
                save.done.add_done_callback(lambda _f: durable.append(time.perf_counter() - begun))

        trainer.run(data, max_steps=warm + saves * every)
        checkpointer.wait()
        elapsed = time.perf_counter() - start
    checkpointer.close()
    return {
        "phases": {k: v / saves for k, v in timer.total.items()},
        "training": {k: v / saves for k, v in timer.training.items()},
        "durable": statistics.median(durable) if durable else float("nan"),
        "per_save_s": elapsed / saves,
        "mb": sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(directory) for f in fs)
        / 1e6
        / 2,  # keep_last=2
    }


def print_phases(rows: dict[tuple[str, str, str], dict[str, Any]]) -> None:
    head = "".join(f"{p[:13]:>14s}" for p in PHASES)
    print(
        "\nwhere a save's time goes, ms per save (training thread's share in brackets); durable: from "
        f"the save's start until its files are fsynced (median); +job: beside a competing torch job\n"
        f"{'':34s}{head}{'durable':>9s}"
    )
    for (kind, mode, where), row in rows.items():
        cells = "".join(
            f"{row['phases'][p] * 1e3:>8.0f} ({row['training'][p] * 1e3:>3.0f})"
            if p != "checksums"
            else f"{row['phases'][p] * 1e3:>14.0f}"
            for p in PHASES
        )
        durable = "-" if mode == "sync" else f"{row['durable'] * 1e3:.0f} ms"  # sync: the phases' sum
        print(f"{kind:>6s} {mode:<6s} {where:<7s} {row['mb']:6.0f} MB {cells}{durable:>9s}")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 50 MB model and fewer steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--every", type=int, default=None, help="save every this many steps")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per mode (default 3, --quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for training")
    parser.add_argument("--json", type=Path, help="also write the figures here (benchmarks/run.py format)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="only where a save's time goes, per phase: the tiny Llama and 200 MB, sync and async, "
        "quiet and beside a competing torch job",
    )
    args = parser.parse_args()
    if args.phases:
        torch.set_num_threads(args.threads)
        _keep_writers()
        saves = 2 if args.quick else 4
        rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        print("# load average before: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        with tempfile.TemporaryDirectory(prefix="hookloop-ckpt-phases-", dir=args.dir) as root:
            for where in ("alone", "+job"):
                for kind in ("llama", "200MB"):
                    for mode in ("sync", "async"):
                        directory = os.path.join(root, f"{kind}-{mode}-{where}")
                        rows[(kind, mode, where)] = phases(
                            kind, mode, saves, directory, where == "+job", every=args.every or 5
                        )
        print("# load average after: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        print_phases(rows)
        return
    width = 1024 if args.quick else 2048
    steps = args.steps or (20 if args.quick else 60)
    every = args.every or (5 if args.quick else 10)
    args.repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    _keep_writers()
    root = args.dir or tempfile.mkdtemp(prefix="hookloop-ckpt-bench-")
    print(
        f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {cpu_model()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    modes = (None, "sync", "async_copy", "async")  # async is the default
    runs: dict = {mode: [] for mode in modes}
    try:
        print("# load average before: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        for _ in range(args.repeats):  # interleaved, so drifting background load hits every mode alike
            for mode in modes:
                runs[mode].append(run(mode, width, steps, every, os.path.join(root, str(mode))))
        print("# load average after: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def med(mode: str | None, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    def durable_ratio(mode: str) -> float:
        return med(mode, "durable") / (med(mode, "durable") - med(mode, "exposed"))

    base_rate, base_cpu = med(None, "steps_per_s"), med(None, "cpu_per_step")
    mb = runs[None][0]["mb"]
    print(
        f"state {mb:.0f} MB, {steps} steps per run, a save every {every} steps, {args.repeats} run(s) per "
        f"mode (medians); no checkpoints: {base_rate:.2f} steps/s, {base_cpu:.2f} CPU s/step"
    )
    print(
        f"{'mode':<14}{'blocked/save':>14}{'vs sync':>9}{'of it pre-opt':>15}{'durable':>10}{'checksums':>11}"
        f"{'exposed':>9}{'throughput':>12}{'CPU/step':>10}"
    )
    sync_blocked = med("sync", "blocked")
    for mode in modes[1:]:
        blocked = med(mode, "blocked")
        print(
            f"{mode:<14}{blocked * 1e3:>11.1f} ms{blocked / sync_blocked:>9.1%}"
            f"{med(mode, 'waited') * 1e3:>12.1f} ms{med(mode, 'durable'):>9.2f}s"
            f"{med(mode, 'checksums') * 1e3:>8.0f} ms{med(mode, 'exposed') * 1e3:>6.0f} ms"
            f"{med(mode, 'steps_per_s') / base_rate:>12.1%}"
            f"{med(mode, 'cpu_per_step') / base_cpu:>10.1%}"
        )
    verify = statistics.median(r["verify"] for mode in modes[1:] for r in runs[mode])
    print(
        f"manifest ({CHECKSUM_ALGORITHM}): durable with checksums / without (durable minus "
        "exposed): "
        + ", ".join(f"{mode} {durable_ratio(mode):.3f}" for mode in modes[1:])
        + f"; verifying the newest checkpoint on load: {verify * 1e3:.0f} ms"
    )
    ratios = ", ".join(
        f"{mode} " + "/".join(f"{a['blocked'] / b['blocked']:.2f}" for a, b in zip(runs[mode], runs["sync"]))
        for mode in modes[2:]
    )
    print(f"blocked vs sync in each repeat: {ratios}")
    kept = ", ".join(  # each repeat against the run without checkpoints of the same repeat
        f"{mode} "
        + "/".join(f"{a['steps_per_s'] / b['steps_per_s']:.2f}" for a, b in zip(runs[mode], runs[None]))
        for mode in modes[1:]
    )
    print(f"throughput kept in each repeat (saving / not saving, same repeat): {kept}")
    local = ", ".join(
        f"{mode} " + "/".join("-" if r["kept_local"] is None else f"{r['kept_local']:.3f}" for r in rows)
        for mode, rows in runs.items()
        if mode is not None
    )
    print(
        f"throughput kept in each repeat, read locally (each save's {every} steps against their own median "
        f"step from the {LOCAL_FROM}rd after it on; the machine's drift between runs left out): {local}"
    )

    def shown(k: float | None) -> str:
        return "-" if k is None else f"{k:.3f}"

    by_offset = {  # every repeat's windows; the runs without checkpoints at the async runs' save steps
        mode: kept_by_offset(
            [
                w
                for r, a in zip(rows, runs["async"])
                for w in save_windows(r["durations"], (r if mode else a)["timed"], every)
            ]
        )
        for mode, rows in runs.items()
    }
    print(
        "throughput kept, read per offset (each step of a save's window over the window's median from "
        f"the {LOCAL_FROM}rd on, the median over every repeat's saves at each offset; bursts of noise "
        "leave it): "
        + ", ".join(f"{mode} {shown(k)}" for mode, k in by_offset.items() if mode)
        + f"; the runs without checkpoints, the same steps: {shown(by_offset[None])}"
    )
    if args.json:
        figures = [
            {
                "figure": f"blocked per save, {mode}{' (default)' if mode == 'async' else ''} ({mb:.0f} MB)",
                "hookloop": med(mode, "blocked") * 1e3,
                "reference": sync_blocked * 1e3,
                "ratio": med(mode, "blocked") / sync_blocked,
                "target": "<= 0.15 of sync" if mode == "async" else None,
                "met": (med(mode, "blocked") / sync_blocked <= 0.15) if mode == "async" else None,
                "unit": "ms",
            }
            for mode in modes[1:]
        ]
        figures += [
            {
                "figure": f"throughput saving every {every} steps, {mode}",
                "hookloop": med(mode, "steps_per_s"),
                "reference": base_rate,
                "ratio": med(mode, "steps_per_s") / base_rate,
                "target": ">= 0.9",
                "met": med(mode, "steps_per_s") / base_rate >= 0.9,
                "unit": "steps/s",
            }
            for mode in modes[1:]
        ]
        local_runs = {m: [r["kept_local"] for r in runs[m] if r["kept_local"] is not None] for m in modes[1:]}
        worst = {m: min(local) for m, local in local_runs.items() if local}
        figures += [
            {
                "figure": f"throughput saving every {every} steps, read locally, worst repeat, {mode}",
                "hookloop": low,
                "reference": 1.0,
                "ratio": low,
                "target": ">= 0.95" if mode == "async" else None,
                "met": low >= 0.95 if mode == "async" else None,
            }
            for mode, low in worst.items()
        ]
        figures += [
            {
                "figure": f"throughput saving every {every} steps, read per offset, all repeats, {mode} "
                "(reference: the runs without checkpoints at the same steps)",
                "hookloop": kept,
                "reference": by_offset[None],
                "ratio": kept / by_offset[None] if by_offset[None] else None,
            }
            for mode, kept in by_offset.items()
            if mode is not None and kept is not None
        ]
        figures += [
            {
                "figure": f"durable per save with manifest checksums vs without, {mode}",
                "hookloop": med(mode, "durable") * 1e3,
                "reference": (med(mode, "durable") - med(mode, "exposed")) * 1e3,
                "ratio": durable_ratio(mode),
                "target": "<= 1.1",
                "met": durable_ratio(mode) <= 1.1,
                "unit": "ms",
            }
            for mode in modes[1:]
        ]
        figures.append(
            {
                "figure": f"verify the newest checkpoint against its manifest on load ({mb:.0f} MB)",
                "hookloop": verify * 1e3,
                "reference": None,
                "ratio": None,
                "target": None,
                "met": None,
                "unit": "ms",
            }
        )
        notes = (
            "On 2 cores the background writer competes with training for the same cores and memory "
            "bandwidth: that, not the engine, bounds the throughput with saves. Every save also "
            "writes a manifest (size and CRC-32 of every file) into its completion marker: the "
            "checksums run on a helper thread while the writer fsyncs the same files, and `exposed` "
            "is what the write waited for them beyond its fsyncs. A side-by-side run against the "
            "code before the manifest is in benchmarks/results/checkpoint.md."
        )
        args.json.write_text(
            json.dumps({"benchmark": "checkpoint", "figures": figures, "notes": notes}, indent=2)
        )


if __name__ == "__main__":
    main()
