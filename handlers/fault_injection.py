"""FaultInjector: make a fault on purpose, to see the run detect, attribute and survive it.

Four kinds (the ``fault_injection`` section, :class:`FaultInjectionConfig`):

- ``transient``: rank ``rank`` computes a NaN output once, in the first forward of step ``step``
  (a forward hook on the trainer's model; under pipeline parallelism on each of this rank's stage
  modules, so the first stage forward it runs); a rerun of that step computes right.
- ``data``: sample ``sample`` (``"<dataset>:<index>"``, as the sample trace names it) is bad: at
  each step that draws it, its row of every floating-point tensor of its microbatch becomes NaN
  before anything computes, on whichever rank draws it; the bad values travel with the microbatch,
  so any rank that reruns it finds it bad too. Needs the sample trace (``data.trace_samples``).
- ``corruption``: at the start of step ``step``, bit ``bit`` of the first element of parameter
  ``parameter`` (its float32 pattern; this rank's shard under FSDP2) flips on rank ``rank`` only:
  one replica's weights silently differ from the others'. Bit 30 (the exponent's top bit) makes the
  value huge, so that rank's steps go bad; a low bit leaves the loss finite, which only a comparison
  of the replicas' weights can see.
- ``nan``: the training loss (the trainer's ``loss_fn``) of each microbatch in ``microbatches``
  (0-based over the run, ``state.microbatches_seen``, which a rollback never rewinds) is NaN on
  every rank, and with it the step's gradients; validation is not affected.

A fault fires once per run (its state, saved in checkpoints and kept across rollbacks, says so),
but a bad sample is bad every time it is drawn, and a listed microbatch whenever it is trained.
"""

from __future__ import annotations

from typing import Any

import torch

from hookloop.engine import ConfigError, Events, Trainer, parallel
from hookloop.engine.data import SampleTrace
from hookloop.engine.events import Priority
from hookloop.engine.handler import Handler, checked_settings
from hookloop.handlers.sections.fault_injection import FaultInjectionConfig

__all__ = ["FaultInjectionConfig", "FaultInjector"]

#: STEP_START: after the sample trace took the step's sample ids, before the step computes.
INJECT_FAULT = Priority.OBSERVE - 200


