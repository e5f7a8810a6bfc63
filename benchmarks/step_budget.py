"""Host syncs and small collectives per training step, against a hand-written loop.

A step should make the host wait for the device only where a hand-written loop with the same
optimizer would, and agree its decisions with as few small collectives as possible. This benchmark
counts both on steps that do no logging, validation or checkpointing:

* :class:`SyncCounter` -- a ``TorchDispatchMode`` counting scalar reads (``aten._local_scalar_dense``:
  ``.item()``, ``float(t)``, ``bool(t)``), device-to-host copies (``_to_copy`` / ``copy_`` /
  ``_copy_from`` from a non-CPU device into CPU memory) and ops whose output size depends on device
  data (``nonzero``, ``masked_select``, ``unique`` on a non-CPU device). On this CPU machine the
  last two never occur; on a GPU they are syncs too. ``tensor.tolist()`` on a CPU tensor
  dispatches nothing (it reads host memory) and is not counted here.
* :class:`HostReadCounter` -- a ``TorchFunctionMode`` counting the reads of step tensors to Python
  that this repository's code makes (``.tolist()``, ``.item()``, ``float(t)``, ``bool(t)``,
  ``.cpu()``, ``.numpy()`` ...), also of CPU tensors: each would be a device-to-host wait on a GPU.
  Tensors built from host numbers (the agreement's requests and votes) are not step tensors.
* :class:`CollectiveCounter` -- wraps the collective functions of ``torch.distributed`` wherever a
  loaded module holds them (``dist.all_reduce`` as well as a ``from torch.distributed import
  all_reduce`` done earlier); a collective that calls another (``all_gather_object`` ->
  ``all_gather``) counts once. DDP's gradient bucket all-reduces run in its C++ reducer and are not
  counted: they are the same in every contender. Under FSDP2 its gradient reduce-scatters are
  Python calls and would be counted.

Contenders, each on 2 gloo ranks (DDP, one thread each) and in one process, with the same tiny GPT,
fused AdamW (its step counters stay tensors; the NaN detector skips a bad step through its
``found_inf``, on the device), constant LR schedule, data, gradient accumulation and clipping: a
hand-written loop, a bare ``Trainer``, and a ``Trainer`` with StepScheduler, AsyncCheckpointer,
NaNDetector and MetricsTracker attached by ``attach_handlers`` (log, validation and checkpoint
cadences beyond the run, so only the final step saves; the initial checkpoint a NaN rollback needs
is published before counting starts). Counting covers whole step cycles after warm-up: from the end
of step ``warmup`` to the end of step ``warmup + steps``; a few more steps follow so the run's last
step (which saves) is outside. Step times are taken in separate runs without the counters (the
dispatch mode slows every op) and compared per round with the hand-written loop.

    python benchmarks/step_budget.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.launch import run_ranks  # noqa: E402
from benchmarks.workload import ACCUM, BATCH, tiny_gpt, token_microbatches, write_result  # noqa: E402

aten = torch.ops.aten
REPO = Path(__file__).resolve().parents[1]
_COUNTER_FRAMES = {"__torch_dispatch__", "__torch_function__", "counted"}


def call_site() -> str:
    """``path:line function`` of the innermost caller in this repository (the counters' own frames
    skipped): where a counted sync or collective comes from."""
    frame = sys._getframe(1)
    here = str(Path(__file__).resolve())
    while frame is not None:
        code = frame.f_code
        filename = _source(code.co_filename)
        inside = filename.startswith(str(REPO) + os.sep) and "site-packages" not in filename
        if inside and not (filename == here and code.co_name in _COUNTER_FRAMES):
            rel = os.path.relpath(filename, REPO)
            return f"{rel}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return "outside the repository"


@functools.cache
def _source(filename: str) -> str:
    """The file a frame runs, its links resolved (a strict editable install runs the package
    through links in ``build/__editable__...`` to the repository's files)."""
    return os.path.realpath(filename)


# ----------------------------------------------------------------------------- sync counter

_SCALAR_READ = aten._local_scalar_dense.default
#: Ops whose output size depends on the data: on an accelerator the host waits to size the result.
_DATA_DEPENDENT = {
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
}


def _on_device(x: Any) -> bool:
    """A tensor whose data lives off the host (reading it makes the host wait for the device)."""
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def sync_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    """What kind of host sync the dispatched op ``func(*args, **kwargs)`` is, or None."""
    if func is _SCALAR_READ:
        return "scalar read (_local_scalar_dense)"
    if func is aten._to_copy.default:
        target = kwargs.get("device")
        if _on_device(args[0]) and target is not None and torch.device(target).type == "cpu":
            return "device-to-host copy (_to_copy)"
        return None
    if func is aten.copy_.default:  # copy_(dst, src)
        if isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and _on_device(args[1]):
            return "device-to-host copy (copy_)"
        return None
    if func is aten._copy_from.default:  # _copy_from(src, dst)
        if _on_device(args[0]) and isinstance(args[1], torch.Tensor) and args[1].device.type == "cpu":
            return "device-to-host copy (_copy_from)"
        return None
    name = _DATA_DEPENDENT.get(func)
    if name is not None and _on_device(args[0]):
        return f"data-dependent size ({name})"
    return None


class SyncCounter(TorchDispatchMode):
    """Counts host syncs by kind (see :func:`sync_kind`) while entered. A dispatch mode is
    thread-local: ops of the thread that entered it are seen (on CPU that includes backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # where they come from (see call_site)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.counts[kind] += 1
            self.sites[call_site()] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


# ----------------------------------------------------------------------------- host read counter

#: Tensor methods that hand a tensor's values to Python: on a GPU each one waits for the device.
_READS = {
    "tolist",
    "item",
    "numpy",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "__format__",
    "__array__",
}
#: Factories whose result holds host numbers only when given no tensor.
_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange"}


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """``tensor.cpu()`` / ``tensor.to("cpu")``: a copy to host memory. ``tensor.to(device)`` with a
    ``torch.device`` is how batches go to the compute device (on this machine also the CPU) and is
    not counted; on a GPU :class:`SyncCounter` sees a real device-to-host ``_to_copy``."""
    if name == "cpu":
        return True
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, str)), None))
    return name == "to" and target == "cpu"


class HostReadCounter(TorchFunctionMode):
    """Counts reads of a step's tensors to Python (``.tolist()``, ``.item()``, ``float(t)``,
    ``bool(t)``, ``.cpu()``, ``.to("cpu")``, ``.numpy()`` ...) made by this repository's code while
    entered: on a GPU each is a device-to-host wait; on this CPU machine
    :class:`SyncCounter` cannot see ``.tolist()`` or ``.cpu()`` of a CPU tensor, this can.

    Not counted: reads made inside torch itself (AdamW's per-parameter step counters live on the host
    even on a GPU; :class:`SyncCounter` counts those), and reads of *host tensors*: tensors built
    from Python numbers in the window (``torch.tensor([...])``) and everything computed only from
    such tensors (a collective keeps a host tensor a host tensor; writing a step tensor into it makes
    it a step tensor: into a view of it, that view, so a buffer whose first half holds host numbers
    and second half a step's sums reads its first half for free, as the agreement's does with gloo;
    on a GPU the two halves are separate tensors). A function mode is thread-local: the entering
    thread's calls are seen."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # where they come from (see call_site)
        self._host: dict[int, weakref.ref] = {}  # host tensors by id (a tensor's == is elementwise)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = list(_tensors([*args, *kwargs.values()]))
        host_inputs = all(self._is_host(t) for t in inputs)
        if (name in _READS or _to_host(name, args, kwargs)) and inputs and not host_inputs:
            caller = sys._getframe(1).f_code.co_filename
            if _inside_repository(caller):
                self.counts[f"{name}()"] += 1
                self.sites[call_site()] += 1
        out = func(*args, **kwargs)
        if not host_inputs and _writes_first(name) and isinstance(args[0], torch.Tensor):
            self._host.pop(id(args[0]), None)  # a step tensor written into a host tensor: a step tensor
        elif host_inputs and isinstance(out, torch.Tensor) and (inputs or name in _FACTORIES):
            self._host[id(out)] = weakref.ref(out)
        return out

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _writes_first(name: str) -> bool:
    """Whether the method ``name`` writes into its tensor (``add_``, ``copy_``, ``t[i] = x``)."""
    if name.startswith("__"):
        return name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__")
    return name.endswith("_")


