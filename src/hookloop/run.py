"""A run wired from its config: :func:`build` makes everything ``hookloop train`` trains with, and
:class:`Run` holds it, ready to inspect, extend with hooks, and run.

::

    from hookloop.train import build, load_training_config

    cfg = load_training_config("my_run.yaml")
    with build(cfg, handlers=[MyHook()]) as run:     # nothing has trained yet
        run.trainer.on(Events.STEP_END(every=50))(lambda: print(run.trainer.state.loss))
        exit_code = run.run()                         # the lifecycle of `hookloop train`

The order is the one ``hookloop train`` has always had: the data (before any process group, so a
data factory's error costs nothing), the process group and device mesh, the run directory's lock
(:mod:`engine.run_lock`: one run per directory, refused at once when another live run holds it),
the model (tensor parallel, activation checkpointing, compile, then the pipeline split or the
data-parallel wrapper), the optimizer and LR schedule, the trainer, the shipped handlers the config
enables, the config's ``handlers:`` entries, then the ``handlers`` given here.

Nothing is written to the run directory until the run has started from its resolved state
(``Events.RUN_STARTED``: the resume at TRAIN_START succeeded and every rank agreed): ``config.yaml``
is written then, and a start refused before that (exit code 2) leaves every file as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop import threads
from hookloop.engine import (
    ConfigError,
    Events,
    ExitCode,
    StartRefused,
    Trainer,
    TrainingAborted,
    init_distributed,
    wrap_data_parallel,
)
from hookloop.engine.activation_checkpointing import apply_activation_checkpointing
from hookloop.engine.compile import compile_mode, compile_model
from hookloop.engine.fault_tolerance import group_dir_name, group_run_dir
from hookloop.engine.parallel import (
    DistInfo,
    destroy_distributed,
    leave_together,
    parallel_mesh,
    process_group_store,
)
from hookloop.engine.pipeline import PipelineConfig, build_pipeline
from hookloop.engine.run_lock import RunDirLock, hold_run_dir
from hookloop.engine.tensor_parallel import apply_tensor_parallel
from hookloop.engine.validation import build_metrics
from hookloop.first_step import attach_run_handlers, new_trainer
from hookloop.handlers import Places
from hookloop.handlers.replica_groups import ReplicaGroups, shared_settings
from hookloop.recipe import ResolvedModel
from hookloop.run_check import Checked, check
from hookloop.run_data import build_data
from hookloop.training_config import save_config

__all__ = ["Run", "build", "build_optimizer"]

logger = logging.getLogger("hookloop.train")


def build_optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer the ``optimizer`` section names, over ``model``'s parameters."""
    return cfg.optimizer.build(model.parameters())


