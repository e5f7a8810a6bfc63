"""Run configuration: the loader, and the engine's own sections.

A run config is a dataclass whose fields are *sections*, each a dataclass with a
``validate(prefix)`` method holding the only copy of its rules. The engine's sections live here
(``train``, ``optimizer``, ``lr``, ``distributed``, ``pipeline``, ``validation``), in
:mod:`engine.data.config` (``data``) and :mod:`engine.fault_tolerance`; each shipped handler's
section lives in ``hookloop.handlers.sections``, and the caller composes them all into one schema
and passes it to :func:`load_config`. Like every section, this module imports no torch: the names
the sections check against (precisions, compile and checkpointing modes, the LR rules) are defined
here, and the modules that apply them import them from here.

:func:`load_config` reads YAML or TOML, applies dotted command-line overrides
(``step_scheduler.max_steps=100``), merges them onto the schema's defaults with OmegaConf, then
validates the whole config (:func:`validate_sections`) before any process group or model is built.
Every error is a :class:`~engine.errors.ConfigError` whose ``field`` is the dotted key at fault.

This module never imports ``handlers``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from hookloop.engine.checks import check_bool, check_choice, check_int, check_number, check_str
from hookloop.engine.data.config import DataConfig, PhaseConfig
from hookloop.engine.errors import ConfigError
from hookloop.engine.targets import TARGET_HINT

__all__ = [
    "AC_MODES",
    "COMPILE_MODES",
    "DECAY_STYLES",
    "DataConfig",
    "DistributedConfig",
    "LRConfig",
    "OptimizerConfig",
    "PRECISIONS",
    "PhaseConfig",
    "PipelineSection",
    "TrainConfig",
    "ValidationConfig",
    "WSD_DECAY_STYLES",
    "check_lr_schedule",
    "compile_mode",
    "load_config",
    "schedule_settings",
    "validate_sections",
]

# OmegaConf resolves annotations at run time, so sections spell Optional/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045

#: ``train.activation_checkpointing``'s modes (:mod:`engine.activation_checkpointing`).
AC_MODES = ("none", "full", "selective")
#: ``train.compile``'s modes besides true and false (:mod:`engine.compile`).
COMPILE_MODES = ("blocks", "model")
#: The allowed precision names, in the order messages list them (:mod:`engine.precision`).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed")


def compile_mode(setting: Any, field: str = "train.compile") -> str | None:
    """The mode a ``train.compile`` setting asks for: ``False`` -> None, ``True`` -> "blocks",
    "blocks" or "model" as given; anything else is a :class:`ConfigError` naming ``field``."""
    if setting is False:
        return None
    if setting is True:
        return "blocks"
    if isinstance(setting, str) and setting in COMPILE_MODES:
        return setting
    raise ConfigError(field, f"must be false, true (= 'blocks'), 'blocks' or 'model', got {setting!r}")


@dataclass
class TrainConfig:
    """What every run has: seed, batch shape, clipping, threads, where outputs go.

    ``activation_checkpointing``: "none", "full" (every transformer block) or "selective" (every
    other block), see :mod:`engine.activation_checkpointing`. ``compile``: false, true (= "blocks"),
    "blocks" (each block compiled) or "model" (the whole module), see :mod:`engine.compile`."""

    seed: int = 0  # seeds torch, the data order and every rank's RNG
    local_batch_size: int = 8  # samples per microbatch on one rank
    seq_len: int = 128  # tokens per sample
    grad_clip_norm: Optional[float] = 1.0  # clip the total gradient norm to this; null: no clipping
    deterministic: bool = False  # torch's deterministic algorithms (bitwise-repeatable runs)
    num_threads: Optional[int] = None  # intra-op threads; null: OMP_NUM_THREADS or torch's (hookloop.threads)
    run_dir: Optional[str] = None  # null: runs/<config file stem> (hookloop train)
    device: Optional[str] = None  # cpu or cuda; null: this rank's GPU under CUDA, else cpu
    activation_checkpointing: str = "none"  # none, full (every block) or selective (every other)
    compile: Union[bool, str] = False  # false, true (= blocks), blocks (each block) or model
    precision: str = "fp32"  # fp32, bf16-mixed or fp16-mixed (autocast; fp16 with a grad scaler)

    def validate(self, prefix: str = "train") -> None:
        p = prefix
        check_int(f"{p}.seed", self.seed, low=0)
        check_int(f"{p}.local_batch_size", self.local_batch_size, hint="samples per microbatch on one rank")
        check_int(f"{p}.seq_len", self.seq_len)
        check_number(f"{p}.grad_clip_norm", self.grad_clip_norm, positive=True, allow_none=True)
        check_bool(f"{p}.deterministic", self.deterministic)
        check_int(f"{p}.num_threads", self.num_threads, allow_none=True)
        check_str(f"{p}.run_dir", self.run_dir, allow_none=True, what="a directory path")
        check_str(f"{p}.device", self.device, allow_none=True, what="a device name such as 'cpu' or 'cuda'")
        check_choice(f"{p}.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        compile_mode(self.compile, f"{p}.compile")
        check_choice(f"{p}.precision", self.precision, PRECISIONS)


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw, adam or sgd
    lr: float = 3e-4  # peak learning rate (the lr section shapes it over steps)
    weight_decay: float = 0.1  # decoupled for adamw, L2 for adam and sgd
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # adam/adamw: two numbers in [0, 1)
    eps: float = 1e-8  # adam/adamw denominator term
    momentum: float = 0.9  # sgd only

    def validate(self, prefix: str = "optimizer") -> None:
        p = prefix
        check_choice(f"{p}.name", self.name, ("adamw", "adam", "sgd"))
        check_number(f"{p}.lr", self.lr, positive=True)
        check_number(f"{p}.weight_decay", self.weight_decay, low=0)
        if not isinstance(self.betas, Sequence) or isinstance(self.betas, str) or len(self.betas) != 2:
            raise ConfigError(f"{p}.betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        for b in self.betas:
            check_number(f"{p}.betas", b, low=0, below=1, hint="two numbers, e.g. [0.9, 0.95]")
        check_number(f"{p}.eps", self.eps, positive=True)
        check_number(f"{p}.momentum", self.momentum, low=0)

    def build(self, params: Any) -> Any:
        """The torch optimizer this section names, over ``params``; ``lr`` is the rate the LR
        schedule peaks at (:func:`engine.lr.schedule_settings`)."""
        import torch

        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        cls = torch.optim.AdamW if self.name == "adamw" else torch.optim.Adam
        return cls(params, lr=self.lr, betas=tuple(self.betas), eps=self.eps, weight_decay=self.weight_decay)


DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential")
#: The styles that decay to ``min_lr`` at ``decay_steps`` (and so need it).
DECAYING_STYLES = ("linear", "cosine", "WSD")


def check_lr_schedule(
    *,
    peak_lr: float | None = None,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    decay_style: str = "cosine",
    min_lr: float = 0.0,
    warmup_init: float = 0.0,
    wsd_decay_steps: int | None = None,
    wsd_decay_style: str = "exponential",
    decay_steps_default: int | None = None,
    default_name: str = "",
    prefix: str = "lr",
) -> None:
    """The one copy of the learning-rate rules; raises :class:`ConfigError` naming the field.

    Each setting on its own (types, ranges, styles, ``wsd_decay_steps`` for WSD), then, with
    ``peak_lr`` known, the rules that relate them: ``min_lr`` at most the peak, a decaying style
    needs decay steps, the decay ends after warmup, the WSD decay fits after warmup.
    ``decay_steps_default`` stands in for a null ``decay_steps`` (a run's ``max_steps``, named
    ``default_name`` in messages). The ``lr`` config section checks the settings alone; the run
    config and :func:`build_lr_scheduler` check everything.
    """
    p = prefix
    check_int(f"{p}.warmup_steps", warmup_steps, low=0)
    check_int(f"{p}.decay_steps", decay_steps, allow_none=True)
    check_choice(f"{p}.decay_style", decay_style, DECAY_STYLES)
    check_choice(f"{p}.wsd_decay_style", wsd_decay_style, WSD_DECAY_STYLES)
    check_number(f"{p}.min_lr", min_lr, low=0)
    check_number(f"{p}.warmup_init", warmup_init, low=0)
    check_int(
        f"{p}.wsd_decay_steps",
        wsd_decay_steps,
        allow_none=decay_style != "WSD",
        hint="needed for decay_style=WSD",
    )
    if peak_lr is None:
        return
    check_number("optimizer.lr", peak_lr, positive=True)
    if min_lr > peak_lr:
        raise ConfigError(f"{p}.min_lr", f"({min_lr}) must not exceed optimizer.lr ({peak_lr})")
    if decay_style not in DECAYING_STYLES:
        return
    decay = decay_steps if decay_steps is not None else decay_steps_default
    if decay is None:
        unless = f" unless {default_name} is set" if default_name else " (e.g. max_steps)"
        raise ConfigError(f"{p}.decay_steps", f"is required for decay_style={decay_style!r}{unless}")
    if decay <= warmup_steps:
        # Blame the setting the user wrote: decay_steps, or warmup_steps when the decay follows a default.
        at_fault = f"{p}.decay_steps" if decay_steps is not None else f"{p}.warmup_steps"
        raise ConfigError(
            at_fault, f"{p}.warmup_steps ({warmup_steps}) must be smaller than the decay steps ({decay})"
        )
    if decay_style == "WSD":
        assert wsd_decay_steps is not None
        if wsd_decay_steps > decay - warmup_steps:
            raise ConfigError(
                f"{p}.wsd_decay_steps",
                f"({wsd_decay_steps}) must fit after warmup: at most decay_steps - warmup_steps "
                f"= {decay - warmup_steps}",
            )


def schedule_settings(cfg: Any) -> dict[str, Any]:
    """The schedule a run config asks for, as :func:`check_lr_schedule` and
    :func:`build_lr_scheduler` take it: ``optimizer.lr`` is the peak, the ``lr`` section shapes it,
    and ``step_scheduler.max_steps`` (``cfg.lr_decay_steps_default``) stands in for a null
    ``decay_steps``."""
    return {
        "peak_lr": cfg.optimizer.lr,
        **dataclasses.asdict(cfg.lr),
        "decay_steps_default": cfg.lr_decay_steps_default,
        "default_name": "step_scheduler.max_steps",
    }


@dataclass
class LRConfig:
    """Warmup then decay; ``decay_steps`` defaults to the run's max steps."""

    warmup_steps: int = 0  # linear warmup from warmup_init to optimizer.lr over this many steps
    decay_steps: Optional[int] = None  # the step the decay ends at (counted from step 0); null: max steps
    decay_style: str = "cosine"  # constant, linear, cosine, inverse-square-root or WSD
    min_lr: float = 0.0  # the learning rate decay ends at (absolute)
    warmup_init: float = 0.0  # the learning rate warmup starts from (absolute)
    wsd_decay_steps: Optional[int] = None  # WSD: length of the final decay phase (required for WSD)
    wsd_decay_style: str = "exponential"  # WSD decay phase: linear, cosine or exponential

    def validate(self, prefix: str = "lr") -> None:
        """The settings on their own; the run config checks them against ``optimizer.lr`` and
        ``step_scheduler.max_steps`` (both with :func:`engine.lr.check_lr_schedule`)."""
        check_lr_schedule(prefix=prefix, **dataclasses.asdict(self))