class FaultInjector(Handler):
    """A transient NaN, a bad sample, a flipped bit or NaN losses, made on purpose (module docstring)."""

    state_key = "fault_injection"
    restore_on_rollback = False
    asks_after_agreement = False
    Config = FaultInjectionConfig
    section = "fault_injection"
    doc = "docs/nan_detector.md"  # its page (a shipped handler: handlers/declarations.py)

    def __init__(
        self,
        *,
        kind: str = "transient",
        rank: int = 0,
        step: int = 1,
        sample: str | None = None,
        parameter: str | None = None,
        bit: int = 30,
        microbatches: list[int] | tuple[int, ...] = (),
    ) -> None:
        settings = {**locals(), "enabled": True, "microbatches": list(microbatches)}
        checked_settings(FaultInjectionConfig, settings, "fault_injection")
        self.kind, self.rank, self.step, self.sample = kind, rank, step, sample
        self.parameter, self.bit = parameter, bit
        self.microbatches = set(microbatches)
        self.fired = False
        #: What the corruption kind flipped: ``{"step", "rank", "parameter", "bit"}`` (None: nothing
        #: yet), so a check that compares the replicas' weights can be held to it.
        self.flipped: dict[str, Any] | None = None
        self._armed = False

    def attach(self, trainer: Trainer) -> FaultInjector:
        if self.kind == "nan":
            trainer.loss_fn = self._nan_loss(trainer)
            return super().attach(trainer)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=INJECT_FAULT)
        if self.kind == "transient":  # a pipeline's model is this rank's stages: each is called alone
            model = trainer.model
            for module in model if isinstance(model, torch.nn.ModuleList) else [model]:
                module.register_forward_hook(self._poison_output)
        if self.kind == "corruption":
            self._target(trainer.model)  # an unknown parameter is refused now, not at the step
        return super().attach(trainer)

    def _on_step_start(self, trainer: Trainer) -> None:
        if self.kind == "data":
            self._poison_sample(trainer)
            return
        if self.fired or trainer.state.step != self.step or parallel.rank() != self.rank:
            return
        self.fired = True
        if self.kind == "transient":
            self._armed = True
        else:
            self._flip(trainer.model)

    def _nan_loss(self, trainer: Trainer) -> Any:
        """The trainer's ``loss_fn``, NaN while a listed microbatch trains (``microbatches_seen`` is
        the running microbatch's 0-based index while its loss is computed)."""
        loss_fn = trainer.loss_fn
        if loss_fn is None:
            raise ConfigError(
                "fault_injection.kind", "'nan' needs a loss_fn to poison: this model computes its own loss"
            )

        def loss(output: Any, targets: Any) -> torch.Tensor:
            value = loss_fn(output, targets)
            if torch.is_grad_enabled() and trainer.state.microbatches_seen in self.microbatches:
                return value * float("nan")  # training, not validation
            return value

        return loss

    def _poison_output(self, module: Any, args: Any, output: Any) -> Any:
        if not self._armed:
            return None
        self._armed = False
        if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
            return type(output)([output[0] * float("nan"), *output[1:]])
        if not isinstance(output, torch.Tensor):
            raise ConfigError(
                "fault_injection.kind",
                f"'transient' makes the model's tensor output NaN; the model returns {type(output).__name__}",
            )
        return output * float("nan")

    def _poison_sample(self, trainer: Trainer) -> None:
        trace = trainer.get_handler(SampleTrace)
        if trace is None:
            raise ConfigError(
                "fault_injection.sample",
                "kind 'data' finds the sample by the sample trace: set data.trace_samples=true",
            )
        for microbatch, ids in zip(trainer.state.batch, trace.step_ids()):
            row = ids.index(self.sample) if self.sample in ids else None  # None: only look (step 1 on)
            if not _poison_row(microbatch, row, len(ids)):
                raise ConfigError(
                    "fault_injection.sample",
                    "kind 'data' makes a sample's floating-point tensors NaN; its microbatch holds none",
                )
            self.fired = self.fired or row is not None

    def _target(self, model: torch.nn.Module) -> torch.Tensor:
        named = dict(model.named_parameters())
        if self.parameter is None:
            return next(iter(named.values()))
        for name in (self.parameter, f"module.{self.parameter}"):  # DDP prefixes its module's names
            if name in named:
                return named[name]
        raise ConfigError(
            "fault_injection.parameter",
            f"{self.parameter!r} is not a parameter of the model; one of {list(named)[:5]}",
        )

    def _flip(self, model: torch.nn.Module) -> None:
        param = self._target(model)
        name = next(n for n, p in model.named_parameters() if p is param)
        self.flipped = {"step": self.step, "rank": self.rank, "parameter": name, "bit": self.bit}
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2: this rank's shard
        with torch.no_grad():
            flat = local.detach().view(-1)
            bits = flat[:1].float().view(torch.int32)
            bits ^= 1 << self.bit if self.bit < 31 else -(1 << 31)
            flat[:1] = bits.view(torch.float32).to(flat.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self.fired, "flipped": self.flipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fired = bool(state["fired"])
        self.flipped = state.get("flipped")


def _poison_row(microbatch: Any, row: int | None, size: int) -> bool:
    """Row ``row`` of every floating-point tensor of ``microbatch`` (``size`` rows) set to NaN, in
    place (``row`` None: none set); whether there was one."""
    if isinstance(microbatch, torch.Tensor):
        if microbatch.is_floating_point() and microbatch.dim() and microbatch.shape[0] == size:
            if row is not None:
                microbatch[row] = float("nan")
            return True
        return False
    values = microbatch.values() if isinstance(microbatch, dict) else microbatch
    if isinstance(values, tuple | list) or isinstance(microbatch, dict):
        return any([_poison_row(x, row, size) for x in values])
    return False
