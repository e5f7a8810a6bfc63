"""What ``hookloop train`` reads and checks: :data:`TrainingConfig` (every shipped section plus
``fault``), loading it, and :func:`check`, which finds every mistake it can before any process
group exists (``hookloop check``), ending with step 1 tried (:mod:`hookloop.first_step`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from hookloop.engine.data import check_model_vocab
from hookloop.engine.errors import ConfigError
from hookloop.engine.tensor_parallel import NO_PLAN_HINT
from hookloop.engine.validation import build_metrics
from hookloop.first_step import FirstStep, try_first_step
from hookloop.handlers import RunConfig, check_run_paths, compose_config, load_run_config
from hookloop.handlers.handler_entries import HandlerEntry, check_handler_entries
from hookloop.recipe import ResolvedModel, resolve_model
from hookloop.run_data import check_data

__all__ = [
    "Checked",
    "FaultConfig",
    "TrainingConfig",
    "check",
    "load_training_config",
    "report_config_error",
    "resolve_run_dir",
    "save_config",
]


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
    path: str | os.PathLike | None,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    world_size: int | None = None,
) -> Any:
    """A :data:`TrainingConfig` from a YAML/TOML file and dotted overrides, validated for
    ``world_size`` (default: torchrun's ``WORLD_SIZE``, else 1), with its run directory resolved."""
    cfg = load_run_config(path, overrides, schema=TrainingConfig, world_size=world_size)
    resolve_run_dir(cfg, path)
    return cfg


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
    error before any process group exists, and only rank 0 says it. The other ranks wait (at most
    :data:`CONFIG_ERROR_WAIT_S`) in the launcher's store until rank 0 has said it: a rank that
    exited first would have torchrun stop rank 0 before its line. A rank that waited in vain says
    the line itself, so it is never lost."""
    line = f"config error: {error}"
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)  # first: reaching the store may take its timeout
        store = _launcher_store()
        if store is not None:
            store.set(_SAID_KEY, "1")
        return
    store = _launcher_store()
    if store is None:
        return
    try:
        store.wait([_SAID_KEY], timedelta(seconds=CONFIG_ERROR_WAIT_S))
    except Exception:  # rank 0 did not say it in time (or is gone): say it here
        print(line, file=sys.stderr, flush=True)


CONFIG_ERROR_WAIT_S = 30.0
_SAID_KEY = "hookloop/config_error_said"


def _launcher_store() -> Any:
    """A client of torchrun's own store (its agent hosts one at ``MASTER_ADDR:MASTER_PORT`` for
    every attempt), or None outside torchrun, in one process, or when it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or os.environ.get("WORLD_SIZE", "1") == "1":
        return None
    try:
        return torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=CONFIG_ERROR_WAIT_S),
        )
    except Exception:
        return None


@dataclass(frozen=True)
class Checked:
    """What :func:`check` resolved: the model (its target, recipe and bound arguments), the
    config's own handler entries, and what trying step 1 found."""

    model: ResolvedModel
    handlers: tuple[HandlerEntry, ...] = ()
    first_step: FirstStep | None = None

    @property
    def target(self) -> str:
        return self.model.target

    @property
    def args(self) -> dict[str, Any]:
        return self.model.args


def check(cfg: Any, world_size: int | None = None) -> Checked:
    """Everything that can be checked before a process group exists, then step 1 tried for
    ``world_size`` processes (default: ``WORLD_SIZE``, else 1; :mod:`hookloop.first_step`). Raises
    :class:`ConfigError` naming the field; creates nothing."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = resolve_model(cfg)
    build_metrics(cfg.validation)  # each validation metric's target and arguments
    entries = check_handler_entries(cfg.handlers)
    check_run_paths(cfg)
    check_data(cfg)
    if cfg.data.target is None:  # token files say their vocabulary (docs/data.md, "Vocabulary")
        check_model_vocab(model.recipe.build, model.args, cfg.data.datasets)
    check_device(cfg)
    _check_layout(cfg, model)
    if callable(getattr(cfg, "check_ranked_metric", None)):
        cfg.check_ranked_metric([entry.factory for entry in entries])
    return Checked(model, tuple(entries), try_first_step(cfg, model, world_size))


def _check_layout(cfg: Any, model: ResolvedModel) -> None:
    if cfg.fault.nan_microbatches and model.recipe.loss_fn is None:
        raise ConfigError(
            "fault.nan_microbatches", "needs a loss_fn to poison: this model computes its own loss"
        )
    if cfg.train.compile is not False and cfg.distributed.pp_size > 1:
        raise ConfigError(
            "train.compile", "is not supported with distributed.pp_size > 1 yet; set train.compile=false"
        )
    if cfg.distributed.tp_size == 1:
        return
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


def save_config(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to ``<run_dir>/config.yaml`` (atomically: a reader never sees half
    a file), creating the run directory. ``hookloop train <run_dir>/config.yaml`` trains the same
    run again."""
    from omegaconf import OmegaConf

    from hookloop.engine.files import atomic_write

    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# The resolved config of this run: every field, defaults included.\n"
    atomic_write(path, header + OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path