@dataclass
class DistributedConfig:
    """Process group and parallel layout. ``timeout_s``: the process group's own timeout for a
    collective. ``hang_timeout_s``: the trainer's progress watchdog ends the process with exit code
    77 (and a stack dump in the run directory) when the loop makes no progress this long; a health
    check with a smaller ``health.timeout_s`` tightens it; null disables the watchdog."""

    backend: Optional[str] = None  # gloo or nccl; null: nccl with CUDA, gloo otherwise
    dp_mode: str = "ddp"  # data parallelism over several ranks: ddp, fsdp (FSDP2) or none
    pp_size: int = 1  # pipeline stages (ranks per pipeline); must divide the world size
    tp_size: int = 1  # tensor-parallel ranks per model replica (tp_size x pp_size divides the world size)
    sequence_parallel: bool = False  # with tp_size > 1: split activations between blocks along positions
    loss_parallel: bool = False  # with tp_size > 1: cross entropy on vocabulary-sharded logits (no gather)
    timeout_s: float = 600.0  # the process group's timeout for one collective
    hang_timeout_s: Optional[float] = 1800.0  # no progress this long: exit 77 with a stack dump

    def validate(self, prefix: str = "distributed") -> None:
        p = prefix
        check_choice(f"{p}.backend", self.backend, ("gloo", "nccl"), allow_none=True)
        check_choice(f"{p}.dp_mode", self.dp_mode, ("ddp", "fsdp", "none"))
        check_int(f"{p}.pp_size", self.pp_size)
        check_int(f"{p}.tp_size", self.tp_size)
        check_bool(f"{p}.sequence_parallel", self.sequence_parallel)
        check_bool(f"{p}.loss_parallel", self.loss_parallel)
        if self.loss_parallel and self.tp_size == 1:
            raise ConfigError(f"{p}.loss_parallel", "needs distributed.tp_size > 1 (it shards the logits)")
        if self.sequence_parallel and self.tp_size == 1:
            raise ConfigError(
                f"{p}.sequence_parallel",
                "needs distributed.tp_size > 1 (it splits the tensor-parallel ranks' work)",
            )
        check_number(f"{p}.timeout_s", self.timeout_s, positive=True)
        check_number(f"{p}.hang_timeout_s", self.hang_timeout_s, positive=True, allow_none=True)


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
    patch_inner_model: bool = True
    patch_causal_lm_model: bool = True
    patch_stage_backward_maybe_with_nosync: bool = False
    dtype: Optional[str] = None
    scale_grads_in_schedule: bool = False
    pp_seq_len: Optional[int] = None

    def validate(self, prefix: str = "pipeline", pp_size: Optional[int] = None) -> None:
        """The rules are :meth:`engine.pipeline.PipelineConfig.validate`'s (the one copy). The
        schedule name or CSV file is checked only with ``pp_size > 1`` and both batch sizes known
        (looking a schedule up imports torch's pipelining, about two seconds)."""
        from hookloop.engine.pipeline.config import PipelineConfig

        # Null batch sizes are filled in by the run config's cross-section check; until then they
        # are stand-ins that pass (the other rules do not depend on them).
        for name in ("pp_microbatch_size", "pp_batch_size"):
            check_int(f"{prefix}.{name}", getattr(self, name), allow_none=True)
        unset: dict[str, int] = {}
        if self.pp_microbatch_size is None:
            unset["pp_microbatch_size"] = 1
        if self.pp_batch_size is None:
            unset["pp_batch_size"] = self.pp_microbatch_size or 1
        pipe = PipelineConfig.from_section(self, **unset)
        pipe.validate(prefix, pp_size=pp_size if pp_size and pp_size > 1 and not unset else None)


