"""What every example training script shares: the command line, the config checks, the data, the
parallel set-up (DDP, FSDP2, pipeline stages), the Trainer with the full handler set, and the exits.

A script supplies a :class:`ModelRecipe` (its model, loss and batch layout) and calls :func:`run`:
``examples/train_gpt.py`` trains the examples' own GPT, ``examples/train_hf.py`` a Hugging Face
causal LM. The process exits with ``state.exit_code`` (see ``engine.ExitCode``); config errors exit
with 2 before any process group or model exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hookloop.engine import (  # noqa: E402
    ConfigError,
    Events,
    ExitCode,
    Priority,
    Trainer,
    TrainingAborted,
    build_lr_scheduler,
    init_distributed,
    setup_logging,
    wrap_data_parallel,
)
from hookloop.engine.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from hookloop.engine.compile import compile_mode, compile_model  # noqa: E402
from hookloop.engine.data import (  # noqa: E402
    MixtureDataset,
    MixtureLoader,
    MixtureSampler,
    TokenDataset,
    prepare_tokens,
    stdlib_docs_text,
    stdlib_source_files,
)
from hookloop.engine.parallel import destroy_distributed  # noqa: E402
from hookloop.engine.pipeline import PipelineConfig, build_pipeline  # noqa: E402
from hookloop.handlers import RunConfig, attach_handlers, check_run_paths, compose_config, load_run_config  # noqa: E402

__all__ = ["ModelRecipe", "resolve_run_dir", "run"]

BUILTIN_SOURCES = {"stdlib_docs", "stdlib_source"}

logger = logging.getLogger("hookloop.engine.examples.training")  # under "engine", which setup_logging shows


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


#: The examples' run config: every shipped section plus ``fault``.
ExampleConfig = compose_config(fault=FaultConfig)


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


def parse_args(
    argv: list[str] | None, default_config: Path, description: str
) -> tuple[Any, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, default=default_config, help="YAML or TOML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. step_scheduler.max_steps=50")
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config, args.overrides, schema=ExampleConfig)
    resolve_run_dir(cfg, args.config)
    return cfg, args


def resolve_run_dir(cfg: RunConfig, config_path: str | os.PathLike) -> Path:
    """``train.run_dir`` null becomes ``runs/<config file stem>`` (``runs/gpt_tiny``), so each
    config trains in its own directory; a set one is kept. Returns the run directory."""
    if cfg.train.run_dir is None:
        cfg.train.run_dir = str(Path("runs") / Path(config_path).stem)
    return Path(cfg.train.run_dir)


def log_summary(trainer: Trainer, *, n_params: int, world: int, dp: int, pp: int, precision: str) -> None:
    """The start-up summary, once the checkpointer has decided at TRAIN_START whether this run
    resumes (so run it at a priority below ``Priority.RESUME``)."""
    state = trainer.state
    if state.iteration > 0 and state.last_checkpoint:
        start = f"resuming from {state.last_checkpoint} (step {state.iteration})"
    else:
        start = "fresh (step 0)"
    handlers = ", ".join(type(h).__name__ for h in trainer.handlers) or "none"
    logger.info("parameters: %s", f"{n_params:,}")
    logger.info("world size %d (dp %d x pp %d), precision %s", world, dp, pp, precision)
    logger.info("run directory: %s", trainer.run_dir)
    logger.info("start: %s", start)
    logger.info("handlers: %s", handlers)


def check_data_files(cfg: RunConfig) -> None:
    """Every dataset that names a file must exist (the built-in corpora are made on first use)."""
    for name, source in cfg.data.datasets.items():
        if source not in BUILTIN_SOURCES and not Path(source).is_file():
            raise ConfigError(
                f"data.datasets.{name}",
                f"{source} is not a file; give a token file (python -m hookloop.engine.data prepare ...) or one of "
                f"{', '.join(sorted(BUILTIN_SOURCES))}",
            )


def check_device(cfg: RunConfig) -> None:
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


def build_data(cfg: RunConfig, rank: int, world: int, collate_fn: Callable | None = None):
    """Train loader over the weighted mixture (endless, resumable sampler) and a validation loader;
    ``collate_fn`` (default: torch's) turns a list of ``(input_ids, labels, source_idx)`` samples
    into one microbatch."""
    from torch.utils.data import DataLoader, Subset
    from torch.utils.data.distributed import DistributedSampler

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
    if val_parts:
        val_set = MixtureDataset(val_parts)
        val_sampler = (
            DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
        )
        val = DataLoader(
            val_set, batch_size=cfg.train.local_batch_size, sampler=val_sampler, collate_fn=collate_fn
        )
    return train, val, sampler


def build_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
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


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """What an example script brings to :func:`run`: its model and how it is trained.

    Args:
        description: the command line's ``--help`` text.
        default_config: the config file used without ``--config``.
        check: ``check(cfg)`` raises ``ConfigError``/``ValueError``/``TypeError`` for bad model
            settings, before any process group, data or model exists.
        build: ``build(cfg) -> (model, flops_per_token)`` for the whole (unsplit) model.
        loss_fn: the Trainer's ``loss_fn``; None: the model computes its own loss.
        collate_fn: turns a list of ``(input_ids, labels, source_idx)`` samples into a microbatch.
    """

    description: str
    default_config: Path
    check: Callable[[RunConfig], Any]
    build: Callable[[RunConfig], tuple[torch.nn.Module, float]]
    loss_fn: Callable | None
    collate_fn: Callable | None = None


def run(argv: list[str] | None, recipe: ModelRecipe) -> int:
    """Parse the command line, check the whole config, train, and return the exit code."""
    setup_logging()
    try:
        cfg, _ = parse_args(argv, recipe.default_config, recipe.description)
        # Everything that can be checked is checked before any process group or model exists:
        # model settings, directories, checkpoint paths, data files, the device.
        recipe.check(cfg)
        check_run_paths(cfg)
        check_data_files(cfg)
        check_device(cfg)
        if cfg.fault.nan_microbatches and recipe.loss_fn is None:
            raise ConfigError(
                "fault.nan_microbatches",
                "needs a loss_fn to poison: this model computes its own loss (loss_fn=None)",
            )
        if cfg.train.compile is not False and cfg.distributed.pp_size > 1:
            raise ConfigError(
                "train.compile", "is not supported with distributed.pp_size > 1 yet; set train.compile=false"
            )
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (TypeError, ValueError) as e:
        print(f"config error: model: {e}", file=sys.stderr)
        return 2
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    pp = cfg.distributed.pp_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = {"mesh_shape": (world // pp, pp), "mesh_dim_names": ("dp", "pp")} if pp > 1 else {}
    info = init_distributed(cfg.distributed.backend, timeout_s=cfg.distributed.timeout_s, **mesh)
    try:
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        run_dir = Path(cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # Data is sharded over data-parallel replicas; pipeline stages of one replica share it.
        dp, dp_rank = info.world_size // pp, info.rank // pp
        train_loader, val_loader, sampler = build_data(cfg, dp_rank, dp, recipe.collate_fn)

        device = torch.device(cfg.train.device) if cfg.train.device else info.device
        model, flops_per_token = recipe.build(cfg)  # FLOPs of the whole model, before any split
        model = model.to(device)
        n_params = sum(p.numel() for p in model.parameters())
        # Activation checkpointing, then compile, both in place (state-dict keys unchanged) and
        # before the pipeline split or the data-parallel wrapper, as torchtitan orders them.
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
            )
            model = runtime.module
        else:
            fsdp_precision = cfg.train.precision if cfg.distributed.dp_mode == "fsdp" else None
            model = wrap_data_parallel(
                model, cfg.distributed.dp_mode, mesh=info.mesh, mixed_precision=fsdp_precision
            )
        loss_fn = recipe.loss_fn
        if cfg.fault.nan_microbatches:  # the trainer exists by the time the first loss is computed
            loss_fn = nan_injecting_loss(loss_fn, set(cfg.fault.nan_microbatches), lambda: trainer.state)
        optimizer = build_optimizer(cfg, model)
        lr_scheduler = build_lr_scheduler(
            optimizer,
            warmup_steps=cfg.lr.warmup_steps,
            decay_steps=cfg.lr.decay_steps or cfg.step_scheduler.max_steps,
            decay_style=cfg.lr.decay_style,
            min_lr=cfg.lr.min_lr,
            warmup_init=cfg.lr.warmup_init,
            wsd_decay_steps=cfg.lr.wsd_decay_steps,
            wsd_decay_style=cfg.lr.wsd_decay_style,
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
        )
        # Every enabled handler, built from its section and attached in handlers.HANDLER_ORDER: the
        # step scheduler (accumulation, last step, validation/checkpoint cadence, stop signals), then
        # checkpoints (they resume at TRAIN_START before any other handler reads the state, and
        # answer the NaN detector's ROLLBACK; directory <run_dir>/checkpoints unless set), the NaN
        # detector, the phase curriculum and per-dataset loss/tokens (over the mixture sampler),
        # metrics (FLOPs per token of the whole model unless configured), loggers, profiler, health
        # and straggler checks.
        attach_handlers(
            trainer,
            cfg,
            dataloader=train_loader,
            dp_size=dp,
            sampler=sampler,
            run_dir=run_dir,
            flops_per_token=flops_per_token,
        )
        if val_loader is not None:
            trainer.set_validation(val_loader, eval_iters=8)
        start = [0]  # the step this process starts at, once the checkpointer has resumed

        def note_start() -> None:
            start[0] = trainer.state.iteration

        trainer.add_event_handler(Events.TRAIN_START, note_start, priority=Priority.RESUME - 1)
        if info.is_main:
            trainer.add_event_handler(
                Events.TRAIN_START,
                lambda: log_summary(
                    trainer,
                    n_params=n_params,
                    world=info.world_size,
                    dp=dp,
                    pp=pp,
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
    finally:
        destroy_distributed()