@dataclasses.dataclass
class Run:
    """Everything a config's run trains with, built and attached, nothing run yet.

    ``trainer`` is the :class:`~engine.Trainer` (model wrapped for the layout, optimizer, LR
    schedule, shipped handlers and the given ones attached); ``model`` is the module it trains
    (DDP/FSDP2-wrapped, or this rank's pipeline stages); ``handlers`` are every attached handler in
    attach order. :meth:`run` trains with the lifecycle, exit codes and ``exit_status.json`` of
    ``hookloop train``. A run holds the process group: leave it with :meth:`close` (or use the run
    as a context manager).
    """

    config: Any
    trainer: Trainer
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    train_loader: Any
    val_loader: Any
    sampler: Any
    handlers: list[Any]
    resolved: ResolvedModel
    dist: DistInfo
    run_dir: Path
    dp_size: int
    dp_rank: int
    n_params: int  # of the whole model, before any split
    _start: list[int] = dataclasses.field(default_factory=lambda: [0], repr=False)
    #: The run directory's lock (rank 0; None elsewhere), held until :meth:`close`.
    lock: RunDirLock | None = dataclasses.field(default=None, repr=False)
    #: This process's replica group of a fault-tolerant run (``fault_tolerance``), else None.
    replica_groups: ReplicaGroups | None = None
    _agreed_end: bool = dataclasses.field(default=False, repr=False)

    def run(self) -> int:
        """Train to the config's end (or resume and finish); return the exit code
        (:class:`~engine.ExitCode`: 0 finished, 75 stopped and resumable, 76 NaN give-up, 77 lost
        peer, 2 a config error found while running, 130 a second Ctrl-C)."""
        trainer = self.trainer
        try:
            state = trainer.run(self.train_loader)
        except ConfigError as e:  # a setting only the running trainer can check (e.g. the data)
            if self.dist.is_main:
                print(f"config error: {e}", file=sys.stderr)
            return 2
        except StartRefused as e:  # another rank refused the start: rank 0 says its error, once
            if self.dist.is_main:
                print(e.error, file=sys.stderr)
            return e.exit_code
        except TrainingAborted as e:  # NaN give-up (76), failed health check or lost peer (77), ...
            print(f"stopped: {e} (exit code {e.exit_code}: {ExitCode(e.exit_code).name})", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:
            print("interrupted (second Ctrl-C); the last complete checkpoint is kept", file=sys.stderr)
            return 130
        code = int(trainer.control.exit_code)
        self._agreed_end = True  # every rank ended here, at the same step
        if self.dist.is_main:
            meaning = ExitCode(code).name if code in ExitCode._value2member_map_ else "set by a handler"
            trained = f"loss {state.loss:.4f}" if state.step > self._start[0] else "no step left to train"
            print(f"done: step {state.step}, {trained}, exit code {code} ({meaning})", flush=True)
        return code

    def close(self) -> None:
        """Release the run directory and leave the process group (after the checkpoints are drained:
        :meth:`run` drains them). A run that never started also removes the run directory its lock
        created, when nothing else is in it."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release(remove_created=not self.trainer.started)
        if self.replica_groups is not None:
            self.replica_groups.shutdown()
        store = process_group_store() if self._agreed_end and self.dist.world_size > 1 else None
        destroy_distributed()
        if store is not None:  # no rank exits (exit code 75 included) while another writes records
            leave_together(store, self.dist.world_size, min(30.0, self.config.distributed.timeout_s))

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_summary(run: Run) -> None:
    """The start-up summary, once the checkpointer has decided at TRAIN_START whether this run
    resumes (so it runs at a priority below ``Places.RESUME``)."""
    trainer, state, cfg = run.trainer, run.trainer.state, run.config
    healed = run.replica_groups.healed_from if run.replica_groups is not None else None
    if healed is not None:
        start = f"healed from replica group {healed[0]} (step {healed[1]})"
    elif state.iteration > 0 and state.last_checkpoint:
        start = f"resuming from {state.last_checkpoint} (step {state.iteration})"
    else:
        start = "fresh (step 0)"
    tp, pp = cfg.distributed.tp_size, cfg.distributed.pp_size
    logger.info("model: %s, %s parameters", run.resolved.target, f"{run.n_params:,}")
    logger.info(
        "world size %d (dp %d x tp %d x pp %d), precision %s",
        run.dist.world_size, run.dp_size, tp, pp, cfg.train.precision,
    )  # fmt: skip
    if run.replica_groups is not None:
        groups = run.replica_groups
        line = f"replica group {groups.group} of {groups.groups}, lighthouse {groups.lighthouse}"
        logger.info("fault tolerance: %s, min replicas %d", line, cfg.fault_tolerance.min_replicas)
    logger.info("threads: %s", threads.describe(torch.get_num_threads(), cfg.train.num_threads))
    logger.info("run directory: %s", trainer.run_dir)
    logger.info("start: %s", start)
    logger.info("handlers: %s", ", ".join(type(h).__name__ for h in trainer.handlers) or "none")


def build(cfg: Any, handlers: Sequence[Any] = (), *, checked: Checked | None = None) -> Run:
    """Build the run ``cfg`` (a :data:`~hookloop.train.TrainingConfig`) describes, with
    ``handlers`` (objects with ``attach(trainer)``) attached after the config's own; nothing is
    trained. Raises :class:`ConfigError` naming the field; a config error found here (by
    :func:`~hookloop.train.check`, the data or a handler's constructor) leaves no process group
    behind. ``checked`` is :func:`~hookloop.train.check`'s result, when the caller has it."""
    checked = checked or check(cfg)
    recipe = checked.model.recipe
    count = threads.chosen(cfg.train.num_threads)  # None: torch's own count, its waits passive
    if count is not None:
        torch.set_num_threads(count)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    pp, tp = cfg.distributed.pp_size, cfg.distributed.tp_size
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    # Data is sharded over data-parallel replicas; the pipeline stages and tensor-parallel ranks of
    # one replica share it. Built before the process group: a data error costs nothing.
    dp, dp_rank = world // (tp * pp), rank // (tp * pp)
    val_shard = (dp_rank, dp)
    run_dir = Path(cfg.train.run_dir)
    ft = cfg.fault_tolerance
    if ft.enabled:  # the training data is shared by every group's ranks; each validates on it all
        group = ft.group_id()
        dp, dp_rank = dp * ft.num_replica_groups, group * dp + dp_rank
        run_dir = group_run_dir(run_dir, group)
    data = build_data(cfg, dp_rank, dp, recipe.collate_fn, val_shard=val_shard)
    joined = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    info = init_distributed(
        cfg.distributed.backend, timeout_s=cfg.distributed.timeout_s, **parallel_mesh(world, tp, pp)
    )
    lock = None
    try:
        # One run per run directory: refused here, on every rank, before anything is built or written.
        lock = hold_run_dir(run_dir, field="train.run_dir")
        run = _build(cfg, checked, info, data, run_dir, dp, dp_rank, list(handlers))
    except BaseException:
        if lock is not None:
            lock.release(remove_created=True)
        if joined:  # a process group this build found (another run's, the caller's) stays
            destroy_distributed()
        raise
    run.lock = lock
    return run


def _build(
    cfg: Any, checked: Checked, info: DistInfo, data: Any, run_dir: Path, dp: int, dp_rank: int, extra: list
) -> Run:
    resolved, recipe = checked.model, checked.model.recipe
    pp, tp = cfg.distributed.pp_size, cfg.distributed.tp_size
    device = torch.device(cfg.train.device) if cfg.train.device else info.device
    model = resolved.build()
    flops_per_token = resolved.flops_per_token(model, cfg)  # of the whole model, before any split
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # Tensor parallelism (without a pipeline; each stage's part is parallelized after the split),
    # activation checkpointing, then compile, all in place (state-dict keys unchanged) and before
    # the pipeline split or the data-parallel wrapper, as torchtitan orders them.
    tp_mesh = info.mesh_dim("tp") if tp > 1 else None
    if tp_mesh is not None and pp == 1:
        apply_tensor_parallel(
            model,
            tp_mesh,
            recipe.tp_plan,
            sequence_parallel=cfg.distributed.sequence_parallel,
            loss_parallel=cfg.distributed.loss_parallel,
        )
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if compile_mode(cfg.train.compile) is not None:
        compile_model(model, cfg.train.compile)
    runtime = None
    if pp > 1:  # this rank's pipeline stages, wrapped for data parallel across replicas
        runtime = build_pipeline(
            model,
            PipelineConfig.from_section(cfg.pipeline),
            info,
            recipe.loss_fn,
            dp_mode=cfg.distributed.dp_mode,
            tp_plan=recipe.tp_plan,
            sequence_parallel=cfg.distributed.sequence_parallel,
        )
        model = runtime.module
    else:
        fsdp_precision = cfg.train.precision if cfg.distributed.dp_mode == "fsdp" else None
        dp_mesh = info.mesh_dim("dp") if tp_mesh is not None else info.mesh
        model = wrap_data_parallel(
            model, cfg.distributed.dp_mode, mesh=dp_mesh, mixed_precision=fsdp_precision
        )
    trainer = new_trainer(
        cfg,
        resolved,
        model,
        device=device,
        step_body=runtime,
        run_dir=run_dir,
        hang_timeout_s=cfg.distributed.hang_timeout_s,
        tp_mesh=tp_mesh,
        loss_parallel=cfg.distributed.loss_parallel,
    )
    groups = None
    sections = cfg
    if cfg.fault_tolerance.enabled:  # before the handlers: a resume restores its commit count
        groups = ReplicaGroups(cfg.fault_tolerance, shared_settings(cfg)).attach(trainer)
        if cfg.checkpoint.directory is not None:  # each group writes checkpoints of its own
            sections = copy.copy(cfg)
            directory = os.path.join(cfg.checkpoint.directory, group_dir_name(groups.group))
            sections.checkpoint = dataclasses.replace(cfg.checkpoint, directory=directory)
    attached = attach_run_handlers(
        trainer,
        sections,
        resolved,
        data,
        extra=extra,
        dp_size=dp,
        dp_rank=dp_rank,
        run_dir=run_dir,
        write_trace=info.rank % (tp * pp) == 0,  # one trace file per data-parallel rank
        flops_per_token=flops_per_token,
        dp_group=info.mesh_dim("dp") if tp * pp > 1 else None,  # the replicas of this rank's shard
    )
    if data.val is not None:
        trainer.set_validation(data.val, metrics=build_metrics(cfg.validation), dp_group=info.mesh_dim("dp"))
    run = Run(
        config=cfg,
        trainer=trainer,
        model=model,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.lr_scheduler,
        train_loader=data.train,
        val_loader=data.val,
        sampler=data.sampler,
        handlers=attached,
        resolved=resolved,
        dist=info,
        run_dir=run_dir,
        dp_size=dp,
        dp_rank=dp_rank,
        n_params=n_params,
        replica_groups=groups,
    )

    def note_start() -> None:  # the run has started (resumed, every rank agreed): now it is recorded
        run._start[0] = trainer.state.iteration
        if info.is_main:
            save_config(cfg, run_dir)
            _log_summary(run)

    trainer.add_event_handler(Events.RUN_STARTED, note_start, priority=Places.RESUME - 1)
    return run