#: A validation metric's name (published as ``val_<name>``).
METRIC_NAME = re.compile(r"[A-Za-z0-9_]+")


def check_metric_name(name: Any, field_: str) -> None:
    if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
        raise ConfigError(
            field_, f"metric name {name!r}: use letters, digits and underscores (it is logged as val_<name>)"
        )
    if name == "loss":
        raise ConfigError(
            field_, "'loss' is taken: val_loss is always published; give the metric another name"
        )


@dataclass
class ValidationConfig:
    """The ``validation`` section: ignite metrics computed over the validation data and published as
    ``state.metrics["val_<name>"]`` beside ``val_loss`` (logged by every logger, usable as
    ``checkpoint.metric``). Each is fed ``(model_output, targets)`` of every validation microbatch and
    reduced over the data-parallel ranks only (see :mod:`engine.validation`). A ``val_accuracy`` to
    keep checkpoints by wants ``checkpoint.metric_mode: max``."""

    #: name -> the target of an ignite Metric class or factory (`ignite.metrics:Accuracy`,
    #: `hookloop.engine:TokenAccuracy`, `my_metrics.py:build`), or `{target: ..., <its keyword
    #: arguments>}`; published as `val_<name>`
    metrics: Dict[str, Any] = field(default_factory=dict)

    def validate(self, prefix: str = "validation") -> None:
        """Names and shapes; resolving the targets and checking their arguments is
        :func:`build_metrics` (``hookloop check`` runs it before anything starts)."""
        if not isinstance(self.metrics, Mapping):
            raise ConfigError(
                f"{prefix}.metrics", f"must be a mapping name -> metric target, got {self.metrics!r}"
            )
        for name, spec in self.metrics.items():
            check_metric_name(name, f"{prefix}.metrics.{name}")
            metric_target_and_args(spec, f"{prefix}.metrics.{name}")

    def produces(self, cfg: Any) -> set[str]:
        """``val_loss`` and ``val_<name>`` of every metric, when the run validates (validation data,
        and the step scheduler that says when)."""
        sched = getattr(cfg, "step_scheduler", None)
        if cfg.data.val_fraction > 0 and sched is not None and sched.enabled:
            return {"val_loss", *(f"val_{name}" for name in self.metrics)}
        return set()