def _inside_repository(filename: str) -> bool:
    path = _source(filename)
    return path.startswith(str(REPO) + os.sep) and "site-packages" not in path


# ----------------------------------------------------------------------------- collective counter

#: The Python-level collectives of ``torch.distributed`` (names missing in a torch version are skipped).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
)


class CollectiveCounter:
    """Counts calls of :data:`COLLECTIVES` by name while entered, from every thread.

    Entering replaces each collective function wherever a loaded module holds it (``torch.distributed``,
    ``torch.distributed.distributed_c10d``, and any module that imported one by name); leaving puts
    the originals back. A collective called from inside another counts once, as the outer one."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # where they come from (see call_site)
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._patched: list[tuple[types.ModuleType, str, Any]] = []

    def _wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                site = call_site()
                with self._lock:
                    self.counts[name] += 1
                    self.sites[f"{name} at {site}"] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed.distributed_c10d as c10d

        originals = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}
        wrappers = {name: self._wrap(name, fn) for name, fn in originals.items()}
        by_id = {id(fn): name for name, fn in originals.items()}
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            try:
                namespace = vars(module)
            except TypeError:
                continue
            for attr, value in list(namespace.items()):
                name = by_id.get(id(value))
                if name is not None and value is originals[name]:
                    setattr(module, attr, wrappers[name])
                    self._patched.append((module, attr, value))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._patched:
            module, attr, original = self._patched.pop()
            setattr(module, attr, original)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def counting() -> Iterator[tuple[SyncCounter, CollectiveCounter]]:
    """Both counters, entered together: ``with counting() as (syncs, collectives): ...``."""
    with CollectiveCounter() as collectives, SyncCounter() as syncs:
        yield syncs, collectives


# ----------------------------------------------------------------------------- contenders

CONFIGS = {
    "hand": "hand-written loop",
    "bare": "bare Trainer",
    "handlers": "Trainer + StepScheduler, AsyncCheckpointer, NaNDetector, MetricsTracker",
}
#: (extra host syncs per step over the hand-written loop, small collectives per step) at most.
BUDGETS = {"bare": (0.0, 1.0), "handlers": (1.0, 2.0)}
CLIP = 1.0
TAIL = 2  # steps after the counted ones, so the run's final save falls outside
FAR = 10**6  # a cadence no measured run reaches


class _Window:
    """Stamps the end of every step and counts between the end of step ``first - 1`` and the end
    of step ``last`` (whole step cycles, data fetching included)."""

    # A measuring instrument must not change what it measures: attached at STEP_END, it asks for
    # nothing, so the trainer needs no end-of-step agreement on its account.
    asks_after_agreement = False

    def __init__(self, first: int, last: int, count: bool) -> None:
        self.first, self.last = first, last
        self.settle: Callable[[], None] | None = None  # run once before the first measured step
        self.stamps: list[float] = []
        self._stack = contextlib.ExitStack() if count else None
        self.syncs: SyncCounter | None = None
        self.collectives: CollectiveCounter | None = None
        self.reads: HostReadCounter | None = None

    def trainer_step_end(self, engine: Any) -> None:
        self.step_end(engine.state.iteration)

    def step_end(self, step: int) -> None:
        if step == self.first - 1 and self.settle is not None:
            self.settle()
        if self.first - 1 <= step <= self.last:
            self.stamps.append(time.perf_counter())
        if self._stack is None:
            return
        if step == self.first - 1:
            self.syncs, self.collectives = self._stack.enter_context(counting())
            self.reads = self._stack.enter_context(HostReadCounter())
        elif step == self.last:
            self._stack.close()

    def result(self) -> dict:
        steps = self.last - self.first + 1
        if len(self.stamps) != steps + 1:
            raise RuntimeError(f"saw {len(self.stamps) - 1} of the {steps} measured step ends")
        out: dict[str, Any] = {"step_s": [b - a for a, b in zip(self.stamps, self.stamps[1:])]}
        if self.syncs is not None and self.collectives is not None:
            out["syncs"] = {k: v / steps for k, v in self.syncs.counts.items()}
            out["collectives"] = {k: v / steps for k, v in self.collectives.counts.items()}
            out["sync_sites"] = {k: v / steps for k, v in self.syncs.sites.items()}
            out["collective_sites"] = {k: v / steps for k, v in self.collectives.sites.items()}
        if self.reads is not None:
            out["reads"] = {k: v / steps for k, v in self.reads.counts.items()}
            out["read_sites"] = {k: v / steps for k, v in self.reads.sites.items()}
        return out


def _setup(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = tiny_gpt(0)
    if world > 1:
        from hookloop.engine import wrap_data_parallel

        model = wrap_data_parallel(model, "ddp")
    # fused: step counters stay tensors (no host read of them), and the NaN detector's skip is
    # decided on the device through its found_inf (trainer.skips_on_device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _rank_data(rank: int, world: int, steps: int) -> list:
    """This rank's ``steps * ACCUM`` microbatches (each rank its own slice of one stream)."""
    per_rank = steps * ACCUM
    return token_microbatches(steps * world)[rank * per_rank : (rank + 1) * per_rank]


