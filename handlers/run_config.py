"""The run config: the engine's sections and every shipped handler's, composed into one dataclass.

    cfg = load_run_config("examples/configs/gpt_tiny.yaml", ["step_scheduler.max_steps=100"])
    handlers = attach_handlers(trainer, cfg, dataloader=loader, dp_size=dp, sampler=sampler)

* :class:`RunConfig` has one field per section (``train``, ``optimizer``, ..., ``nan``, ``health``);
  each section is a dataclass with ``validate(prefix)``, defined beside the code it configures.
* :func:`load_run_config` reads YAML/TOML plus dotted overrides with the engine's loader and
  validates every section, then the relations between sections (:meth:`RunConfig.validate`).
* :func:`compose_config` adds a user's own sections, so a user's handler is configured, overridden
  and validated exactly like a shipped one.
* :data:`HANDLER_ORDER` is the canonical attach order and :func:`attach_handlers` builds every
  enabled handler from its section (``cls.from_config(section, **runtime)``) and attaches it.
"""

from __future__ import annotations

import dataclasses
import keyword
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List

from hookloop.engine.checkpoint_format.directory import resolve_checkpoint
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.config import (
    DataConfig,
    DistributedConfig,
    LRConfig,
    OptimizerConfig,
    PipelineSection,
    TrainConfig,
    load_config,
    validate_sections,
)
from hookloop.engine.errors import ConfigError
from hookloop.engine.fault_tolerance import FaultToleranceConfig, check_fault_tolerance
from hookloop.engine.files import check_writable_dir
from hookloop.engine.lr import check_lr_schedule, schedule_settings
from hookloop.engine.run_limits import grad_acc_steps_for
from hookloop.engine.validation import ValidationConfig
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointConfig
from hookloop.handlers.console import ConsoleLogger
from hookloop.handlers.curriculum import PhaseCurriculum
from hookloop.handlers.dataset_metrics import DatasetMetricsConfig, PerDatasetMetrics
from hookloop.handlers.handler_entries import build_handler_entries, check_handler_entries, runtime_arguments
from hookloop.handlers.health_check import HealthCheck, HealthConfig
from hookloop.handlers.jsonl_logger import JSONLLogger
from hookloop.handlers.loggers import LoggingConfig
from hookloop.handlers.metrics import MetricsConfig, MetricsTracker
from hookloop.handlers.nan_detector import NaNConfig, NaNDetector
from hookloop.handlers.profiler import ProfilerWindow, ProfilingConfig
from hookloop.handlers.step_scheduler import StepScheduler, StepSchedulerConfig
from hookloop.handlers.straggler import StragglerConfig, StragglerDetector
from hookloop.handlers.tensorboard_logger import TensorBoardLogger
from hookloop.handlers.wandb_logger import WandBLogger

__all__ = [
    "HANDLER_ORDER",
    "RunConfig",
    "attach_handlers",
    "check_run_paths",
    "compose_config",
    "load_run_config",
    "validate_run_config",
]

# OmegaConf resolves annotations at run time, so sections spell Dict the old way.
# ruff: noqa: UP006, UP035

#: Where a run writes when ``train.run_dir`` is null and nothing derived one (the example derives
#: ``runs/<config file name>``).
DEFAULT_RUN_DIR = "runs/default"


def run_dir_of(cfg: Any) -> str:
    """The run directory of ``cfg``: ``train.run_dir``, or :data:`DEFAULT_RUN_DIR` when null."""
    return cfg.train.run_dir if cfg.train.run_dir is not None else DEFAULT_RUN_DIR