def metric_target_and_args(spec: Any, field_: str) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping):
        args = dict(spec)
        target = args.pop("target", None)
        if target is None:
            raise ConfigError(
                f"{field_}.target", f"is not set: name the metric class or factory, {TARGET_HINT}"
            )
        if not isinstance(target, str):
            raise ConfigError(
                f"{field_}.target", f"must name the metric class or factory, {TARGET_HINT}; got {target!r}"
            )
        return target, args
    raise ConfigError(
        field_, f"must be a target ({TARGET_HINT}) or {{target: ..., <its arguments>}}, got {spec!r}"
    )


# Keys users reach for that live in another section, and removed keys with their replacement (one
# key per cadence: save, validate, log).
_NAN_FAULT = "fault_injection.enabled=true fault_injection.kind=nan fault_injection.microbatches=[...]"
_MOVED = {
    "checkpoint.every_steps": "step_scheduler.ckpt_every_steps",
    "step_scheduler.log_remote_every_steps": "logging.log_interval",
    "logging.wandb_every_steps": "logging.log_interval",
    "dataset_metrics.log_interval": "logging.log_interval",
    "train.max_steps": "step_scheduler.max_steps",
    "train.max_epochs": "step_scheduler.num_epochs",
    "train.num_epochs": "step_scheduler.num_epochs",
    "train.global_batch_size": "step_scheduler.global_batch_size",
    "train.lr": "optimizer.lr",
    "fault": _NAN_FAULT,
    "fault.nan_microbatches": _NAN_FAULT,
    "distributed.dp_size": (
        "the world size (torchrun --nproc-per-node) divided by distributed.tp_size x distributed.pp_size"
    ),
}