def _hand_written(world: int, data: list, total: int, window: _Window) -> None:
    from hookloop.models.gpt import cross_entropy_loss

    model, opt, sched = _setup(world)
    params = [p for p in model.parameters() if p.requires_grad]
    ddp = world > 1
    model.train()
    for step in range(1, total + 1):
        group = data[(step - 1) * ACCUM : step * ACCUM]
        for i, (x, y) in enumerate(group):
            with model.no_sync() if ddp and i < len(group) - 1 else contextlib.nullcontext():
                loss = cross_entropy_loss(model(x), y)
                (loss / len(group)).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window.step_end(step)


def _trainer(config: str, world: int, data: list, total: int, window: _Window, run_dir: Path) -> None:
    from hookloop.engine import Events, Priority, Trainer
    from hookloop.models.gpt import cross_entropy_loss

    model, opt, sched = _setup(world)
    trainer = Trainer(
        model,
        opt,
        cross_entropy_loss,
        lr_scheduler=sched,
        grad_accum_steps=ACCUM,
        grad_clip_norm=CLIP,
        run_dir=run_dir,
        graceful_sigint=False,
    )
    if config == "handlers":
        from hookloop.handlers import (
            AsyncCheckpointer,
            MetricsTracker,
            NaNDetector,
            StepScheduler,
            attach_handlers,
            load_run_config,
        )

        overrides = [
            f"train.local_batch_size={BATCH}",
            f"train.run_dir={run_dir}",
            f"step_scheduler.global_batch_size={BATCH * ACCUM * world}",
            f"step_scheduler.max_steps={total}",
            "step_scheduler.num_epochs=null",
            f"step_scheduler.ckpt_every_steps={FAR}",
            "step_scheduler.val_every_steps=null",
            f"logging.log_interval={FAR}",
            "checkpoint.mode=async",
            "checkpoint.resume=null",
        ]
        cfg = load_run_config(None, overrides, world_size=world)
        attached = attach_handlers(
            trainer,
            cfg,
            order=[StepScheduler, AsyncCheckpointer, NaNDetector, MetricsTracker],
            dataloader=data,
            dp_size=world,
            flops_per_token=tiny_gpt(0).flops_per_token(),
        )
        if trainer.grad_accum_steps != ACCUM:
            raise RuntimeError(
                f"the scheduler chose {trainer.grad_accum_steps} microbatches a step, not {ACCUM}"
            )
        # The initial checkpoint (kept for a NaN rollback) is written in the background and published
        # at a later step's end, whenever every rank has finished writing it: publish it before
        # counting, so the measured steps hold no checkpoint work.
        window.settle = next(h for h in attached if isinstance(h, AsyncCheckpointer)).wait
    trainer.add_event_handler(Events.STEP_END, window.trainer_step_end, priority=Priority.ENGINE_LAST)
    trainer.run(data, max_steps=total)
    if trainer.state.iteration != total:
        raise RuntimeError(f"the run stopped at step {trainer.state.iteration} of {total}")


