"""What a checkpoint records of the settings it was trained with, and what a resume does with a
changed one: it takes effect from the resumed step and is said in one lifecycle line
(``checkpoint -> this run``), or it is refused by name before anything loads (a
:class:`ConfigError`, agreed by every rank). The rules are the table in docs/checkpoint.md,
"Changing settings on resume".

Each rank's state JSON records, under ``"settings"``:

- ``optimizer``: its kind and every parameter group's hyperparameters (``lr`` is the group's base
  rate). A resume loads the optimizer's state (moments, step counts) and then puts this run's
  hyperparameters back: they are the config's. Another kind is refused unless
  ``load_optimizer=False`` (its state would not fit).
- ``lr_schedule``: an :class:`~hookloop.engine.lr.LRSchedule`'s settings (null for another
  scheduler). The schedule is always this run's; a resume restores its position and evaluates it
  there with this run's base rates.
- ``run``: the settings the composition root records with :meth:`ResumeSettings.record` (seq_len,
  the dataset list, the global batch, ...), each honoured and said, or refused with its reason.

A checkpoint without the entry (or one of its parts), written by an earlier version, resumes with
this run's settings, and the line says that the checkpoint's are unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hookloop.engine.checkpoint_format.errors import CheckpointError, CheckpointLayoutError
from hookloop.engine.errors import ConfigError
from hookloop.handlers.checkpoint.session import CheckpointSession

__all__ = ["NEW_RUN", "NOT_SET", "Recorded", "ResumePlan", "ResumeSettings", "show"]

#: How every refusal ends: the way to keep what the checkpoint holds and train with the change.
NEW_RUN = "or start another run with train.run_dir=<new dir>"
#: A model argument one of the two runs did not give (its build function's default stood).
NOT_SET = "(not set)"
# Parameter-group settings that shape the optimizer's state: a change cannot take effect on loaded state.
_STATE_SHAPING = ("amsgrad",)


@dataclass(frozen=True)
class Recorded:
    """A setting a checkpoint records: its ``value`` (JSON-safe once :func:`plain`), and ``refuse``,
    why a resume cannot honour a change (None: a change takes effect and is said)."""

    value: Any
    refuse: str | None = None


@dataclass
class ResumePlan:
    """What a resume from the checkpoint at ``step`` does with this run's settings, decided before
    anything loads: ``refusal`` (raised on every rank) or the ``changes`` it says; ``configured``
    and ``base_lrs`` are this run's optimizer hyperparameters and scheduler base rates, put back
    (the rates as the schedule's inputs) once the checkpoint's state is loaded."""

    step: int
    configured: list[dict[str, Any]]
    base_lrs: list[float] | None
    old_lr: float | None = None
    changes: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    model_changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    refusal: ConfigError | None = None

    def refuse(self, error: ConfigError) -> None:
        if self.refusal is None:  # the first one is named; fixing it shows the next
            self.refusal = error

    def layout_error(self, error: CheckpointLayoutError) -> CheckpointLayoutError:
        """``error`` (another model layout) named by the changed model setting that caused it."""
        if not self.model_changes:
            return error
        name, old, new = self.model_changes[0]
        difference = getattr(error, "difference", "") or "other parameter shapes"
        back = f"leave {name} out" if old == NOT_SET else f"set {name}={show(old)}"
        return CheckpointLayoutError(
            name,
            f"the checkpoint at step {self.step} was trained with {show(old)}, this run sets {show(new)}, "
            f"and its model has another layout ({difference}): {back} to resume it, {NEW_RUN}",
        )

    def line(self, lrs: list[float] | None) -> str | None:
        """The lifecycle line (None when nothing differs from the checkpoint)."""
        items = list(self.changes)
        if self.unknown:
            items.append(
                f"not recorded in the checkpoint (an earlier version wrote it): {', '.join(self.unknown)} "
                "(this run's apply)"
            )
        rate = ""
        if lrs and self.old_lr is not None and not math.isclose(self.old_lr, lrs[0], rel_tol=1e-9):
            rate = f"; learning rate {show(self.old_lr)} -> {show(lrs[0])}"
        if not items and not rate:
            return None
        return (
            f"resuming at step {self.step} with settings from the checkpoint changed (checkpoint -> this "
            f"run, in effect from step {self.step + 1}): {', '.join(items) or 'none named'}{rate}"
        )


class ResumeSettings:
    """Records a run's settings in each checkpoint and plans, agrees and applies a resume's."""

    def __init__(self, session: CheckpointSession) -> None:
        self._session = session
        self._run: dict[str, Recorded] = {}

    def record(self, settings: Mapping[str, Recorded]) -> None:
        """Record ``settings`` (dotted field -> :class:`Recorded`) in every checkpoint from now on."""
        self._run.update(settings)

    def capture(self, trainer: Any) -> dict[str, Any]:
        """The ``settings`` entry of this rank's state JSON."""
        return {
            "optimizer": {
                "kind": type(trainer.optimizer).__name__,
                "groups": [_group_settings(g) for g in trainer.optimizer.param_groups],
            },
            "lr_schedule": _schedule_settings(trainer.lr_scheduler),
            "run": {name: plain(rec.value) for name, rec in self._run.items()},
        }

    # ------------------------------------------------------------------------------ resume
    def plan(
        self,
        trainer: Any,
        saved: Mapping[str, Any] | None,
        saved_scheduler: Any,
        *,
        step: int,
        load_optimizer: bool,
    ) -> ResumePlan:
        """Compare this run's settings with the checkpoint's (``saved``: its ``settings`` entry;
        ``saved_scheduler``: its LR scheduler state), before anything loads."""
        scheduler = trainer.lr_scheduler
        bases = getattr(scheduler, "base_lrs", None) if scheduler is not None else None
        plan = ResumePlan(
            step,
            configured=[
                {k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups
            ],
            base_lrs=None if bases is None else [float(b) for b in bases],
        )
        if isinstance(saved_scheduler, Mapping) and saved_scheduler.get("_last_lr"):
            plan.old_lr = float(saved_scheduler["_last_lr"][0])
        if not load_optimizer:
            plan.changes.append("checkpoint.load_optimizer=false: the optimizer's state starts fresh")
        if not isinstance(saved, Mapping):
            plan.unknown.append("the optimizer's settings, the LR schedule and the run's settings")
            return plan
        current = self.capture(trainer)
        _plan_optimizer(plan, saved.get("optimizer"), current["optimizer"], load_optimizer)
        _plan_schedule(plan, saved, current["lr_schedule"], scheduler, saved_scheduler)
        saved_run = saved.get("run")
        names = list(self._run)
        if isinstance(saved_run, Mapping):  # a model argument given in one run only: a change too
            names += [n for n in saved_run if n.startswith("model.") and n not in self._run]
        for name in names:
            rec = self._run.get(name, Recorded(NOT_SET))
            if isinstance(saved_run, Mapping) and name not in saved_run and name.startswith("model."):
                old = NOT_SET
            elif not isinstance(saved_run, Mapping) or name not in saved_run:
                plan.unknown.append(name)
                continue
            else:
                old = saved_run[name]
            new = plain(rec.value)
            if same(old, new):
                continue
            if rec.refuse is not None:
                plan.refuse(_refusal(name, step, old, new, rec.refuse))
                continue
            if name.startswith("model."):
                plan.model_changes.append((name, old, new))
            plan.changes.append(f"{name} {show(old)} -> {show(new)}")
        return plan

    def agree(self, error: BaseException | None) -> None:
        """Raise the first rank's error on every rank, or nothing when no rank has one (collective
        on the checkpoint group): a refusal never leaves a rank waiting in a later collective."""
        group = self._session.group
        if group is not None:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, _portable(error), group=group)
            first = next((g for g in gathered if g is not None), None)
            if error is None and first is not None:
                kind, name, message = first
                error = ConfigError(name, message) if kind == "config" else CheckpointError(message)
        if error is not None:
            raise error

    def honour(self, trainer: Any, plan: ResumePlan) -> list[float] | None:
        """After the checkpoint's state loaded: this run's hyperparameters back into the groups, its
        rates into the schedule (``trainer.rates`` writes them): the scheduler's base rates, or
        without one ``rates.base``. Returns the scheduler's rates now in force (None without one)."""
        groups, rates, scheduler = trainer.optimizer.param_groups, trainer.rates, trainer.lr_scheduler
        if len(groups) == len(plan.configured):
            for group, configured in zip(groups, plan.configured):
                group.update({k: v for k, v in configured.items() if k != "lr"})
        if scheduler is None:
            if rates.base is None:  # the rates this run started with (a rollback keeps them)
                rates.base = [float(configured["lr"]) for configured in plan.configured]
            rates.write(plan.step + 1)
            return None
        if plan.base_lrs is None:
            return None
        state = scheduler.state_dict()
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas is not None:
            lrs = [base * fn(state["last_epoch"]) for base, fn in zip(plan.base_lrs, lambdas)]
            state["base_lrs"] = list(plan.base_lrs)
        else:  # refused in the plan unless the base rates are the checkpoint's
            lrs = [float(lr) for lr in (state.get("_last_lr") or scheduler.get_last_lr())]
        state["_last_lr"] = lrs
        scheduler.load_state_dict(state)
        rates.write(plan.step + 1)
        return lrs


# ---------------------------------------------------------------------------------------- plans
def _refusal(name: str, step: int, old: Any, new: Any, why: str, also: str = "") -> ConfigError:
    """``name: the checkpoint at step N was trained with OLD, this run sets NEW; WHY: set it back
    to resume it, ALSO or start another run ...``"""
    back = f"set {name} back to {show(old)}" if isinstance(old, dict | list) else f"set {name}={show(old)}"
    return ConfigError(
        name,
        f"the checkpoint at step {step} was trained with {show(old)}, this run sets {show(new)}; "
        f"{why}: {back} to resume it, {also}{NEW_RUN}",
    )


_FRESH_STATE = "set checkpoint.load_optimizer=false to start the optimizer's state fresh from its weights, "


def _plan_optimizer(plan: ResumePlan, saved: Any, now: dict[str, Any], load_optimizer: bool) -> None:
    """The optimizer's kind and hyperparameters: changes take effect (the config's are put back after
    the load); what the loaded state cannot fit is refused unless that state is not loaded."""
    if not isinstance(saved, Mapping):
        plan.unknown.append("optimizer")
        return
    old_kind, new_kind = str(saved.get("kind")).lower(), now["kind"].lower()
    if old_kind != new_kind:
        why = "the optimizer's state (its moments) fits only the kind that wrote it"
        if load_optimizer:
            plan.refuse(_refusal("optimizer.name", plan.step, old_kind, new_kind, why, _FRESH_STATE))
        plan.changes.append(f"optimizer.name {old_kind} -> {new_kind}")
        return  # another kind's hyperparameters are its own
    old_groups, new_groups = saved.get("groups") or [], now["groups"]
    if len(old_groups) != len(new_groups):
        why = "the optimizer's state is held per parameter group"
        if load_optimizer:
            plan.refuse(
                _refusal(
                    "optimizer.param_groups", plan.step, len(old_groups), len(new_groups), why, _FRESH_STATE
                )
            )
        plan.changes.append(f"optimizer.param_groups {len(old_groups)} -> {len(new_groups)}")
        return
    for i, (old, new) in enumerate(zip(old_groups, new_groups)):
        for key, value in new.items():
            if key in old and same(old[key], value):
                continue
            name = f"optimizer.{key}" if len(new_groups) == 1 else f"optimizer.param_groups[{i}].{key}"
            if key in _STATE_SHAPING and load_optimizer:
                why = "it changes what the optimizer's state holds"
                plan.refuse(_refusal(name, plan.step, old.get(key), value, why, _FRESH_STATE))
            plan.changes.append(f"{name} {show(old[key]) if key in old else 'unknown'} -> {show(value)}")


def _plan_schedule(
    plan: ResumePlan, saved: Mapping[str, Any], now: dict[str, Any] | None, scheduler: Any, saved_state: Any
) -> None:
    """The LR schedule is this run's, evaluated at the resumed step: its changed settings are said.
    A scheduler that cannot be evaluated there (not a ``LambdaLR``) refuses other base rates."""
    if plan.base_lrs is not None and getattr(scheduler, "lr_lambdas", None) is None:
        old_bases = saved_state.get("base_lrs") if isinstance(saved_state, Mapping) else None
        if old_bases is not None and not same(old_bases, plan.base_lrs):
            why = f"the LR scheduler ({type(scheduler).__name__}) cannot be evaluated with other base rates"
            plan.refuse(_refusal("optimizer.lr", plan.step, old_bases, plan.base_lrs, why))
    if "lr_schedule" not in saved:
        plan.unknown.append("lr")
        return
    old = saved["lr_schedule"]
    if not isinstance(old, Mapping) or now is None:
        return
    for key, value in now.items():
        if key in ("peak_lr", "decay_steps_from") or same(old.get(key), value):
            continue  # the peak is optimizer.lr
        name = f"lr.{key}"
        if key == "decay_steps" and now.get("decay_steps_from"):
            name += f" (null: {now['decay_steps_from']})"
        plan.changes.append(f"{name} {show(old.get(key))} -> {show(value)}")


# ---------------------------------------------------------------------------------------- values
def _group_settings(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters; ``lr`` is its base rate (``initial_lr`` under a scheduler)."""
    out = {k: plain(v) for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
    return {"lr": plain(group.get("initial_lr", group["lr"])), **out}


def _schedule_settings(scheduler: Any) -> dict[str, Any] | None:
    settings = getattr(scheduler, "settings", None) if scheduler is not None else None
    if not isinstance(settings, Mapping):
        return None
    return {**{k: plain(v) for k, v in settings.items()}, "decay_steps_from": scheduler.decay_steps_from}


def plain(value: Any) -> Any:
    """``value`` as JSON carries it (tuples as lists, tensors as numbers, anything else as its repr)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return repr(value)


def same(a: Any, b: Any) -> bool:
    """Whether two recorded values are equal (numbers by value, mappings in order)."""
    if _number(a) and _number(b):
        return float(a) == float(b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def show(value: Any) -> str:
    """A recorded value as a config would spell it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def _portable(error: BaseException | None) -> tuple[str, str, str] | None:
    """``error`` as plain values another rank can raise again."""
    if error is None:
        return None
    if isinstance(error, ConfigError):
        return "config", error.field, str(error).removeprefix(f"{error.field}: ")
    return "checkpoint", "", str(error) or type(error).__name__
