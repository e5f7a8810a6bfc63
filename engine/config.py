"""Run configuration: plain dataclasses, one section per concern.

Loaded from YAML or TOML, with dotted command-line overrides (``step_scheduler.max_steps=100``),
merged onto the dataclass defaults with OmegaConf, then validated as a whole by
:func:`validate_config` before any process group or model is built. Every error is a
:class:`~engine.errors.ConfigError` whose ``field`` is the dotted key at fault.

Sections: ``model`` (free-form, for the model builder), ``train``, ``optimizer``, ``lr``,
``distributed``, ``pipeline``, ``step_scheduler``, ``checkpoint``, ``nan``, ``data``,
``logging``, ``metrics``, ``profiling``, ``health``, ``straggler``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from engine.errors import ConfigError
from engine.lr import DECAY_STYLES, WSD_DECAY_STYLES

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "HealthConfig",
    "HookloopConfig",
    "LoggingConfig",
    "LRConfig",
    "MetricsConfig",
    "NaNConfig",
    "OptimizerConfig",
    "PhaseConfig",
    "PipelineSection",
    "ProfilingConfig",
    "StepSchedulerConfig",
    "StragglerConfig",
    "TrainConfig",
    "load_config",
    "validate_config",
]

# OmegaConf resolves annotations at run time, so sections spell Optional/Dict/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045


def _positive_int(name: str, value: Any, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a non-negative" if allow_zero else "a positive"
        extra = " or null" if allow_none else ""
        raise ConfigError(name, f"must be {what} integer{extra}, got {value!r}")


def _positive_float(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigError(
            name, f"must be a positive finite number{' or null' if allow_none else ''}, got {value!r}"
        )


def _one_of(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass
class TrainConfig:
    """What every run has: seed, batch shape, clipping, threads, where outputs go."""

    seed: int = 0
    local_batch_size: int = 8
    seq_len: int = 128
    grad_clip_norm: Optional[float] = 1.0
    deterministic: bool = False
    num_threads: Optional[int] = None
    run_dir: str = "runs/default"
    device: Optional[str] = None

    def validate(self, p: str = "train") -> None:
        _positive_int(f"{p}.local_batch_size", self.local_batch_size)
        _positive_int(f"{p}.seq_len", self.seq_len)
        _positive_float(f"{p}.grad_clip_norm", self.grad_clip_norm, allow_none=True)
        _positive_int(f"{p}.num_threads", self.num_threads, allow_none=True)
        if not self.run_dir:
            raise ConfigError(f"{p}.run_dir", "must be a directory path, got an empty string")


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.9

    def validate(self, p: str = "optimizer") -> None:
        _one_of(f"{p}.name", self.name, ("adamw", "adam", "sgd"))
        _positive_float(f"{p}.lr", self.lr)
        if self.weight_decay < 0:
            raise ConfigError(f"{p}.weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{p}.betas", f"must be two numbers in [0, 1), got {list(self.betas)!r}")
        _positive_float(f"{p}.eps", self.eps)


@dataclass
class LRConfig:
    """Warmup then decay; ``decay_steps`` defaults to the run's max steps."""

    warmup_steps: int = 0
    decay_steps: Optional[int] = None
    decay_style: str = "cosine"
    min_lr: float = 0.0
    warmup_init: float = 0.0
    wsd_decay_steps: Optional[int] = None
    wsd_decay_style: str = "exponential"

    def validate(self, p: str = "lr") -> None:
        _positive_int(f"{p}.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive_int(f"{p}.decay_steps", self.decay_steps, allow_none=True)
        _one_of(f"{p}.decay_style", self.decay_style, DECAY_STYLES)
        _one_of(f"{p}.wsd_decay_style", self.wsd_decay_style, WSD_DECAY_STYLES)
        if self.min_lr < 0:
            raise ConfigError(f"{p}.min_lr", f"must be >= 0, got {self.min_lr!r}")
        if self.warmup_init < 0:
            raise ConfigError(f"{p}.warmup_init", f"must be >= 0, got {self.warmup_init!r}")
        if self.decay_style == "WSD":
            _positive_int(f"{p}.wsd_decay_steps", self.wsd_decay_steps)


@dataclass
class DistributedConfig:
    backend: Optional[str] = None
    dp_mode: str = "ddp"
    pp_size: int = 1
    timeout_s: float = 600.0

    def validate(self, p: str = "distributed") -> None:
        if self.backend is not None:
            _one_of(f"{p}.backend", self.backend, ("gloo", "nccl"))
        _one_of(f"{p}.dp_mode", self.dp_mode, ("ddp", "fsdp", "none"))
        _positive_int(f"{p}.pp_size", self.pp_size)
        _positive_float(f"{p}.timeout_s", self.timeout_s)


@dataclass
class PipelineSection:
    """Pipeline-parallel settings (used when ``distributed.pp_size > 1``); see
    :class:`engine.pipeline.PipelineConfig`. Batch sizes left null follow the run's:
    ``pp_microbatch_size = train.local_batch_size`` and ``pp_batch_size =
    step_scheduler.global_batch_size // data-parallel size``."""

    pp_schedule: str = "1f1b"
    pp_schedule_csv: Optional[str] = None
    pp_microbatch_size: Optional[int] = None
    pp_batch_size: Optional[int] = None
    layers_per_stage: Optional[int] = None
    round_virtual_stages_to_pp_multiple: Optional[str] = None
    module_fqns_per_model_part: Optional[List[List[str]]] = None
    dtype: Optional[str] = None
    scale_grads_in_schedule: bool = False
    pp_seq_len: Optional[int] = None

    def validate(self, p: str = "pipeline", pp_size: Optional[int] = None) -> None:
        """Checked by :class:`engine.pipeline.PipelineConfig`; the schedule name or CSV file only
        when ``pp_size > 1`` (looking it up imports torch's pipelining, about two seconds)."""
        from engine.pipeline.config import PipelineConfig

        unset: dict = {}  # null batch sizes are filled in by validate_config; stand-ins that divide
        if self.pp_microbatch_size is None:
            unset["pp_microbatch_size"] = 1
        if self.pp_batch_size is None:
            unset["pp_batch_size"] = self.pp_microbatch_size or 1
        pipe = PipelineConfig.from_section(self, **unset)
        pipe.validate(p, pp_size=pp_size if pp_size and pp_size > 1 and not unset else None)


@dataclass
class StepSchedulerConfig:
    """When things happen; see :class:`handlers.StepScheduler` for the semantics."""

    global_batch_size: int = 32
    num_epochs: Optional[int] = 10
    max_steps: Optional[int] = None
    ckpt_every_steps: Optional[int] = 100
    save_checkpoint_every_epoch: bool = True
    val_every_steps: Optional[int] = None
    log_remote_every_steps: int = 1
    loss_average_window_steps: int = 50
    gc_every_steps: Optional[int] = None
    start_step: int = 0
    start_epoch: int = 0
    exit_duration_in_mins: Optional[float] = None
    exit_interval: Optional[int] = None
    stop_signals: List[str] = field(default_factory=lambda: ["SIGTERM"])

    def validate(self, p: str = "step_scheduler") -> None:
        _positive_int(f"{p}.global_batch_size", self.global_batch_size)
        _positive_int(f"{p}.num_epochs", self.num_epochs, allow_none=True)
        _positive_int(f"{p}.max_steps", self.max_steps, allow_none=True)
        _positive_int(f"{p}.ckpt_every_steps", self.ckpt_every_steps, allow_none=True)
        _positive_int(f"{p}.val_every_steps", self.val_every_steps, allow_none=True)
        _positive_int(f"{p}.log_remote_every_steps", self.log_remote_every_steps)
        _positive_int(f"{p}.loss_average_window_steps", self.loss_average_window_steps)
        _positive_int(f"{p}.gc_every_steps", self.gc_every_steps, allow_none=True)
        _positive_int(f"{p}.start_step", self.start_step, allow_zero=True)
        _positive_int(f"{p}.start_epoch", self.start_epoch, allow_zero=True)
        _positive_float(f"{p}.exit_duration_in_mins", self.exit_duration_in_mins, allow_none=True)
        _positive_int(f"{p}.exit_interval", self.exit_interval, allow_none=True)
        for sig in self.stop_signals:
            _one_of(f"{p}.stop_signals", sig, ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"))

    def build(self, dataloader: Any, dp_group_size: int, local_batch_size: int) -> Any:
        """The :class:`handlers.StepScheduler` these settings describe."""
        from handlers.step_scheduler import StepScheduler

        kwargs = dataclasses.asdict(self)
        return StepScheduler(
            local_batch_size=local_batch_size, dp_size=dp_group_size, dataloader=dataloader, **kwargs
        )


@dataclass
class CheckpointConfig:
    enabled: bool = True
    directory: Optional[str] = None
    every_steps: Optional[int] = None
    keep_last: int = 3
    mode: str = "async"
    resume: Optional[str] = "auto"
    load_optimizer: bool = True
    finetune_from: Optional[str] = None

    def validate(self, p: str = "checkpoint") -> None:
        _positive_int(f"{p}.every_steps", self.every_steps, allow_none=True)
        _positive_int(f"{p}.keep_last", self.keep_last)
        _one_of(f"{p}.mode", self.mode, ("sync", "async", "async_staged"))
        if self.finetune_from is not None and self.resume not in (None, "auto"):
            raise ConfigError(
                f"{p}.finetune_from", "cannot be combined with an explicit checkpoint.resume path"
            )


@dataclass
class NaNConfig:
    enabled: bool = True
    max_consecutive: int = 5
    check_grad_norm: bool = True
    action: str = "rollback"
    max_rollbacks: int = 3
    skip_data_on_rollback: bool = True
    spike_factor: Optional[float] = None
    spike_window: int = 100

    def validate(self, p: str = "nan") -> None:
        _positive_int(f"{p}.max_consecutive", self.max_consecutive)
        _one_of(f"{p}.action", self.action, ("warn", "raise", "rollback"))
        _positive_int(f"{p}.max_rollbacks", self.max_rollbacks, allow_zero=True)
        if self.spike_factor is not None and not self.spike_factor > 1:
            raise ConfigError(
                f"{p}.spike_factor", f"must be > 1 (a multiple of the median loss), got {self.spike_factor!r}"
            )
        _positive_int(f"{p}.spike_window", self.spike_window)


@dataclass
class PhaseConfig:
    start_step: int = 0
    dataset_weights: Dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0


@dataclass
class DataConfig:
    """Named datasets (a token file path, or ``stdlib_docs`` / ``stdlib_source``), their mixture
    weights, and an optional phase curriculum."""

    datasets: Dict[str, str] = field(default_factory=lambda: {"docs": "stdlib_docs"})
    weights: Dict[str, float] = field(default_factory=dict)
    mix_temperature: float = 1.0
    phases: List[PhaseConfig] = field(default_factory=list)
    cache_dir: str = "data"
    val_fraction: float = 0.02
    num_workers: int = 0

    def validate(self, p: str = "data") -> None:
        if not self.datasets:
            raise ConfigError(f"{p}.datasets", "must name at least one dataset")
        names = set(self.datasets)
        for name in self.weights:
            if name not in names:
                raise ConfigError(
                    f"{p}.weights.{name}", f"unknown dataset; known: {', '.join(sorted(names))}"
                )
        for name, w in self.weights.items():
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ConfigError(f"{p}.weights.{name}", f"must be a finite number >= 0, got {w!r}")
        if self.weights and sum(self.weights.get(n, 1.0) for n in names) <= 0:
            raise ConfigError(
                f"{p}.weights", "all weights are zero: give at least one dataset a positive weight"
            )
        _positive_float(f"{p}.mix_temperature", self.mix_temperature)
        last = -1
        for i, phase in enumerate(self.phases):
            q = f"{p}.phases[{i}]"
            _positive_int(f"{q}.start_step", phase.start_step, allow_zero=True)
            if phase.start_step <= last:
                raise ConfigError(
                    f"{q}.start_step",
                    f"must be larger than the previous phase's ({last}): phases are ordered",
                )
            last = phase.start_step
            for name, w in phase.dataset_weights.items():
                if name not in names:
                    raise ConfigError(
                        f"{q}.dataset_weights.{name}", f"unknown dataset; known: {', '.join(sorted(names))}"
                    )
                if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                    raise ConfigError(
                        f"{q}.dataset_weights.{name}", f"must be a finite number >= 0, got {w!r}"
                    )
            _positive_float(f"{q}.lr_scale", phase.lr_scale)
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"{p}.val_fraction", f"must be in [0, 1), got {self.val_fraction!r}")
        _positive_int(f"{p}.num_workers", self.num_workers, allow_zero=True)


@dataclass
class LoggingConfig:
    """Metric publication cadence and the loggers to attach (see ``docs/observability.md``).

    ``wandb_every_steps`` None: W&B follows ``step_scheduler.log_remote_every_steps``.
    ``progress_bar`` None: a bar on a terminal, plain lines otherwise.
    """

    log_interval: int = 10
    jsonl: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "hookloop"
    wandb_mode: Optional[str] = None
    wandb_every_steps: Optional[int] = None
    console: bool = True
    progress_bar: Optional[bool] = None

    def validate(self, p: str = "logging") -> None:
        _positive_int(f"{p}.log_interval", self.log_interval)
        if self.wandb_mode is not None:
            _one_of(f"{p}.wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))
        _positive_int(f"{p}.wandb_every_steps", self.wandb_every_steps, allow_none=True)


@dataclass
class MetricsConfig:
    flops_per_token: Optional[float] = None
    peak_flops_per_device: Optional[float] = None

    def validate(self, p: str = "metrics") -> None:
        _positive_float(f"{p}.flops_per_token", self.flops_per_token, allow_none=True)
        _positive_float(f"{p}.peak_flops_per_device", self.peak_flops_per_device, allow_none=True)


@dataclass
class ProfilingConfig:
    enabled: bool = False
    start_step: int = 5
    end_step: int = 8
    ranks: List[int] = field(default_factory=lambda: [0])
    output_dir: Optional[str] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def validate(self, p: str = "profiling") -> None:
        _positive_int(f"{p}.start_step", self.start_step)
        for r in self.ranks:
            _positive_int(f"{p}.ranks", r, allow_zero=True)
        if self.end_step <= self.start_step:
            raise ConfigError(
                f"{p}.end_step", f"must be larger than start_step ({self.start_step}), got {self.end_step}"
            )


@dataclass
class HealthConfig:
    enabled: bool = False
    every_steps: int = 100
    timeout_s: float = 60.0

    def validate(self, p: str = "health") -> None:
        _positive_int(f"{p}.every_steps", self.every_steps)
        _positive_float(f"{p}.timeout_s", self.timeout_s)


@dataclass
class StragglerConfig:
    enabled: bool = False
    every_steps: int = 100
    stop_threshold: Optional[float] = None

    def validate(self, p: str = "straggler") -> None:
        _positive_int(f"{p}.every_steps", self.every_steps)
        if self.stop_threshold is not None and not self.stop_threshold > 1:
            raise ConfigError(
                f"{p}.stop_threshold",
                f"must be > 1 (slowest / median step time), got {self.stop_threshold!r}",
            )


@dataclass
class HookloopConfig:
    model: Dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    step_scheduler: StepSchedulerConfig = field(default_factory=StepSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nan: NaNConfig = field(default_factory=NaNConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys users reach for that live in another section.
_MOVED = {
    "train.max_steps": "step_scheduler.max_steps",
    "train.max_epochs": "step_scheduler.num_epochs",
    "train.num_epochs": "step_scheduler.num_epochs",
    "train.global_batch_size": "step_scheduler.global_batch_size",
    "train.lr": "optimizer.lr",
    "distributed.dp_size": "the world size (torchrun --nproc-per-node) divided by distributed.pp_size",
}


def validate_config(cfg: HookloopConfig, world_size: int | None = None) -> HookloopConfig:
    """Check every section and the relations between them; raise :class:`ConfigError`.

    ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1 without torchrun), so batch
    divisibility is checked before any process group exists.
    """
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "validate"):
            section.validate(f.name)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    pp = cfg.distributed.pp_size
    if world % pp:
        raise ConfigError("distributed.pp_size", f"({pp}) must divide the world size ({world})")
    dp = world // pp
    if pp > 1:
        pipe = cfg.pipeline
        if pipe.pp_microbatch_size is None:
            pipe.pp_microbatch_size = cfg.train.local_batch_size
        if pipe.pp_batch_size is None:
            pipe.pp_batch_size = cfg.step_scheduler.global_batch_size // dp
        pipe.validate("pipeline", pp_size=pp)
        if cfg.train.local_batch_size != pipe.pp_microbatch_size:
            raise ConfigError(
                "train.local_batch_size",
                f"({cfg.train.local_batch_size}) must equal pipeline.pp_microbatch_size "
                f"({pipe.pp_microbatch_size}): each loader batch is one pipeline microbatch",
            )
        if cfg.step_scheduler.global_batch_size != pipe.pp_batch_size * dp:
            raise ConfigError(
                "step_scheduler.global_batch_size",
                f"({cfg.step_scheduler.global_batch_size}) must equal pipeline.pp_batch_size x "
                f"data-parallel size ({pipe.pp_batch_size} x {dp} = {pipe.pp_batch_size * dp})",
            )
    gbs, lbs = cfg.step_scheduler.global_batch_size, cfg.train.local_batch_size
    if pp == 1 and gbs % (lbs * dp):
        raise ConfigError(
            "step_scheduler.global_batch_size",
            f"({gbs}) must be a multiple of train.local_batch_size x data-parallel size "
            f"({lbs} x {dp} = {lbs * dp})",
        )
    sched = cfg.step_scheduler
    if (
        cfg.lr.decay_style in ("linear", "cosine", "WSD")
        and cfg.lr.decay_steps is None
        and sched.max_steps is None
    ):
        raise ConfigError(
            "lr.decay_steps",
            f"is needed for decay_style={cfg.lr.decay_style!r} unless step_scheduler.max_steps is set",
        )
    decay = cfg.lr.decay_steps or sched.max_steps
    if (
        decay is not None
        and cfg.lr.decay_style in ("linear", "cosine", "WSD")
        and decay <= cfg.lr.warmup_steps
    ):
        raise ConfigError(
            "lr.warmup_steps", f"({cfg.lr.warmup_steps}) must be smaller than the decay steps ({decay})"
        )
    if cfg.nan.enabled and cfg.nan.action == "rollback" and not cfg.checkpoint.enabled:
        raise ConfigError(
            "nan.action",
            "'rollback' restores the last checkpoint, but checkpoint.enabled is false: enable checkpoints "
            "or use nan.action=warn or raise",
        )
    if cfg.lr.min_lr > cfg.optimizer.lr:
        raise ConfigError("lr.min_lr", f"({cfg.lr.min_lr}) must not exceed optimizer.lr ({cfg.optimizer.lr})")
    return cfg


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
    schema: type = HookloopConfig,
) -> Any:
    """Load a YAML or TOML file onto the defaults, apply ``key=value`` overrides, validate.

    Raises :class:`ConfigError` naming the field for unknown keys, wrong types, missing files and
    inconsistent values.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        layers.append(OmegaConf.create(_read_file(Path(path))))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                item, "an override must look like section.key=value (e.g. step_scheduler.max_steps=100)"
            )
        key = item.split("=", 1)[0].strip()
        if key in _MOVED:
            raise ConfigError(key, f"is not a setting here; use {_MOVED[key]}")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(base, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        if key in _MOVED:
            raise ConfigError(key, f"is not a setting here; use {_MOVED[key]}") from None
        msg = str(e).splitlines()[0]
        raise ConfigError(str(key), f"{msg} (see the section's dataclass in engine/config.py)") from None
    return validate_config(cfg, world_size) if isinstance(cfg, HookloopConfig) else cfg


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            "config", f"file {str(path)!r} does not exist; pass the path of a .yaml or .toml file"
        )
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config", f"{path} is not valid TOML: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError("config", f"{path} is not valid YAML: {e}") from None
    else:
        raise ConfigError("config", f"{path}: use a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data
