"""A running trainer's state beside its model and optimizer, as plain data, and putting it back.

What a run must carry to continue elsewhere: the trainer's counters, the LR scheduler, every
registered stateful handler, the data position, the RNG states and what the run last reported.
:func:`capture` makes it a JSON-able dict (tensors encoded by
:mod:`engine.checkpoint_format.state_codec`); :func:`apply` puts such a dict back into a running
trainer. Two users: the checkpointer writes it to disk beside DCP's model and optimizer (its per-rank
state file, ``handlers.checkpoint.rank_state``), and the replica groups of a fault-tolerant run send
it to a recovering group with the model and optimizer (the replica groups' handler). No file is
read or written here.

How it is applied depends on when:

- ``resume`` (TRAIN_START, before the first epoch starts): every counter, the last reported loss
  and metrics, and the loop and data put back at the saved position.
- otherwise mid-run (a rollback, a heal at a step boundary): the counters of events fired
  (:data:`EVENT_COUNTERS`) and the epoch stay monotonic unless ``keep_counters`` is false; the data
  is rewound to the saved position unless ``keep_data_position``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hookloop.engine import rng
from hookloop.engine.checkpoint_format.state_codec import decode, encode
from hookloop.engine.handler import handler_state_key

__all__ = ["EVENT_COUNTERS", "apply", "capture", "restore_tensor_states", "tensor_states"]

logger = logging.getLogger("hookloop.handlers.checkpoint")

#: Counters that count events fired (filters read them): a rollback keeps them monotonic.
EVENT_COUNTERS = ("microbatches_seen", "validations", "checkpoints_saved", "rollbacks", "skipped_steps")


def capture(trainer: Any) -> dict[str, Any]:
    """The trainer's state beside its model and optimizer, JSON-able: ``counters``,
    ``epoch_length``, ``lr_scheduler``, ``handlers`` (by state key), ``data`` (the position),
    ``rng`` and ``last`` (the loss and numeric metrics last reported)."""
    state = trainer.state
    handlers = {}
    for key, obj in trainer.stateful.items():
        handlers[key] = encode(obj.state_dict(), f"handler {key!r} state_dict()")
    data = trainer.step_data.state_dict()
    scheduler = trainer.lr_scheduler
    return {
        "counters": state.counters(),
        "epoch_length": state.epoch_length,
        "lr_scheduler": None if scheduler is None else encode(scheduler.state_dict(), "lr_scheduler"),
        "handlers": handlers,
        "data": encode(data, "data position"),
        "rng": rng.capture_rng(rng.data_generators(trainer.step_data.data)),
        # What the run last reported, so a resumed run that trains no further step still says it.
        "last": {"loss": float(state.loss), "metrics": numeric(state.metrics)},
    }


def tensor_states(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The tensor state of every attached handler that keeps one, by state key: what its
    ``tensor_state_dict()`` returns (name -> tensor or DTensor, the live tensors). It travels beside
    the model (the checkpointer's DCP save, a heal's payload), never in :func:`capture`'s JSON."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for handler in trainer.handlers:
        if not callable(getattr(handler, "tensor_state_dict", None)):
            continue
        key = handler_state_key(handler)
        if key in out:
            raise ValueError(
                f"state key {key!r} has tensor state of two handlers: give one of them another state_key"
            )
        state = handler.tensor_state_dict()
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise TypeError(
                f"handler {key!r}: tensor_state_dict() must return a dict of name -> tensor, got "
                f"{type(state).__name__}; keep other values in state_dict()"
            )
        out[key] = state
    return out


def restore_tensor_states(trainer: Any, states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put ``states`` (by state key, as :func:`tensor_states` gives them) back: each tensor copied
    into the handler's live one (unless it is that one, as after DCP's load in place), then handed to
    its ``load_tensor_state_dict`` when it has one."""
    owners = {key: h for h in trainer.handlers if (key := handler_state_key(h)) in states}
    live = tensor_states(trainer)
    with torch.no_grad():
        for key, state in states.items():
            for name, tensor in state.items():
                target = live[key][name]
                if target is not tensor:
                    target.copy_(tensor)
            take = getattr(owners[key], "load_tensor_state_dict", None)
            if callable(take):
                take(state)


