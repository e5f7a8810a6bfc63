"""Config-driven training: build the model a config names, its optimizer, data, parallel layout and
every shipped handler, train, and map the outcome to an exit code.

This is what ``hookloop train CONFIG [section.field=value ...]`` runs, under ``python``,
``python -m hookloop`` or ``torchrun --nproc-per-node N -m hookloop``. From Python::

    from hookloop.train import load_training_config, train
    cfg = load_training_config("my_run.yaml", ["step_scheduler.max_steps=100"])
    exit_code = train(cfg)

Everything that can be checked is checked (:func:`check`) before any process group, data or model
exists; a config error exits with 2 and one line naming the field. The run directory
(``train.run_dir``; null: ``runs/<config file stem>``) gets the resolved config as ``config.yaml``
beside the metrics and checkpoints, and a second run in it resumes. Exit codes are
:class:`hookloop.engine.ExitCode`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookloop.engine import (
    ConfigError,
    Events,
    ExitCode,
    Trainer,
    TrainingAborted,
    build_lr_scheduler,
    init_distributed,
    wrap_data_parallel,
)
from hookloop.engine.activation_checkpointing import apply_activation_checkpointing
from hookloop.engine.compile import compile_mode, compile_model
from hookloop.engine.data import (
    MixtureDataset,
    MixtureLoader,
    MixtureSampler,
    SampleTrace,
    TokenDataset,
    check_model_vocab,
    prepare_tokens,
    stdlib_docs_text,
    stdlib_source_files,
)
from hookloop.engine.parallel import destroy_distributed, parallel_mesh
from hookloop.engine.pipeline import PipelineConfig, build_pipeline
from hookloop.engine.tensor_parallel import NO_PLAN_HINT, apply_tensor_parallel
from hookloop.handlers import (
    Priority,
    RunConfig,
    attach_handlers,
    check_run_paths,
    compose_config,
    load_run_config,
)
from hookloop.recipe import ResolvedModel, resolve_model

__all__ = [
    "FaultConfig",
    "TrainingConfig",
    "build_data",
    "build_optimizer",
    "check",
    "load_training_config",
    "resolve_run_dir",
    "save_config",
    "train",
]

BUILTIN_SOURCES = {"stdlib_docs", "stdlib_source"}

logger = logging.getLogger(__name__)


@dataclass
class FaultConfig:
    """The ``fault`` section: faults injected on purpose, to watch recovery work. Each microbatch
    index in ``nan_microbatches`` (0-based over the whole run, ``state.microbatches_seen``, which a
    rollback never rewinds) gets a NaN training loss."""

    nan_microbatches: list[int] = field(default_factory=list)  # microbatches whose loss becomes NaN

    def validate(self, prefix: str = "fault") -> None:
        for i, index in enumerate(self.nan_microbatches):
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ConfigError(
                    f"{prefix}.nan_microbatches[{i}]", f"must be a microbatch index >= 0, got {index!r}"
                )

    def cross_check(self, cfg: RunConfig, prefix: str) -> None:
        if self.nan_microbatches and cfg.distributed.pp_size > 1:
            raise ConfigError(
                f"{prefix}.nan_microbatches",
                "is not supported with distributed.pp_size > 1 (the schedule computes the loss)",
            )


#: What ``hookloop train`` reads: every shipped section plus ``fault``.
TrainingConfig = compose_config(name="TrainingConfig", fault=FaultConfig)


def resolve_run_dir(cfg: Any, config_path: str | os.PathLike | None) -> Path:
    """``train.run_dir`` null becomes ``runs/<config file stem>`` (``runs/gpt_tiny``), so each
    config trains in its own directory; a set one is kept. Returns the run directory."""
    if cfg.train.run_dir is None:
        stem = Path(config_path).stem if config_path is not None else "default"
        cfg.train.run_dir = str(Path("runs") / stem)
    return Path(cfg.train.run_dir)


def load_training_config(
    path: str | os.PathLike | None, overrides: Sequence[str] = (), *, world_size: int | None = None
) -> Any:
    """A :data:`TrainingConfig` from a YAML/TOML file and dotted overrides, validated for
    ``world_size`` (default: torchrun's ``WORLD_SIZE``, else 1), with its run directory resolved."""
    cfg = load_run_config(path, overrides, schema=TrainingConfig, world_size=world_size)
    resolve_run_dir(cfg, path)
    return cfg


def check_data_files(cfg: Any) -> None:
    """Every dataset that names a file must exist (the built-in corpora are made on first use)."""
    for name, source in cfg.data.datasets.items():
        if source not in BUILTIN_SOURCES and not Path(source).is_file():
            raise ConfigError(
                f"data.datasets.{name}",
                f"{source} is not a file; give a token file (python -m hookloop.engine.data prepare ...) "
                f"or one of {', '.join(sorted(BUILTIN_SOURCES))}",
            )


def check_device(cfg: Any) -> None:
    """``train.device`` (null: the launcher's choice, CPU or this rank's GPU) must exist here."""
    device = cfg.train.device
    if device is None:
        return
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ConfigError(
            "train.device", f"{device!r} is not a device ({e}); use 'cpu', 'cuda' or null"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", f"{device!r} but no CUDA device is available; use 'cpu' or null")


def report_config_error(error: ConfigError) -> None:
    """One line on stderr, ``config error: <field>: ...``; under torchrun every rank finds the same
    error before any process group exists, and only rank 0 says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"config error: {error}", file=sys.stderr)


def check(cfg: Any) -> ResolvedModel:
    """Everything that can be checked before a process group exists: the model target and its
    arguments, directories, checkpoint paths, data files, the device, and what the layout
    supports. Raises :class:`ConfigError` naming the field; creates nothing."""
    model = resolve_model(cfg)
    check_run_paths(cfg)
    check_data_files(cfg)
    check_model_vocab(model.recipe.build, model.args, cfg.data.datasets)  # docs/data.md, "Vocabulary"
    check_device(cfg)
    if cfg.fault.nan_microbatches and model.recipe.loss_fn is None:
        raise ConfigError(
            "fault.nan_microbatches", "needs a loss_fn to poison: this model computes its own loss"
        )
    if cfg.train.compile is not False and cfg.distributed.pp_size > 1:
        raise ConfigError(
            "train.compile", "is not supported with distributed.pp_size > 1 yet; set train.compile=false"
        )
    if cfg.distributed.tp_size > 1:
        if model.recipe.tp_plan is None:
            raise ConfigError(
                "distributed.tp_size",
                f"model.target {model.target} has no tensor-parallel plan: {NO_PLAN_HINT}",
            )
        if cfg.train.compile is not False:
            raise ConfigError(
                "train.compile", "is not supported with distributed.tp_size > 1 yet; set train.compile=false"
            )
        if cfg.distributed.loss_parallel and cfg.distributed.pp_size > 1:
            raise ConfigError(
                "distributed.loss_parallel",
                "is not supported with distributed.pp_size > 1 (the schedule runs backward); set it to false",
            )
        if cfg.distributed.loss_parallel and model.recipe.loss_fn is None:
            raise ConfigError(
                "distributed.loss_parallel",
                f"needs a loss_fn (a cross entropy) to run on the sharded logits; model.target "
                f"{model.target} computes its own loss: set it to false",
            )
        if cfg.train.precision == "fp16-mixed":
            raise ConfigError(
                "train.precision",
                "'fp16-mixed' (loss scaling) is not supported with distributed.tp_size > 1 yet; "
                "use 'bf16-mixed' or 'fp32'",
            )
    return model


def token_file(source: str, cache_dir: Path) -> Path:
    """The token file for a dataset entry: a built-in corpus (tokenized once) or a path."""
    if source not in BUILTIN_SOURCES:
        return Path(source)
    path = cache_dir / f"{source}.u8"
    if not path.exists():  # every rank writes the same bytes; the write is an atomic rename
        cache_dir.mkdir(parents=True, exist_ok=True)
        docs = [stdlib_docs_text()] if source == "stdlib_docs" else stdlib_source_files()
        prepare_tokens(docs, path)
    return path


def validation_indices(total: int, n_samples: int, rank: int, world: int) -> range:
    """This data-parallel rank's share of the first ``n_samples`` of ``total`` validation samples:
    an equal contiguous shard, so every world size validates the same samples (the last
    ``n_samples % world`` are left out when the world size does not divide it)."""
    per_rank = min(n_samples, total) // world
    return range(rank * per_rank, (rank + 1) * per_rank)


def build_data(cfg: Any, rank: int, world: int, collate_fn: Callable | None = None):
    """Train loader over the weighted mixture (endless, resumable sampler) and a validation loader
    over ``data.val_samples`` held-out samples shared among the data-parallel ranks. ``collate_fn``
    (default: torch's) turns a list of ``(input_ids, labels, source_idx)`` samples into a microbatch."""
    from torch.utils.data import DataLoader, Subset

    train_parts, val_parts = {}, {}
    for name, source in cfg.data.datasets.items():
        ds = TokenDataset(token_file(source, Path(cfg.data.cache_dir)), cfg.train.seq_len)
        n_val = max(1, int(len(ds) * cfg.data.val_fraction)) if cfg.data.val_fraction > 0 else 0
        train_parts[name] = Subset(ds, range(len(ds) - n_val))
        if n_val:
            val_parts[name] = Subset(ds, range(len(ds) - n_val, len(ds)))
    mixture = MixtureDataset(train_parts)
    weights = {name: cfg.data.weights.get(name, 1.0) for name in train_parts}
    sampler = MixtureSampler(
        mixture,
        weights,
        temperature=cfg.data.mix_temperature,
        seed=cfg.train.seed,
        rank=rank,
        world_size=world,
    )
    # The loader's position is the sampler's right after the batches training received, also with
    # worker prefetch, so resume is exact and O(1).
    train = MixtureLoader(
        sampler, cfg.train.local_batch_size, num_workers=cfg.data.num_workers, collate_fn=collate_fn
    )
    val = None
    if val_parts and cfg.data.val_samples:
        val_set = MixtureDataset(val_parts)
        shard = Subset(val_set, validation_indices(len(val_set), cfg.data.val_samples, rank, world))
        # Pipeline stages take whole microbatches only: a partial last batch is dropped there.
        drop_last = cfg.distributed.pp_size > 1
        val = DataLoader(
            shard, batch_size=cfg.train.local_batch_size, collate_fn=collate_fn, drop_last=drop_last
        )
    return train, val, sampler


def build_optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def nan_injecting_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor], bad: set[int], state_of: Callable[[], Any]
) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` whose loss is NaN for the microbatches in ``bad`` (by ``microbatches_seen``,
    which is the running microbatch's 0-based index while its loss is computed)."""

    def loss(output: Any, targets: Any) -> torch.Tensor:
        value = loss_fn(output, targets)
        if torch.is_grad_enabled() and state_of().microbatches_seen in bad:  # training, not validation
            value = value * float("nan")
        return value

    return loss


def save_config(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to ``<run_dir>/config.yaml`` (atomically: a reader never sees half
    a file). ``hookloop train <run_dir>/config.yaml`` trains the same run again."""
    from omegaconf import OmegaConf

    from hookloop.engine.files import atomic_write

    path = Path(run_dir) / "config.yaml"
    header = "# The resolved config of this run: every field, defaults included.\n"
    atomic_write(path, header + OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path


def log_summary(
    trainer: Trainer, *, model: str, n_params: int, world: int, dp: int, pp: int, precision: str, tp: int = 1
) -> None:
    """The start-up summary, once the checkpointer has decided at TRAIN_START whether this run
    resumes (so run it at a priority below ``Priority.RESUME``)."""
    state = trainer.state
    if state.iteration > 0 and state.last_checkpoint:
        start = f"resuming from {state.last_checkpoint} (step {state.iteration})"
    else:
        start = "fresh (step 0)"
    handlers = ", ".join(type(h).__name__ for h in trainer.handlers) or "none"
    logger.info("model: %s, %s parameters", model, f"{n_params:,}")
    logger.info("world size %d (dp %d x tp %d x pp %d), precision %s", world, dp, tp, pp, precision)
    logger.info("run directory: %s", trainer.run_dir)
    logger.info("start: %s", start)
    logger.info("handlers: %s", handlers)


def train(cfg: Any, model: ResolvedModel | None = None) -> int:
    """Train what ``cfg`` (a :data:`TrainingConfig`, e.g. from :func:`load_training_config`) says;
    return the exit code. Config errors found here print one line and return 2 before any
    process group or model exists."""
    try:
        model = model or check(cfg)
    except ConfigError as e:
        report_config_error(e)
        return 2
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    pp, tp = cfg.distributed.pp_size, cfg.distributed.tp_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = parallel_mesh(world, tp, pp)
    info = init_distributed(cfg.distributed.backend, timeout_s=cfg.distributed.timeout_s, **mesh)
    try:
        return _train(cfg, model, info, pp)
    finally:
        destroy_distributed()


def _train(cfg: Any, resolved: ResolvedModel, info: Any, pp: int) -> int:
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        save_config(cfg, run_dir)
    recipe = resolved.recipe
    # Data is sharded over data-parallel replicas; the pipeline stages and tensor-parallel ranks of
    # one replica share it.
    tp = cfg.distributed.tp_size
    dp, dp_rank = info.world_size // (tp * pp), info.rank // (tp * pp)
    train_loader, val_loader, sampler = build_data(cfg, dp_rank, dp, recipe.collate_fn)

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
    loss_fn = recipe.loss_fn
    if cfg.fault.nan_microbatches:  # the trainer exists by the time the first loss is computed
        loss_fn = nan_injecting_loss(loss_fn, set(cfg.fault.nan_microbatches), lambda: trainer.state)
    optimizer = build_optimizer(cfg, model)
    lr_scheduler = build_lr_scheduler(
        optimizer,
        **dataclasses.asdict(cfg.lr),
        decay_steps_default=cfg.lr_decay_steps_default,
    )
    trainer = Trainer(
        model,
        optimizer,
        loss_fn,
        lr_scheduler=lr_scheduler,
        grad_clip_norm=cfg.train.grad_clip_norm,
        device=device,
        pipeline=runtime,
        run_dir=run_dir,
        hang_timeout_s=cfg.distributed.hang_timeout_s,
        precision=cfg.train.precision,
        tp_mesh=tp_mesh,
        loss_parallel=cfg.distributed.loss_parallel,
    )
    # Every enabled handler, built from its section and attached in handlers.HANDLER_ORDER: the step
    # scheduler (accumulation, last step, validation/checkpoint cadence, stop signals), then
    # checkpoints (they resume at TRAIN_START before any other handler reads the state, and answer
    # the NaN detector's ROLLBACK; directory <run_dir>/checkpoints unless set), the NaN detector, the
    # phase curriculum and per-dataset loss/tokens (over the mixture sampler), metrics (FLOPs per
    # token of the whole model unless configured), loggers, profiler, health and straggler checks.
    attach_handlers(
        trainer,
        cfg,
        dataloader=train_loader,
        dp_size=dp,
        sampler=sampler,
        run_dir=run_dir,
        flops_per_token=flops_per_token,
    )
    if cfg.data.trace_samples:  # one file per data-parallel rank, written by its first pipeline stage
        SampleTrace(run_dir, train_loader, rank=dp_rank, world_size=dp, write=info.rank % pp == 0).attach(
            trainer
        )
    if val_loader is not None:
        trainer.set_validation(val_loader)
    start = [0]  # the step this process starts at, once the checkpointer has resumed

    def note_start() -> None:
        start[0] = trainer.state.iteration

    trainer.add_event_handler(Events.TRAIN_START, note_start, priority=Priority.RESUME - 1)
    if info.is_main:
        trainer.add_event_handler(
            Events.TRAIN_START,
            lambda: log_summary(
                trainer,
                model=resolved.target,
                n_params=n_params,
                world=info.world_size,
                dp=dp,
                pp=pp,
                tp=tp,
                precision=cfg.train.precision,
            ),
            priority=Priority.RESUME - 1,
        )

    try:
        state = trainer.run(train_loader)
    except ConfigError as e:  # a setting only the running trainer can check (e.g. the data)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except TrainingAborted as e:  # NaN give-up (76), failed health check or lost peer (77), ...
        print(f"stopped: {e} (exit code {e.exit_code}: {ExitCode(e.exit_code).name})", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted (second Ctrl-C); the last complete checkpoint is kept", file=sys.stderr)
        return 130
    if info.is_main:
        code = int(state.exit_code)
        meaning = ExitCode(code).name if code in ExitCode._value2member_map_ else "set by a handler"
        trained = f"loss {state.loss:.4f}" if state.step > start[0] else "no step left to train"
        print(f"done: step {state.step}, {trained}, exit code {code} ({meaning})", flush=True)
    return int(state.exit_code)