@dataclass
class RunConfig:
    """A training run's whole configuration: ``model`` (free-form, for the model builder), the
    engine's sections and every shipped handler's section. YAML keys and dotted overrides are
    ``<section>.<field>``."""

    model: Dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    step_scheduler: StepSchedulerConfig = field(default_factory=StepSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nan: NaNConfig = field(default_factory=NaNConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    dataset_metrics: DatasetMetricsConfig = field(default_factory=DatasetMetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    #: the run's own handlers: ``{target: module:attribute | path/file.py:attribute, <its arguments>}``
    #: entries, attached after the shipped ones (:mod:`handlers.handler_entries`)
    handlers: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def lr_decay_steps_default(self) -> int | None:
        """What a null ``lr.decay_steps`` stands for: the run's ``step_scheduler.max_steps`` (None
        while the step scheduler is off)."""
        return self.step_scheduler.max_steps if self.step_scheduler.enabled else None

    def validate(self, world_size: int | None = None) -> None:
        """The rules that relate sections (each section's own rules ran before). Fills in the
        pipeline batch sizes left null. ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1
        without torchrun), so batch divisibility is checked before any process group exists."""
        world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        check_entry_shapes(self.handlers)
        pp, tp = self.distributed.pp_size, self.distributed.tp_size
        if world % pp:
            raise ConfigError("distributed.pp_size", f"({pp}) must divide the world size ({world})")
        if world % (tp * pp):
            raise ConfigError(
                "distributed.tp_size",
                f"({tp}) x distributed.pp_size ({pp}) must divide the world size ({world}); the rest is "
                "the data-parallel size",
            )
        check_fault_tolerance(self, world)
        dp = world // (tp * pp)
        sched, lbs = self.step_scheduler, self.train.local_batch_size
        if pp > 1:
            pipe = self.pipeline
            if pipe.pp_microbatch_size is None:
                pipe.pp_microbatch_size = lbs
            if pipe.pp_batch_size is None:
                pipe.pp_batch_size = sched.global_batch_size // dp
            pipe.validate("pipeline", pp_size=pp)
            if lbs != pipe.pp_microbatch_size:
                raise ConfigError(
                    "train.local_batch_size",
                    f"({lbs}) must equal pipeline.pp_microbatch_size ({pipe.pp_microbatch_size}): each "
                    "loader batch is one pipeline microbatch",
                )
            if sched.enabled and sched.global_batch_size != pipe.pp_batch_size * dp:
                raise ConfigError(
                    "step_scheduler.global_batch_size",
                    f"({sched.global_batch_size}) must equal pipeline.pp_batch_size x data-parallel size "
                    f"({pipe.pp_batch_size} x {dp} = {pipe.pp_batch_size * dp})",
                )
        elif sched.enabled:
            grad_acc_steps_for(
                sched.global_batch_size,
                lbs,
                dp,
                field="step_scheduler.global_batch_size",
                local_field="train.local_batch_size",
            )
        check_lr_schedule(**schedule_settings(self))
        if self.nan.enabled and self.nan.action == "rollback" and not self.checkpoint.enabled:
            raise ConfigError(
                "nan.action",
                "'rollback' restores the last checkpoint, but checkpoint.enabled is false: enable "
                "checkpoints or use nan.action=warn or raise",
            )
        ckpt = self.checkpoint
        if ckpt.enabled and ckpt.keep_best:
            produced = self.produced_metrics()
            # The run's own handlers may publish it: check_ranked_metric decides once they resolve.
            if ckpt.metric not in produced and not self.handlers:
                why = ""
                if ckpt.metric.startswith("val_"):
                    why = (
                        f" ({ckpt.metric} needs validation: data.val_fraction > 0, validated every "
                        "step_scheduler.val_every_steps steps and at the last step"
                        + ("" if ckpt.metric == "val_loss" else ", and the metric in validation.metrics")
                        + ")"
                    )
                raise ConfigError(
                    "checkpoint.metric",
                    f"{ckpt.metric!r} is not a metric this run produces{why}; checkpoint.keep_best ranks "
                    f"by one of: {', '.join(sorted(produced))}",
                )

    def check_ranked_metric(self, publishers: Sequence[Any]) -> None:
        """``checkpoint.metric`` (with ``keep_best``) is produced by the shipped sections or
        declared by one of ``publishers`` (the factories of the ``handlers:`` entries) in its
        ``publishes`` attribute, a list of the ``state.metrics`` names it writes."""
        ckpt = self.checkpoint
        if not (ckpt.enabled and ckpt.keep_best) or ckpt.metric in self.produced_metrics():
            return
        declared = {name for factory in publishers for name in getattr(factory, "publishes", ())}
        if ckpt.metric not in declared:
            raise ConfigError(
                "checkpoint.metric",
                f"{ckpt.metric!r} is not a metric this run produces; checkpoint.keep_best ranks by one of: "
                f"{', '.join(sorted(self.produced_metrics() | declared))} (a handler of yours that writes "
                "state.metrics[name] says so with publishes = ('name',))",
            )

    def produced_metrics(self) -> set[str]:
        """The ``state.metrics`` entries this configuration publishes that can rank checkpoints
        (``checkpoint.metric``): validation loss and ``val_<name>`` of every validation metric,
        training loss figures, per-dataset losses."""
        out: set[str] = set()
        sched = self.step_scheduler
        if self.data.val_fraction > 0 and sched.enabled:
            out.add("val_loss")
            out.update(f"val_{name}" for name in self.validation.metrics)
        if self.metrics.enabled:
            out.update(("loss", "loss_avg", "grad_norm"))
        if sched.enabled:
            out.add("loss_avg")
        if self.dataset_metrics.enabled and self.data.target is None:
            out.update(f"loss/{name}" for name in self.data.datasets)
        return out


def check_entry_shapes(entries: Any) -> None:
    """The ``handlers:`` list's shape (a list of mappings, each with a ``target`` string), checked
    with the config; resolving the targets is :func:`handlers.handler_entries.check_handler_entries`."""
    if not isinstance(entries, list):
        raise ConfigError(
            "handlers", f"must be a list of {{target: ..., <arguments>}} entries, got {entries!r}"
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(
                f"handlers[{i}]", f"must be a mapping {{target: ..., <arguments>}}, got {entry!r}"
            )
        if not isinstance(entry.get("target"), str):
            raise ConfigError(
                f"handlers[{i}].target",
                f"must name the handler's class or factory (module:attribute or path/file.py:attribute), "
                f"got {entry.get('target')!r}",
            )


def check_run_paths(cfg: Any) -> None:
    """What the file system must offer before a run starts (call it before building a process
    group or a model): writable ``train.run_dir``, ``checkpoint.directory`` and ``data.cache_dir``;
    ``checkpoint.resume`` (unless ``auto`` or null) and ``checkpoint.finetune_from`` naming a complete
    checkpoint or a directory of checkpoints.
    Raises :class:`ConfigError` naming the field; nothing already saved is touched."""
    run_dir = run_dir_of(cfg)
    check_writable_dir("train.run_dir", run_dir)
    ckpt = getattr(cfg, "checkpoint", None)
    if ckpt is not None and ckpt.enabled:
        check_writable_dir("checkpoint.directory", ckpt.directory or os.path.join(run_dir, "checkpoints"))
        for name in ("resume", "finetune_from"):
            path = getattr(ckpt, name)
            if path in (None, "auto"):
                continue
            try:  # a complete checkpoint, or a directory of them (its newest one loads)
                resolve_checkpoint(path)
            except CheckpointError as e:
                raise ConfigError(f"checkpoint.{name}", str(e)) from None
    data = getattr(cfg, "data", None)
    if data is not None:
        check_writable_dir("data.cache_dir", data.cache_dir)


def validate_run_config(cfg: RunConfig, world_size: int | None = None) -> RunConfig:
    """Check every section of ``cfg`` and the relations between them; return ``cfg`` or raise
    :class:`ConfigError` naming the field. (``load_run_config`` already does this.)"""
    return validate_sections(cfg, world_size)


def load_run_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
    schema: type = RunConfig,
) -> Any:
    """Load a YAML or TOML file plus ``section.key=value`` overrides onto :class:`RunConfig` (or
    ``schema``, e.g. a :func:`compose_config` result) and validate it as a whole."""
    return load_config(path, overrides, schema=schema, world_size=world_size)


def compose_config(base: type = RunConfig, name: str | None = None, **sections: type) -> type:
    """A new run config dataclass: ``base``'s sections plus ``sections`` (``section name -> config
    dataclass``), e.g. ``compose_config(my_hook=MyHookConfig)``.

    A composed section loads from YAML and dotted overrides (``my_hook.every=5``) like a shipped
    one, and is validated with the whole config: its ``validate(prefix)`` (required) with the
    section name as prefix, then, if it defines one, its ``cross_check(cfg, prefix)`` hook, which
    sees the whole validated config for rules that relate it to other sections.
    """
    if not (isinstance(base, type) and dataclasses.is_dataclass(base)):
        raise TypeError(f"base must be a run config dataclass such as RunConfig, got {base!r}")
    if not sections:
        raise TypeError(
            "compose_config needs at least one section, e.g. compose_config(my_hook=MyHookConfig)"
        )
    taken = {f.name for f in dataclasses.fields(base)}
    new_fields = []
    for section, schema in sections.items():
        if not section.isidentifier() or keyword.iskeyword(section):
            raise ValueError(f"section name {section!r} must be a Python identifier (it is a YAML key)")
        if section in taken:
            raise ValueError(f"section {section!r} is already in {base.__name__}; give yours another name")
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            raise TypeError(
                f"section {section!r} must be a dataclass type (its fields are the settings), got {schema!r}"
            )
        if not callable(getattr(schema, "validate", None)):
            raise TypeError(
                f"section {section!r}: {schema.__name__} needs a validate(self, prefix) method holding "
                "its rules"
            )
        new_fields.append((section, schema, field(default_factory=schema)))
    cls_name = name or base.__name__ + "".join(s.title().replace("_", "") for s in sections)
    composed = dataclasses.make_dataclass(cls_name, new_fields, bases=(base,))
    composed.__doc__ = f"{base.__name__} plus the sections {', '.join(sections)}."
    return composed


#: The order :func:`attach_handlers` attaches handlers in. The step scheduler first (it sets the
#: trainer's length and accumulation); the checkpointer next (it resumes at TRAIN_START before any
#: other handler reads the state, and answers the NaN detector's ROLLBACK); then the NaN detector,
#: the curriculum, metrics, loggers, profiler, health check and straggler detector.
HANDLER_ORDER: list[type] = [
    StepScheduler,
    AsyncCheckpointer,
    NaNDetector,
    PhaseCurriculum,
    PerDatasetMetrics,
    MetricsTracker,
    JSONLLogger,
    TensorBoardLogger,
    WandBLogger,
    ConsoleLogger,
    ProfilerWindow,
    HealthCheck,
    StragglerDetector,
]


def attach_handlers(
    trainer: Any,
    cfg: Any,
    *,
    order: Sequence[type] | None = None,
    extra: Sequence[Any] = (),
    **runtime: Any,
) -> list:
    """Build every enabled handler of ``order`` (default :data:`HANDLER_ORDER`) from its section of
    ``cfg`` with ``cls.from_config(getattr(cfg, cls.section), **runtime)``, then the config's own
    ``handlers:`` entries (:mod:`handlers.handler_entries`), then attach them all in that order,
    followed by the ``extra`` handler objects; return the attached handlers. Everything is built
    before anything is attached, so a bad setting fails before the trainer is touched.

    ``runtime`` holds what a config file cannot (``dataloader``, ``dp_size``, ``sampler``,
    ``flops_per_token``, ...); ``run_dir``, ``local_batch_size``, ``log_interval``, ``config`` and
    ``trainer`` default to the run's. Each handler gets the runtime values its ``from_config`` (or
    factory) names (or, when it takes ``**runtime``, those its constructor names). A handler class
    whose section is composed in (:func:`compose_config`) joins with ``order=[*HANDLER_ORDER, MyHook]``.
    """
    runtime = {**_from_run_config(cfg), "trainer": trainer, **runtime}
    built: list[tuple[str, Any]] = []
    for cls in HANDLER_ORDER if order is None else order:
        section = getattr(cls, "section", None)
        if not isinstance(section, str) or not hasattr(cfg, section):
            raise ConfigError(
                section or cls.__name__,
                f"{cls.__name__}'s config section is not in {type(cfg).__name__}: add it with "
                f"compose_config({section or '<name>'}={cls.__name__}.Config) and set {cls.__name__}.section",
            )
        section_cfg = getattr(cfg, section)
        if getattr(section_cfg, "enabled", True) is False:
            continue
        if not callable(getattr(cls, "from_config", None)):
            raise TypeError(
                f"{cls.__name__} has no from_config(cfg, **runtime): subclass engine.handler.Handler "
                "or define it"
            )
        handler = cls.from_config(section_cfg, **runtime_arguments(cls, section_cfg, runtime))
        if handler is not None:
            built.append((section, handler))
    built += build_handler_entries(check_handler_entries(getattr(cfg, "handlers", None) or []), runtime)
    for i, handler in enumerate(extra):
        if not callable(getattr(handler, "attach", None)):
            raise TypeError(
                f"handlers[{i}] is a {type(handler).__name__}, which has no attach(trainer): pass hookloop "
                "Handlers or objects with attach(trainer)"
            )
        built.append((f"handlers[{i}] (passed in)", handler))
    for where, handler in built:
        attach_one(trainer, handler, where)
    return [handler for _, handler in built]


def attach_one(trainer: Any, handler: Any, where: str) -> None:
    """``handler.attach(trainer)``, then register it with the trainer if its ``attach`` did not (an
    ignite-style object), so a stateful one is checkpointed like a hookloop ``Handler``. What either
    raises (two stateful handlers claiming one checkpoint key, say) is a :class:`ConfigError`
    naming ``where``."""
    try:
        handler.attach(trainer)
        if handler not in trainer.handlers:
            trainer.register_handler(handler)
    except ConfigError:
        raise
    except Exception as e:
        if isinstance(e, ValueError) and "state key" in str(e):
            raise ConfigError(where, str(e)) from None
        raise ConfigError.caused_by(where, f"{type(handler).__name__}.attach(trainer) fails", e) from e


def _from_run_config(cfg: Any) -> dict[str, Any]:
    """Runtime values a run config already knows."""
    out: dict[str, Any] = {}
    train = getattr(cfg, "train", None)
    if train is not None:
        out["run_dir"] = run_dir_of(cfg)
        out["local_batch_size"] = train.local_batch_size
    if getattr(cfg, "logging", None) is not None:
        out["log_interval"] = cfg.logging.log_interval
    if dataclasses.is_dataclass(cfg):
        out["config"] = dataclasses.asdict(cfg)
    return out