def run_config(
    config: str, *, rank: int, world: int, warmup: int, steps: int, count: bool, run_dir: Path
) -> dict:
    """One run of ``config`` (a key of :data:`CONFIGS`) on this rank: per-step times of the
    measured steps and, with ``count``, syncs and collectives per step by kind."""
    total = warmup + steps + TAIL
    data = _rank_data(rank, world, total)
    window = _Window(warmup + 1, warmup + steps, count)
    if config == "hand":
        _hand_written(world, data, total, window)
    elif config in CONFIGS:
        _trainer(config, world, data, total, window, run_dir)
    else:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
    return window.result()


def measure_rank(
    rank: int, world: int, configs: list[str], warmup: int, steps: int, repeats: int, base_dir: str
) -> dict:
    """Every config on this rank: one counting run, then ``repeats`` timing rounds (the configs
    alternate within a round). Returns ``{config: {"syncs", "collectives", "step_ms"}}`` with
    ``step_ms`` the median step time of each round. ``world > 1`` joins the process group."""
    torch.set_num_threads(1)
    if world > 1:
        from hookloop.engine import init_distributed

        init_distributed("gloo")
    out: dict[str, dict] = {}
    run = 0

    def one(config: str, count: bool) -> dict:
        nonlocal run
        run += 1
        run_dir = Path(base_dir) / f"{config}-{run}"
        return run_config(
            config, rank=rank, world=world, warmup=warmup, steps=steps, count=count, run_dir=run_dir
        )

    for config in configs:
        counted = one(config, True)
        out[config] = {key: counted[key] for key in _COUNTED} | {"step_ms": []}
    for _ in range(repeats):
        for config in configs:
            out[config]["step_ms"].append(statistics.median(one(config, False)["step_s"]) * 1e3)
    return out