def validate_sections(cfg: Any, world_size: int | None = None) -> Any:
    """Validate a loaded config dataclass as a whole and return it; raise :class:`ConfigError`.

    1. every section's ``validate(name)`` (``name`` is the section's field name, so errors read
       ``section.field``);
    2. the config's own cross-section ``validate(world_size)``, if its class defines one;
    3. every section's optional ``cross_check(cfg, name)`` hook, for rules that relate a section
       to others (it sees the whole, already validated config).
    """
    sections = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]
    for name, section in sections:
        validate = getattr(section, "validate", None)
        if callable(validate) and not isinstance(section, type):
            validate(name)
    own = getattr(type(cfg), "validate", None)
    if callable(own):
        own(cfg, world_size)
    for name, section in sections:
        hook = getattr(section, "cross_check", None)
        if callable(hook) and not isinstance(section, type):
            hook(cfg, name)
    return cfg


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    schema: type,
    world_size: int | None = None,
) -> Any:
    """Load a YAML or TOML file onto ``schema``'s defaults, apply ``key=value`` overrides, and
    validate every section (:func:`validate_sections`); return a ``schema`` instance (a dataclass
    of sections, which the caller composes).

    Raises :class:`ConfigError` naming the field for unknown keys, wrong types, missing files and
    inconsistent values.
    """
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"schema must be a dataclass type whose fields are sections, got {schema!r}")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        data = _read_file(Path(path))
        _replace_default_mappings(base, data)
        layers.append(OmegaConf.create(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                item, "an override must look like section.key=value (e.g. step_scheduler.max_steps=100)"
            )
        key = item.split("=", 1)[0].strip()
        if key in _MOVED:
            raise ConfigError(key, f"is not a setting here; use {_MOVED[key]}")
    try:
        merged = OmegaConf.merge(base, *layers)
        # Overrides go onto the merged config one by one, so ``handlers.0.every=3`` (or
        # ``handlers[0].every=3``) reaches an item of a list the file set.
        for item in overrides:
            item = _null_words(schema, item)
            key = item.split("=", 1)[0]
            if "[" in key or any(part.strip().isdigit() for part in key.split(".")):
                merged.merge_with_dotlist([item])
            else:
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", None) or "config")
        if key in _MOVED:
            raise ConfigError(key, f"is not a setting here; use {_MOVED[key]}") from None
        msg = str(e).splitlines()[0]
        raise ConfigError(key, f"{msg} ({_where(schema, key)})") from None
    return validate_sections(cfg, world_size)


def _null_words(schema: type, item: str) -> str:
    """``key=None`` / ``key=none`` as ``key=null`` when ``key`` names an Optional field, so every
    spelling of null works on the command line (YAML reads ``null`` and ``~`` already); elsewhere
    the word stays a string."""
    key, value = item.split("=", 1)
    if value.strip() in ("None", "none") and _is_optional(schema, key.strip()):
        return f"{key}=null"
    return item


def _is_optional(schema: type, key: str) -> bool:
    """The field ``key`` (dotted, through nested dataclasses) is annotated ``Optional[...]``."""
    hint: Any = schema
    for name in key.split("."):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return False
        try:
            hints = typing.get_type_hints(hint)
        except Exception:  # an annotation that does not resolve: leave the value alone
            return False
        if name not in hints:
            return False
        hint = hints[name]
    return type(None) in typing.get_args(hint)


def _where(schema: type, key: str) -> str:
    """Where to look up the settings ``key`` may name: its section's dataclass, or the sections."""
    top = key.split(".", 1)[0].split("[", 1)[0]
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # an annotation that does not resolve: fall back to the raw ones
        hints = {f.name: f.type for f in dataclasses.fields(schema)}
    section = hints.get(top)
    if isinstance(section, type) and dataclasses.is_dataclass(section):
        return f"see {section.__module__}.{section.__qualname__} for the section's settings"
    names = ", ".join(f.name for f in dataclasses.fields(schema))
    return f"the sections of {schema.__qualname__} are: {names}"


def _read_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError("config", f"{path} is a directory; pass the path of a .yaml or .toml file")
    if not path.is_file():
        raise ConfigError(
            "config", f"file {str(path)!r} does not exist; pass the path of a .yaml or .toml file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"cannot read {path}: {e}") from None
    if path.suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config", f"{path} is not valid TOML: {_one_line(str(e))}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError("config", f"{path} is not valid YAML{where}: {_one_line(problem)}") from None
    else:
        raise ConfigError("config", f"{path}: use a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _replace_default_mappings(base: Any, data: dict[str, Any]) -> None:
    """A mapping the file sets replaces a non-empty default instead of merging into it: a config
    naming ``data.datasets: {mine: ...}`` trains on ``mine`` alone, not on the default ``docs`` as
    well. (Command-line overrides still add or replace single keys.)"""
    for section, values in data.items():
        if not isinstance(values, dict) or section not in base or not hasattr(base[section], "keys"):
            continue
        for key, value in values.items():
            current = base[section].get(key) if key in base[section] else None
            if isinstance(value, dict) and hasattr(current, "keys") and len(current):
                base[section][key] = {}
