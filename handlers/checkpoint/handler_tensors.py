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

from hookloop.engine import run_snapshot
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.handler import handler_state_key

__all__ = ["HANDLERS", "capture", "restore", "targets"]

logger = logging.getLogger("hookloop.handlers.checkpoint")

#: The top-level key of handler tensor state in a checkpoint's DCP state dict.
HANDLERS = "handlers"


def capture(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every handler's tensor state by state key (the live tensors), for a save."""
    try:
        return run_snapshot.tensor_states(trainer)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot save: {e}") from None


def targets(trainer: Any, stored: dict[str, Any], path: str, *, rollback: bool) -> dict[str, Any]:
    """The tensors DCP fills from checkpoint ``path`` (index entries ``stored``), by state key: each
    handler's that the checkpoint holds (one it does not hold starts fresh, with a warning; on a
    rollback those with ``restore_on_rollback`` False are left alone). A tensor the checkpoint lacks
    or holds in another shape is a CheckpointError naming it, before anything loads."""
    out: dict[str, Any] = {}
    owners = {handler_state_key(h): h for h in trainer.handlers}
    for key, state in capture(trainer).items():
        if rollback and getattr(owners[key], "restore_on_rollback", True) is False:
            continue
        prefix = f"{HANDLERS}.{key}."
        saved = {k.removeprefix(prefix): v for k, v in stored.items() if k.startswith(prefix)}
        if not saved:
            logger.warning("handler tensor state %r is not in the checkpoint %s; it starts fresh", key, path)
            continue
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
    """Hand each handler the tensor state DCP loaded in place for it."""
    run_snapshot.restore_tensor_states(trainer, loaded)
