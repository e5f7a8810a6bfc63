"""Handler tensor state: tensors a handler keeps at the model's scale (an average of the weights, a
parameter-shaped statistic) go into the checkpoint through DCP beside the model, never into the
per-rank state file.

A handler with ``tensor_state_dict()`` (name -> tensor or DTensor, the live tensors) has them saved
under ``handlers.<state key>.<name>`` in every checkpoint: sharded as they are (a DTensor made from
an FSDP2 or tensor-parallel parameter is saved as the parameter is), written on the save's own path
(the background write of ``mode="async"`` reads them live until the next optimizer step, as it
reads the parameters), checksummed in the manifest. On resume and rollback (unless the handler's
``restore_on_rollback`` is False) the tensors ``tensor_state_dict()`` returns then are filled in
place by DCP, resharded to this run's layout; a handler whose ``tensor_state_dict()`` returns
copies also defines ``load_tensor_state_dict(sd)``, which is then handed them. A plain tensor is
taken to be the same on every rank (DCP writes it once), as a replicated parameter is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.handler import handler_state_key

__all__ = ["HANDLERS", "capture", "restore", "targets"]

logger = logging.getLogger("hookloop.handlers.checkpoint")

#: The top-level key of handler tensor state in a checkpoint's DCP state dict.
HANDLERS = "handlers"


def _owners(trainer: Any) -> dict[str, Any]:
    """The attached handlers with tensor state, by state key."""
    owners: dict[str, Any] = {}
    for handler in trainer.handlers:
        if not callable(getattr(handler, "tensor_state_dict", None)):
            continue
        key = handler_state_key(handler)
        held = owners.get(key)
        if held is not None:
            raise CheckpointError(
                f"state key {key!r} has tensor state of both {type(held).__name__} and "
                f"{type(handler).__name__}: give one of them another state_key"
            )
        owners[key] = handler
    return owners


def _tensors(key: str, handler: Any) -> dict[str, torch.Tensor]:
    state = handler.tensor_state_dict()
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(
            f"handler {key!r}: tensor_state_dict() must return a dict of name -> tensor, got "
            f"{type(state).__name__}; keep other values in state_dict()"
        )
    return state


def capture(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every handler's tensor state by state key (the live tensors), for a save."""
    return {key: _tensors(key, handler) for key, handler in _owners(trainer).items()}


def targets(trainer: Any, stored: dict[str, Any], path: str, *, rollback: bool) -> dict[str, Any]:
    """The tensors DCP fills from checkpoint ``path`` (index entries ``stored``), by state key: each
    handler's that the checkpoint holds (one it does not hold starts fresh, with a warning; on a
    rollback those with ``restore_on_rollback`` False are left alone). A tensor the checkpoint lacks
    or holds in another shape is a CheckpointError naming it, before anything loads."""
    out: dict[str, Any] = {}
    for key, handler in _owners(trainer).items():
        if rollback and getattr(handler, "restore_on_rollback", True) is False:
            continue
        prefix = f"{HANDLERS}.{key}."
        saved = {k.removeprefix(prefix): v for k, v in stored.items() if k.startswith(prefix)}
        if not saved:
            logger.warning("handler tensor state %r is not in the checkpoint %s; it starts fresh", key, path)
            continue
        state = _tensors(key, handler)
        for name, tensor in state.items():
            size = getattr(saved.get(name), "size", None)
            if size is None or tuple(size) != tuple(tensor.shape):
                have = "is missing" if size is None else f"has shape {tuple(size)}"
                raise CheckpointError(
                    f"checkpoint {path}: handler {key!r} tensor {name!r} {have}, this run's is "
                    f"{tuple(tensor.shape)}; resume with the model and handler settings that wrote it"
                )
        out[key] = state
    return out


def restore(trainer: Any, loaded: dict[str, Any]) -> None:
    """Hand each handler that takes it (``load_tensor_state_dict``) the tensor state DCP loaded in
    place for it."""
    owners = _owners(trainer)
    for key, state in loaded.items():
        take = getattr(owners[key], "load_tensor_state_dict", None)
        if callable(take):
            take(state)