def apply(
    trainer: Any,
    snapshot: dict[str, Any],
    *,
    resume: bool,
    keep_data_position: bool = False,
    keep_counters: bool = True,
    skip_handlers: tuple[str, ...] = (),
    after_scheduler: Callable[[], Any] | None = None,
) -> Any:
    """Put ``snapshot`` (a :func:`capture`) back into ``trainer`` (see the module docstring):
    the LR scheduler, then ``after_scheduler()`` (what a resume honours of this run's own settings;
    its value is returned), the handlers (but those in ``skip_handlers``, and mid-run those whose
    ``restore_on_rollback`` is False when ``keep_counters``), the counters, the RNG states, and the
    loop's and data's position."""
    state = trainer.state
    if trainer.lr_scheduler is not None and snapshot.get("lr_scheduler") is not None:
        trainer.lr_scheduler.load_state_dict(decode(snapshot["lr_scheduler"]))
    honoured = after_scheduler() if after_scheduler is not None else None
    _load_handlers(trainer, snapshot.get("handlers", {}), not resume and keep_counters, skip_handlers)
    counters = dict(snapshot["counters"])
    if not resume and keep_counters:
        for name in (*EVENT_COUNTERS, "epoch"):
            counters.pop(name, None)
    elif not resume:
        counters.pop("epoch", None)  # ignite's loop counts the epochs it runs
    position = decode(snapshot["data"]) if snapshot.get("data") is not None else None
    epoch_length = snapshot.get("epoch_length")
    state.load_counters(counters)
    rng.restore_rng(snapshot["rng"], rng.data_generators(trainer.step_data.data))
    state.lr = trainer.rates.write(state.step + 1)  # the schedule's rates at the restored position
    if resume:
        last = snapshot.get("last") or {}
        if "loss" in last:
            state.loss = last["loss"]
        state.metrics.update(last.get("metrics") or {})
        position_data(trainer, position, epoch_length, snapshot["counters"]["epoch"])
    elif not keep_data_position and position is not None:
        # ignite's own count of steps in this epoch is not reset, so after such a rewind EPOCH_END
        # may fire early by the rewound steps; the data order is exact.
        trainer.rewind_data(position)
    return honoured


def position_data(trainer: Any, position: dict | None, epoch_length: int | None, epoch: int) -> None:
    """Before the first epoch starts: counters so ignite re-enters the saved epoch at the saved
    step, and the data source at the saved microbatch."""
    state = trainer.state
    if state.epoch_length is None and epoch_length is not None:
        state.epoch_length = epoch_length
    elif epoch_length is not None and state.epoch_length != epoch_length:
        logger.warning(
            "the data has %s steps per epoch, the checkpoint %s: the data position is not restored exactly",
            state.epoch_length,
            epoch_length,
        )
    steps = position["steps"] if position else 0
    mid_epoch = (
        position is not None and steps > 0 and not (epoch_length is not None and steps >= epoch_length)
    )
    if position is not None and not mid_epoch:
        # The saved epoch was complete: only a stateful source's own position carries over.
        source = position.get("source")
        position = None if source is None else {"microbatches": 0, "steps": 0, "source": source}
    trainer.resume_at(epoch, steps if mid_epoch else 0, position)


def _load_handlers(trainer: Any, states: dict[str, Any], rollback: bool, skip: tuple[str, ...]) -> None:
    registered = trainer.stateful
    for key, obj in registered.items():
        if key in skip or (rollback and getattr(obj, "restore_on_rollback", True) is False):
            continue
        if key not in states:
            logger.warning("handler state %r is not in the checkpoint; it starts fresh", key)
            continue
        obj.load_state_dict(decode(states[key]))
    for key in sorted(set(states) - set(registered) - set(skip)):
        logger.warning("the checkpoint holds state for %r, but no handler registered that key", key)


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The plain numbers among ``metrics`` (0-dim tensors read once), for the snapshot."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(key, str):
            out[key] = float(value)
    return out
