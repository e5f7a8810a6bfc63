"""The ``data`` config section: named datasets, their mixture weights, and the phase curriculum.

Phases are a data-mixture concept, so their one validation function, :func:`check_phases`, lives
here: :meth:`DataConfig.validate` and the phase curriculum handler's constructor both call it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hookloop.engine.checks import check_bool, check_int, check_number, check_str
from hookloop.engine.errors import ConfigError

__all__ = ["DEFAULT_DATASETS", "DataConfig", "Phase", "PhaseConfig", "check_phases"]

# OmegaConf resolves annotations at run time, so sections spell Dict/List the old way.
# ruff: noqa: UP006, UP007, UP035, UP045

_PHASE_KEYS = ("start_step", "dataset_weights", "lr_scale")


@dataclass(frozen=True)
class Phase:
    """From optimizer step ``start_step`` on (1-based; 0 means from the start): these dataset weights
    (datasets not named keep their original weight) and ``lr_scale`` times the scheduler's LR."""

    start_step: int
    dataset_weights: Mapping[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0


def check_phases(
    phases: Sequence[Any],
    names: Sequence[str],
    prefix: str = "phases",
    *,
    base_weights: Mapping[str, float] | None = None,
) -> list[Phase]:
    """Validate phases (:class:`Phase`, :class:`PhaseConfig`, any object with those attributes, or a
    mapping) against the dataset ``names`` and return them as :class:`Phase` objects.

    Rules: ``start_step`` an integer >= 0, strictly increasing; ``dataset_weights`` names known
    datasets with finite weights >= 0; ``lr_scale`` a finite number > 0. With ``base_weights`` (the
    weights a phase starts from) a phase must also leave some dataset a positive weight. Errors name
    the field as ``<prefix>[i].<attribute>``.
    """
    if isinstance(phases, str | bytes | Mapping) or not isinstance(phases, Sequence):
        raise ConfigError(prefix, f"must be a list of phases, got {type(phases).__name__}")
    known = ", ".join(names)
    out: list[Phase] = []
    last = -1
    for i, raw in enumerate(phases):
        q = f"{prefix}[{i}]"
        if isinstance(raw, Mapping):
            unknown = set(raw) - set(_PHASE_KEYS)
            if unknown:
                raise ConfigError(
                    q, f"unknown key(s) {sorted(unknown)}; a phase has {', '.join(_PHASE_KEYS)}"
                )
            get = raw.get
        else:
            get = lambda key, default=None, _raw=raw: getattr(_raw, key, default)  # noqa: E731
        start = get("start_step")
        weights = get("dataset_weights", {}) or {}
        scale = get("lr_scale", 1.0)
        check_int(f"{q}.start_step", start, low=0, hint="an optimizer step")
        if start <= last:
            raise ConfigError(
                f"{q}.start_step",
                f"must be larger than the previous phase's ({last}): phases are in step order",
            )
        last = start
        if not isinstance(weights, Mapping):
            raise ConfigError(f"{q}.dataset_weights", f"must be a mapping name -> weight, got {weights!r}")
        for name, w in weights.items():
            if name not in names:
                raise ConfigError(f"{q}.dataset_weights.{name}", f"unknown dataset; known: {known}")
            check_number(f"{q}.dataset_weights.{name}", w, low=0)
        check_number(f"{q}.lr_scale", scale, positive=True, hint="a factor on the scheduler's learning rate")
        if base_weights is not None:
            merged = {**base_weights, **weights}
            if not any(w > 0 for w in merged.values()):
                raise ConfigError(
                    f"{q}.dataset_weights",
                    f"leaves every dataset at weight 0 ({merged}); give at least one a positive weight",
                )
        out.append(Phase(start, {k: float(v) for k, v in weights.items()}, float(scale)))
    return out


@dataclass
class PhaseConfig:
    """One phase of the ``data.phases`` list (see :class:`Phase`)."""

    start_step: int = 0  # the first step (1-based, absolute) this phase's weights apply to
    dataset_weights: Dict[str, float] = field(default_factory=dict)  # dataset name -> weight
    lr_scale: float = 1.0  # multiplies the scheduled learning rate during this phase


#: ``data.datasets`` when a config does not name any.
DEFAULT_DATASETS = {"docs": "stdlib_docs"}


@dataclass
class DataConfig:
    """Named datasets, their mixture weights (a dataset not named weighs 1.0), and an optional
    phase curriculum. The datasets are token files (``datasets``: name -> a token file path, or
    ``stdlib_docs`` / ``stdlib_source``) or what a factory of your own returns (``target``, called
    with ``args``): one map-style Dataset, or a dict of named ones; its samples reach the model
    recipe's ``collate_fn`` as they are."""

    #: name -> a token file path (``hookloop prepare``), or ``stdlib_docs`` / ``stdlib_source`` (the
    #: standard library's text, tokenized byte-level on first use)
    datasets: Dict[str, str] = field(default_factory=lambda: dict(DEFAULT_DATASETS))
    #: your data instead of token files: ``module:attribute`` or ``path/file.py:attribute`` of a
    #: factory returning a map-style Dataset (named after the attribute) or a dict name -> Dataset
    target: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)  # the target's keyword arguments
    weights: Dict[str, float] = field(default_factory=dict)  # name -> mixture weight (unnamed: 1.0)
    mix_temperature: float = 1.0  # draw source i with probability w_i ** (1 / T), normalised
    phases: List[PhaseConfig] = field(default_factory=list)  # a phase curriculum (empty: one phase)
    #: the key of a dict microbatch the model takes (``model(batch[inputs])``), with ``data.targets``
    #: the loss's (``loss_fn(output, batch[targets])``); null: a dict follows the Hugging Face
    #: convention (``input_ids``, ``labels``)
    inputs: Optional[str] = None
    targets: Optional[str] = None  # the key of a dict microbatch that is the loss's target (with data.inputs)
    cache_dir: str = "data"  # where the stdlib token files are written and found
    val_fraction: float = 0.02  # the tail of each dataset held out for validation
    #: validation samples: the first N of the held-out tail, shared evenly among the data-parallel
    #: ranks, so the validation loss is the same whatever the world size (0: no validation)
    val_samples: int = 64
    num_workers: int = 0  # DataLoader worker processes (0: load in the training process)
    #: write ``samples-rank<R>.jsonl`` into the run directory: per optimizer step, the ids
    #: (``"<dataset>:<index>"``) of the samples data-parallel rank R trained on (docs/data.md)
    trace_samples: bool = False
    #: a ``quarantine.jsonl`` (as a run writes it, docs/nan_detector.md): a new run never trains on
    #: its samples
    quarantine: Optional[str] = None

    def validate(self, prefix: str = "data") -> None:
        p = prefix
        check_str(
            f"{p}.target", self.target, allow_none=True, what="module:attribute or path/file.py:attribute"
        )
        if not isinstance(self.args, Mapping):
            raise ConfigError(f"{p}.args", f"must be a mapping of the target's arguments, got {self.args!r}")
        if self.target is None and self.args:
            raise ConfigError(f"{p}.args", "are the arguments of data.target, which is not set")
        if self.target is not None and self.datasets != DEFAULT_DATASETS:
            raise ConfigError(
                f"{p}.datasets",
                "is set together with data.target: name the data one way, token files in data.datasets "
                "or a factory in data.target",
            )
        if not self.datasets:
            raise ConfigError(f"{p}.datasets", "must name at least one dataset")
        for name, source in self.datasets.items():
            check_str(f"{p}.datasets.{name}", source, what="a token file path, stdlib_docs or stdlib_source")
        check_number(f"{p}.mix_temperature", self.mix_temperature, positive=True)
        for key in ("inputs", "targets"):
            check_str(f"{p}.{key}", getattr(self, key), allow_none=True, what="a key of a dict microbatch")
        if (self.inputs is None) != (self.targets is None):
            unset = "targets" if self.targets is None else "inputs"
            raise ConfigError(
                f"{p}.{unset}", "is needed too: data.inputs and data.targets name a dict's keys together"
            )
        if self.target is None:  # a target's names are known once it has run: check_names then
            self.check_names(list(self.datasets), prefix)
        check_str(f"{p}.cache_dir", self.cache_dir, what="a directory path")
        check_number(f"{p}.val_fraction", self.val_fraction, low=0, below=1)
        check_int(f"{p}.val_samples", self.val_samples, low=0)
        check_int(f"{p}.num_workers", self.num_workers, low=0)
        check_bool(f"{p}.trace_samples", self.trace_samples)
        check_str(f"{p}.quarantine", self.quarantine, allow_none=True, what="a quarantine.jsonl file path")
        if self.quarantine is not None and not os.path.isfile(self.quarantine):
            raise ConfigError(
                f"{p}.quarantine", f"{self.quarantine} is not a file; name a run's quarantine.jsonl"
            )

    def prepare_batch(self, recipe: Any = None) -> Any:
        """The trainer's ``prepare_batch`` for ``inputs`` / ``targets``, else for the ``recipe``'s
        (a :class:`hookloop.recipe.ModelRecipe` may name them too); None: the default's."""
        keys = (
            (self.inputs, self.targets)
            if self.inputs
            else (getattr(recipe, "inputs", None), getattr(recipe, "targets", None))
        )
        if keys[0] is None:
            return None
        from hookloop.engine.batch import keyed_prepare_batch

        return keyed_prepare_batch(*keys)

    def check_names(self, names: Sequence[str], prefix: str = "data") -> None:
        """``weights`` and ``phases`` against the dataset ``names`` (the token files', or those
        ``target`` returned)."""
        p = prefix
        for name, w in self.weights.items():
            if name not in names:
                raise ConfigError(f"{p}.weights.{name}", f"unknown dataset; known: {', '.join(names)}")
            check_number(f"{p}.weights.{name}", w, low=0)
        base = {name: self.weights.get(name, 1.0) for name in names}
        if not any(w > 0 for w in base.values()):
            raise ConfigError(
                f"{p}.weights", "all weights are zero: give at least one dataset a positive weight"
            )
        check_phases(self.phases, names, f"{p}.phases", base_weights=base)