_COUNTED = ("syncs", "collectives", "reads", "sync_sites", "collective_sites", "read_sites")


def merge_ranks(per_rank: list[dict]) -> dict:
    """Per config, the largest count over ranks of every kind/function and the per-round times of
    the slowest rank; plus the totals and the extra syncs over the hand-written loop."""
    merged: dict[str, dict] = {}
    for config in per_rank[0]:
        entry: dict[str, Any] = {}
        for key in _COUNTED:
            names = sorted({n for r in per_rank for n in r[config][key]})
            entry[key] = {n: max(r[config][key].get(n, 0.0) for r in per_rank) for n in names}
            if key in ("syncs", "collectives", "reads"):
                entry[f"{key}_per_step"] = max(sum(r[config][key].values()) for r in per_rank)
        rounds = zip(*(r[config]["step_ms"] for r in per_rank))
        entry["step_ms"] = [max(times) for times in rounds]
        merged[config] = entry
    if "hand" in merged:
        for entry in merged.values():
            entry["extra_syncs_per_step"] = entry["syncs_per_step"] - merged["hand"]["syncs_per_step"]
    return merged


def measure(
    world: int, configs: list[str], warmup: int, steps: int, repeats: int, timeout: float = 600.0
) -> dict:
    """:func:`measure_rank` on ``world`` gloo ranks (or in this process when ``world`` is 1),
    merged over ranks."""
    with tempfile.TemporaryDirectory(prefix="step_budget-") as base:
        if world == 1:
            per_rank = [measure_rank(0, 1, configs, warmup, steps, repeats, base)]
        else:
            # by its package name, so spawned ranks import it also when this file runs as a script
            from benchmarks.step_budget import measure_rank as target

            per_rank = run_ranks(target, world, configs, warmup, steps, repeats, base, timeout=timeout)
    return merge_ranks(per_rank)


# ----------------------------------------------------------------------------- report


def _ratio(entry: dict, hand: dict) -> float | None:
    pairs = [t / b for t, b in zip(entry["step_ms"], hand["step_ms"])]
    return statistics.median(pairs) if pairs else None


