"""The run config: the engine's sections and every shipped handler's, composed into one dataclass.

    cfg = load_run_config("examples/configs/gpt_tiny.yaml", ["step_scheduler.max_steps=100"])

* :class:`RunConfig` has one field per section (``train``, ``optimizer``, ..., ``nan``, ``health``);
  each section is a dataclass with ``validate(prefix)``, defined beside the code it configures.
* :func:`load_run_config` reads YAML/TOML plus dotted overrides with the engine's loader and
  validates every section, then the relations between sections (:meth:`RunConfig.validate`).
* :func:`compose_config` adds a user's own sections, so a user's handler is configured, overridden
  and validated exactly like a shipped one.

The shipped handlers' sections come from :data:`handlers.shipped.SECTIONS`, generated from the
handler classes' declarations. Nothing here imports torch: a config is loaded, refused and printed
without it. Building and attaching the handlers is :mod:`handlers.order`'s (:func:`attach_handlers`).
"""

from __future__ import annotations

import dataclasses
import keyword
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List

from hookloop.engine.checkpoint_format.directory import resolve_checkpoint
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checks import grad_acc_steps_for
from hookloop.engine.config import (
    DataConfig,
    DistributedConfig,
    LRConfig,
    OptimizerConfig,
    PipelineSection,
    TrainConfig,
    ValidationConfig,
    check_lr_schedule,
    load_config,
    schedule_settings,
    validate_sections,
)
from hookloop.engine.errors import ConfigError
from hookloop.engine.fault_tolerance import FaultToleranceConfig, check_fault_tolerance
from hookloop.engine.files import check_writable_dir
from hookloop.handlers.shipped import SECTIONS

__all__ = [
    "RunConfig",
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
class EngineSections:
    """The engine's part of a run config: ``model`` (free-form, for the model builder) and the
    engine's sections. :class:`RunConfig` adds every shipped handler's section, ``handlers`` and the
    rules that relate sections."""

    model: Dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)


#: The shipped handlers' sections, in attach order (:data:`handlers.shipped.SECTIONS`, generated from
#: the handlers' declarations), less the engine's own.
ShippedSections = dataclasses.make_dataclass(
    "ShippedSections",
    [
        (name, schema, field(default_factory=schema))
        for name, schema in SECTIONS.items()
        if name not in {f.name for f in dataclasses.fields(EngineSections)}
    ],
    namespace={"__module__": __name__},
)


@dataclass
class RunConfig(ShippedSections, EngineSections):
    """A training run's whole configuration: ``model`` (free-form, for the model builder), the
    engine's sections, every shipped handler's section and ``handlers``. YAML keys and dotted
    overrides are ``<section>.<field>``."""

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
        (``checkpoint.metric``): what every section's ``produces(cfg)`` says (``validation``:
        ``val_loss`` and ``val_<name>``; ``metrics``: the loss figures; ...)."""
        out: set[str] = set()
        for f in dataclasses.fields(self):
            produces = getattr(getattr(self, f.name), "produces", None)
            if callable(produces):
                out.update(produces(self))
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
    sees the whole validated config for rules that relate it to other sections. A section ``base``
    already has, with the same dataclass, is left as it is (``base`` itself when none is new).
    """
    if not (isinstance(base, type) and dataclasses.is_dataclass(base)):
        raise TypeError(f"base must be a run config dataclass such as RunConfig, got {base!r}")
    if not sections:
        raise TypeError(
            "compose_config needs at least one section, e.g. compose_config(my_hook=MyHookConfig)"
        )
    taken = typing.get_type_hints(base)
    new_fields = []
    for section, schema in sections.items():
        if not section.isidentifier() or keyword.iskeyword(section):
            raise ValueError(f"section name {section!r} must be a Python identifier (it is a YAML key)")
        if taken.get(section) is schema:  # already there (a handler's section shipped since): nothing to add
            continue
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
    if not new_fields:
        return base
    cls_name = name or base.__name__ + "".join(s.title().replace("_", "") for s in sections)
    composed = dataclasses.make_dataclass(cls_name, new_fields, bases=(base,))
    composed.__doc__ = f"{base.__name__} plus the sections {', '.join(sections)}."
    return composed
