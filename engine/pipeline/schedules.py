"""Which pipeline schedules the installed torch offers, and schedules read from CSV files.

Names are never hard-coded: they are read from ``torch.distributed.pipelining.schedules`` (what
``get_schedule_class`` accepts, minus the base classes that need a CSV or a subclass to do
anything). Every use of torch's private pipelining API (``_Action``, ``_validate_schedule``,
``_PipelineScheduleRuntime._load_csv``) lives in this module, so a torch upgrade that moves them
breaks one file.

``torch.distributed.pipelining`` takes about two seconds to import, so it is imported here on
first use only.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any

from hookloop.engine.errors import ConfigError

__all__ = [
    "CsvSchedule",
    "V_STYLE_SCHEDULES",
    "available_schedules",
    "build_csv_schedule",
    "losses_computed",
    "parse_schedule_csv",
    "resolve_schedule",
    "schedule_style",
]

# Schedules that place two stages per rank in a V (rank r holds stages r and 2p-1-r). torch keeps
# this inside each class's constructor; the runtime checks the mapping a built schedule reports, so
# a new V-style class in a later torch fails loudly instead of deadlocking.
V_STYLE_SCHEDULES = frozenset({"ScheduleZBVZeroBubble", "ScheduleDualPipeV"})


def _schedules_module() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


@functools.lru_cache(maxsize=1)
def _schedule_classes() -> dict[str, type]:
    """Name (as ``get_schedule_class`` spells it) -> class, for concrete schedules only."""
    mod = _schedules_module()
    found: dict[str, type] = {}
    for attr, obj in vars(mod).items():
        if not (isinstance(obj, type) and issubclass(obj, mod._PipelineSchedule)):
            continue
        for candidate in (attr.removeprefix("Schedule"), attr):
            try:
                cls = mod.get_schedule_class(candidate)
            except ValueError:
                continue
            if cls is obj:
                found[candidate] = obj
                break
    classes = list(found.values())
    # A class another accepted class derives from is a base (PipelineScheduleSingle/Multi): it has
    # no schedule of its own.
    return {
        name: cls
        for name, cls in sorted(found.items())
        if not inspect.isabstract(cls) and not any(o is not cls and issubclass(o, cls) for o in classes)
    }


def available_schedules() -> list[str]:
    """The schedule names ``pipeline.pp_schedule`` accepts with the installed torch."""
    return list(_schedule_classes())


def _normalize(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def resolve_schedule(name: Any, field: str = "pipeline.pp_schedule") -> type:
    """The schedule class for ``name`` (case-insensitive; ``_`` and ``-`` are ignored, so
    ``interleaved_1f1b`` works), or a :class:`ConfigError` listing the valid names."""
    classes = _schedule_classes()
    if isinstance(name, str):
        for canonical, cls in classes.items():
            if _normalize(canonical) == _normalize(name):
                return cls
    import torch

    raise ConfigError(
        field,
        f"unknown schedule {name!r}; torch {torch.__version__} offers {', '.join(classes)} "
        "(or give a schedule file in pipeline.pp_schedule_csv)",
    )


def schedule_style(cls: type) -> str:
    """``"single"`` (one stage per rank), ``"loop"`` (stage ids rank + k*pp) or ``"v"``."""
    mod = _schedules_module()
    if issubclass(cls, mod.PipelineScheduleSingle):
        return "single"
    return "v" if cls.__name__ in V_STYLE_SCHEDULES else "loop"


@dataclasses.dataclass(frozen=True)
class CsvSchedule:
    """A schedule file, parsed and checked: which stages each rank runs."""

    path: str
    format: str  # "compute_only" or "compute_comms", as torch's loader names them
    rank_stages: dict[int, list[int]]
    num_stages: int
    n_microbatches: int


def parse_schedule_csv(
    path: Any,
    *,
    pp_size: int | None = None,
    n_microbatches: int | None = None,
    field: str = "pipeline.pp_schedule_csv",
) -> CsvSchedule:
    """Read a schedule CSV (one row of actions such as ``0F1``, ``2B0`` per rank) and check it is
    complete and ordered (every stage runs each microbatch's forward before its backward)."""
    mod = _schedules_module()
    p = Path(str(path))
    if not p.is_file():
        raise ConfigError(field, f"schedule file {str(p)!r} does not exist; give the path of a CSV schedule")
    rows: dict[int, list[Any]] = {}
    try:
        with open(p, newline="") as f:
            for rank, row in enumerate(csv.reader(f)):
                rows[rank] = [mod._Action.from_str(cell) for cell in row]
    except (RuntimeError, ValueError) as e:
        raise ConfigError(field, f"{p} does not parse as a schedule: {e}") from None
    if not rows:
        raise ConfigError(field, f"{p} is empty; it needs one row of actions per pipeline rank")
    compute = {
        rank: [a for a in actions if a is not None and (a.is_compute_op or a.sub_actions)]
        for rank, actions in rows.items()
    }
    all_actions = [a for actions in rows.values() for a in actions if a is not None]
    fmt = "compute_only" if all(a.is_compute_op for a in all_actions) else "compute_comms"
    leaves = [s for a in all_actions for s in (a.sub_actions or (a,)) if s.is_compute_op]
    if not leaves:
        raise ConfigError(field, f"{p} holds no forward/backward actions")
    num_stages = max(a.stage_index for a in leaves) + 1
    forward = mod._ComputationType.FORWARD
    mbs = {a.microbatch_index for a in leaves if a.computation_type == forward}
    found_mb = len(mbs)
    if pp_size is not None and len(rows) != pp_size:
        raise ConfigError(
            field, f"{p} has {len(rows)} rows but distributed.pp_size is {pp_size}: one row per rank"
        )
    if n_microbatches is not None and found_mb != n_microbatches:
        raise ConfigError(
            field,
            f"{p} schedules {found_mb} microbatches but pipeline.pp_batch_size // "
            f"pipeline.pp_microbatch_size is {n_microbatches}",
        )
    try:
        mapping = mod._validate_schedule(compute, len(rows), num_stages, found_mb)
    except (AssertionError, KeyError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(field, f"{p} is not a valid schedule: {first}") from None
    rank_stages = {r: sorted(s for s, owner in mapping.items() if owner == r) for r in range(len(rows))}
    return CsvSchedule(str(p), fmt, rank_stages, num_stages, found_mb)


def losses_computed(schedule: Any) -> int:
    """How many microbatch losses ``schedule`` has kept so far in this step: the index of the
    microbatch whose loss is being computed. (Stage set-up on the first step also calls the loss,
    for shape inference only; it sees index 0 and its result is discarded.)"""
    return len(schedule._internal_losses)


def build_csv_schedule(stages: list, csv_schedule: CsvSchedule, n_microbatches: int, **kwargs: Any) -> Any:
    """A runtime schedule over ``stages`` whose actions come from ``csv_schedule``."""
    mod = _schedules_module()
    schedule = mod._PipelineScheduleRuntime(stages, n_microbatches, **kwargs)
    schedule._load_csv(csv_schedule.path, format=csv_schedule.format)
    return schedule