def report(results: dict[int, dict]) -> tuple[list[str], list[dict]]:
    """The printed tables and the figures for ``benchmarks/run.py``."""
    lines = [
        f"{'configuration':74s} {'ranks':>5s} {'syncs/step':>10s} {'extra':>6s} "
        f"{'collectives/step':>16s} {'reads/step':>10s} {'step ms':>8s} {'ratio':>6s}"
    ]
    figures: list[dict] = []
    for world, merged in results.items():
        hand = merged["hand"]
        for config, entry in merged.items():
            ratio = _ratio(entry, hand)
            step_ms = statistics.median(entry["step_ms"]) if entry["step_ms"] else None
            lines.append(
                f"{CONFIGS[config]:74s} {world:5d} {entry['syncs_per_step']:10.2f} "
                f"{entry['extra_syncs_per_step']:+6.2f} "
                f"{entry['collectives_per_step'] if world > 1 else 0:16.2f} "
                f"{entry['reads_per_step']:10.2f} "
                f"{'-' if step_ms is None else f'{step_ms:.2f}':>8s} "
                f"{'-' if ratio is None else f'{ratio:.3f}':>6s}"
            )
            if config == "hand":
                continue
            who = "bare Trainer" if config == "bare" else "Trainer + 4 handlers"
            label = f"{who}, {world} rank{'s' * (world > 1)}"
            budget_syncs, budget_coll = BUDGETS[config]
            figures.append(
                {
                    "figure": f"host syncs per step, {label} vs hand-written loop",
                    "hookloop": entry["syncs_per_step"],
                    "reference": hand["syncs_per_step"],
                    "ratio": None,
                    "target": f"<= reference + {budget_syncs:g}",
                    "met": entry["extra_syncs_per_step"] <= budget_syncs,
                    "unit": "",
                }
            )
            # the bare trainer and the default handlers alike: nothing read on such a step
            figures.append(
                {
                    "figure": f"reads of step tensors to the host per step, {label}",
                    "hookloop": entry["reads_per_step"],
                    "reference": hand["reads_per_step"],
                    "ratio": None,
                    "target": "0",
                    "met": entry["reads_per_step"] == 0,
                    "unit": "",
                }
            )
            if world > 1:
                figures.append(
                    {
                        "figure": f"small collectives per step, {label} (hand-written loop: reference)",
                        "hookloop": entry["collectives_per_step"],
                        "reference": hand["collectives_per_step"],
                        "ratio": None,
                        "target": f"<= {budget_coll:g}",
                        "met": entry["collectives_per_step"] <= budget_coll,
                        "unit": "",
                    }
                )
            if ratio is not None:
                figures.append(
                    {
                        "figure": f"step time, {label} vs hand-written loop",
                        "hookloop": step_ms,
                        "reference": statistics.median(hand["step_ms"]),
                        "ratio": ratio,
                        "target": None,
                        "met": None,
                        "unit": "ms",
                    }
                )
    for world, merged in results.items():
        for key, title in (
            ("syncs", "host syncs"),
            ("collectives", "collectives"),
            ("reads", "reads of step tensors to the host"),
            ("sync_sites", "host syncs"),
            ("collective_sites", "collectives"),
            ("read_sites", "reads of step tensors to the host"),
        ):
            by = "where" if key.endswith("sites") else "kind"
            if key.startswith("collective") and world == 1:
                continue
            lines += ["", f"{title} per step by {by}, {world} rank{'s' * (world > 1)}:"]
            for config, entry in merged.items():
                counts = entry[key]
                if by == "kind":
                    parts = ", ".join(f"{n} {counts[n]:.2f}" for n in sorted(counts)) or "none"
                    lines.append(f"  {CONFIGS[config]}: {parts}")
                    continue
                lines.append(f"  {CONFIGS[config]}:{'' if counts else ' none'}")
                lines += [f"    {counts[n]:6.2f}  {n}" for n in sorted(counts, key=lambda n: (-counts[n], n))]
    return lines, figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2, help="steps before counting starts")
    parser.add_argument("--steps", type=int, default=10, help="steps counted and timed per run")
    parser.add_argument("--repeats", type=int, default=5, help="timing rounds per configuration")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 4, 1
    for name in ("warmup", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.repeats < 0:
        parser.error(f"--repeats must be >= 0, got {args.repeats}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    configs = list(CONFIGS)
    results = {world: measure(world, configs, args.warmup, args.steps, args.repeats) for world in (2, 1)}
    lines, figures = report(results)
    print("\n".join(lines))
    print(
        f"\ncounted over steps {args.warmup + 1}..{args.warmup + args.steps} (no log, validation or "
        f"checkpoint); step times: median per run, {args.repeats} rounds, ratio per round then median; "
        "2 ranks: DDP over gloo, one thread each"
    )
    result = {
        "benchmark": "step_budget",
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": {str(world): merged for world, merged in results.items()},
        "figures": figures,
        "notes": (
            "Host syncs (scalar reads, device-to-host copies), reads of step tensors to the host and "
            "Python-level collectives per step on steps with no logging, validation or checkpoint; "
            "DDP's gradient buckets are not counted."
        ),
    }
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
