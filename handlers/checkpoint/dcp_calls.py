"""How the checkpoint wing calls ``torch.distributed.checkpoint`` (DCP): the state-dict options
every save and load uses, what of a state dict decides it is known-good and what a background
save must copy first, its single-process warning silenced, its errors in one line, and a Ctrl-C or
exit that reached it kept what it is."""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "SavePlanner",
    "STATE_DICT_OPTIONS",
    "copy_buffers",
    "exact_key",
    "last_line",
    "quiet_single_process",
    "reraise_interrupt",
    "trained_entries",
]

# Optimizer state and hyper-parameters keyed by parameter name, so ranks that hold different
# parameters (pipeline stages) never write the same key.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextmanager
def quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns on every save/load (also from its writer thread) that it
    # assumes one process, which is what we mean: silence exactly that message.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    yield


def last_line(error: BaseException) -> str:
    """The gist of an error: DCP's CheckpointException carries every rank's traceback, last line last."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else repr(error)


def reraise_interrupt(error: BaseException) -> None:
    """A Ctrl-C or exit that reached DCP stays what it is: never a CheckpointError."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        raise error
    failures = getattr(error, "failures", None) if isinstance(error, CheckpointException) else None
    for failure in (failures or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            raise type(inner)() from error


def trained_entries(model_sd: dict[str, Any], optim_sd: dict[str, Any], model: torch.nn.Module) -> set[str]:
    """The entries whose values decide whether a saved state is known-good, by the names DCP gives
    them (``model.<param>``, ``optim.<key>``): the parameters and the optimizer's floating-point
    state. Buffers are left out: a mask buffer may hold -inf on purpose."""
    params = {local_shard(p).data_ptr() for p in model.parameters()}
    entries = {
        f"model.{key}"
        for key, value in model_sd.items()
        if isinstance(value, torch.Tensor) and local_shard(value).data_ptr() in params
    }
    entries.update(
        f"optim.{key}"
        for key, value in optim_sd.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    )
    return entries


def copy_buffers(model_sd: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``model_sd`` with every tensor that is not a parameter (buffers such as BatchNorm statistics,
    which a forward changes) replaced by a copy taken now; parameters stay shared for staging."""
    params = {local_shard(p).data_ptr() for p in model.parameters()}
    return {
        key: value.detach().clone()
        if isinstance(value, torch.Tensor) and local_shard(value).data_ptr() not in params
        else value
        for key, value in model_sd.items()
    }


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


_ATOMS = (bool, int, float, str, type(None))
_SERIALIZED: dict[tuple[type, str], bytes] = {}  # a value's torch.save bytes, by its type and repr
_SERIALIZED_MAX = 4096
_serialized_lock = threading.Lock()


def _plain(value: Any, depth: int = 4) -> bool:
    """An atom, or a tuple or list (nested at most ``depth`` levels) of plain values."""
    if type(value) in _ATOMS:
        return True
    return depth > 0 and type(value) in (tuple, list) and all(_plain(v, depth - 1) for v in value)


def exact_key(value: Any) -> tuple[type, str] | None:
    """``(type, repr)`` of a plain value (an atom, or tuples and lists of them): equal keys only for
    values that are exactly equal (``-0.0``, ``0.0``, ``1``, ``True`` and ``(1,)``, ``[1]`` told
    apart); None for anything else (a tensor, an object)."""
    return (type(value), repr(value)) if _plain(value) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's planner that serializes each small value it has serialized before only once per
    process: the optimizer's hyperparameters (:mod:`.optim_layout`) and other plain values repeat
    from save to save, and ``torch.save`` of each small value costs about as much as of a tensor."""

    def transform_object(self, write_item: Any, object: Any) -> Any:
        key = exact_key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if key is None:
            return super().transform_object(write_item, object)
        with _serialized_lock:
            data = _SERIALIZED.get(key)
        if data is None:
            data = super().transform_object(write_item, object).getvalue()
            with _serialized_lock:
                if len(_SERIALIZED) >= _SERIALIZED_MAX:
                    _SERIALIZED.clear()
                _SERIALIZED[key] = data
        return io.BytesIO(data)
