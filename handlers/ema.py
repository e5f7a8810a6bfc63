"""WeightEMA: an exponential moving average of the weights, validated, checkpointed and exported.

After every committed optimizer step (a vetoed step, fp16 overflow included, never enters it; a
rollback restores it with the model, as the checkpoint held it), on the steps ``every_steps``
divides::

    ema = decay * ema + (1 - decay) * weights        # until start_step: ema = weights

Each parameter's average is a tensor of the parameter's kind: a DTensor sharded as the parameter is
under FSDP2 or tensor parallelism (each rank averages its own shard), a plain tensor under DDP. It is
the handler's tensor state (``tensor_state_dict()``, :mod:`hookloop.handlers.checkpoint.handler_tensors`):
saved through DCP beside the model under ``handlers.ema.<parameter>``, resharded on resume into
another layout, exported by ``hookloop export RUN_DIR --ema``. At every validation the same
validation runs again on the average (swapped into the model, then the trained weights put back),
publishing ``val_loss_ema`` and ``val_<name>_ema`` (``checkpoint.metric: val_loss_ema`` ranks by
it). A resume with another ``decay``, ``every_steps`` or ``start_step`` takes it from the resumed
step and says so. See docs/ema.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hookloop.engine import parallel
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.handler import Handler, checked_settings
from hookloop.handlers.sections.ema import EMAConfig

__all__ = ["EMA_START", "EMA_UPDATE", "EMAConfig", "WeightEMA"]

logger = logging.getLogger(__name__)

#: STEP_END: average the weights the optimizer step made, before validation (the head of OBSERVE)
#: and before the step's save (ACT) reads the average.
EMA_UPDATE = Priority.OBSERVE + 900
#: TRAIN_START: once a resume had its chance to restore the average (RESTORE), start it from the
#: weights when it did not (a fresh run, ``finetune_from``, an average enabled on resume).
EMA_START = Priority.OBSERVE + 900

_SETTINGS = ("decay", "every_steps", "start_step")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class WeightEMA(Handler):
    """An exponential moving average of the model's floating-point parameters (see the module
    docstring). ``decay``: the average's weight on its past; ``every_steps``: update on the steps it
    divides; ``start_step``: until this step the average is the weights."""

    Config = EMAConfig
    section = "ema"
    state_key = "ema"
    #: The ``state.metrics`` it writes at every validation (and ``val_<name>_ema`` per validation
    #: metric: :meth:`EMAConfig.produces`).
    publishes = ("val_loss_ema",)
    #: Its page in the docs.
    doc = "docs/ema.md"

    def __init__(self, decay: float = 0.999, every_steps: int = 1, start_step: int = 0) -> None:
        checked_settings(EMAConfig, locals(), "ema")
        self.decay, self.every_steps, self.start_step = float(decay), every_steps, start_step
        #: averaging updates made (steps after ``start_step`` that entered the average)
        self.updates = 0
        self._average: dict[str, torch.Tensor] = {}  # parameter name (as checkpoints name it) -> average
        self._params: list[torch.Tensor] = []  # the parameters, in the order of ``_average``
        self._restored = False
        self._started = False

    def attach(self, trainer: Any) -> WeightEMA:
        model = trainer.model
        params = {_local(p).data_ptr(): p for p in model.parameters() if p.is_floating_point()}
        names = {  # the names a checkpoint gives the parameters (no DDP or compile prefixes)
            name: params[_local(value).data_ptr()]
            for name, value in get_model_state_dict(model).items()
            if isinstance(value, torch.Tensor) and _local(value).data_ptr() in params
        }
        with torch.no_grad():
            self._average = {name: p.detach().clone() for name, p in names.items()}
        self._params = list(names.values())
        trainer.add_event_handler(Events.TRAIN_START, self._start, priority=EMA_START)
        trainer.add_event_handler(Events.STEP_END, self._update, priority=EMA_UPDATE)
        trainer.validator.add_weights("ema", self.swapped_in)
        return super().attach(trainer)

    # ------------------------------------------------------------------------------ events
    @torch.no_grad()
    def _start(self) -> None:
        if self._started:  # a later run() continues
            return
        self._started = True
        if not self._restored:
            torch._foreach_copy_(*self._locals())

    @torch.no_grad()
    def _update(self) -> None:
        trainer = self.trainer
        if trainer.control.decided.skip:  # no optimizer step was committed
            return
        on_device = trainer.control.device_skip  # a skip decided on the device: read it (one read)
        if on_device is not None and bool(on_device > 0):
            return
        step = trainer.state.step
        if step <= self.start_step:
            torch._foreach_copy_(*self._locals())
        elif every(self.every_steps, step):
            torch._foreach_lerp_(*self._locals(), 1.0 - self.decay)
            self.updates += 1

    def _locals(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(averages, parameters)``, each a rank's own part (a DTensor's local shard), taken
        anew each time (FSDP2 may move a parameter's shard into new storage at its first forward)."""
        return [_local(a) for a in self._average.values()], [_local(p) for p in self._params]

    # ------------------------------------------------------------------------------ public
    @property
    def average(self) -> dict[str, torch.Tensor]:
        """The average by parameter name (as checkpoints name it); read-only."""
        return dict(self._average)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside: the model holds the average; after: its trained weights again (bitwise)."""
        averages, params = self._locals()
        model = self.trainer.model
        with torch.no_grad():
            kept = [p.clone() for p in params]
            _reshard(model)
            torch._foreach_copy_(params, averages)
        try:
            yield
        finally:
            with torch.no_grad():
                _reshard(model)
                torch._foreach_copy_(params, kept)

    # ------------------------------------------------------------------------------ checkpoint
    def tensor_state_dict(self) -> dict[str, torch.Tensor]:
        """The average (the live tensors: a resume fills them in place), saved through DCP."""
        return self._average

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, **{name: getattr(self, name) for name in _SETTINGS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        self._restored = True
        changed = [
            f"ema.{name} {state[name]!r} -> {getattr(self, name)!r}"
            for name in _SETTINGS
            if name in state and state[name] != getattr(self, name)
        ]
        if changed and parallel.rank() == 0:
            logger.info(
                "the moving average continues with this run's settings from the resumed step on "
                "(checkpoint -> this run): %s",
                ", ".join(changed),
            )


def _reshard(model: torch.nn.Module) -> None:
    """FSDP2 keeps the root's gathered parameters after a forward without gradients: drop them, so
    the next forward gathers the weights now in the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
