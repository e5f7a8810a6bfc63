"""How a checkpoint's data files hold tensors: each tensor's bytes as they are in memory (C order,
little-endian), with nothing around them; its dtype and shape in DCP's index, as the entry's one
transform descriptor (``hookloop.raw/float32:16,64``; a scalar's shape is empty).

DCP itself writes each tensor as a ``torch.save`` zip archive of its own. For a model of many small
tensors that is most of a save's CPU time (156 entries of a tiny Llama: 18 ms one by one against
4 ms for their bytes), and all of it holds the interpreter lock that training needs: an async save
written that way slows the steps beside it. Bytes written as they are also release the lock while
they are copied into the page cache and checksummed.

Readers: :class:`~.safe_read.SafeReader` reads these entries (and entries that a ``torch.save``
archive holds, as checkpoints written before this format do); DCP's own ``FileSystemReader``
refuses them by name (``Unknown extension name='hookloop.raw'``) instead of misreading them.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from hookloop.engine.checkpoint_format.errors import CheckpointError

__all__ = ["NAME", "descriptor", "geometry", "host_bytes", "is_raw", "read_into", "writable"]

#: The transform descriptor's name (what precedes the ``/``).
NAME = "hookloop.raw"


#: Every dtype by its name, but the quantized ones (a quantized tensor is not written as its bytes).
def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {
    _name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype) and not _name(d).startswith("q")
}
_MAX_DIMS = 64


def writable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be written as its bytes: a dense CPU tensor of a plain dtype."""
    return tensor.layout is torch.strided and tensor.device.type == "cpu" and _name(tensor.dtype) in _DTYPES


def descriptor(tensor: torch.Tensor) -> str:
    """The transform descriptor of ``tensor`` written as its bytes."""
    return f"{NAME}/{_name(tensor.dtype)}:{','.join(str(n) for n in tensor.shape)}"


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes in C order (a view of its memory when it is contiguous, else of a copy)."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        raise CheckpointError("checkpoints are written little-endian; this machine is not")
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def is_raw(descriptors: Any) -> bool:
    """Whether an entry's transform descriptors say it holds a tensor's bytes."""
    return (
        isinstance(descriptors, (list, tuple))
        and len(descriptors) == 1
        and isinstance(descriptors[0], str)
        and descriptors[0].startswith(NAME + "/")
    )


def geometry(descriptors: Any, length: int, where: str) -> tuple[torch.dtype, torch.Size]:
    """The dtype and shape an entry's descriptor gives, checked against its ``length`` in bytes
    (a CheckpointError naming ``where`` when they do not fit: the index is damaged or crafted)."""
    _, _, spec = descriptors[0].partition("/")
    name, _, dims = spec.partition(":")
    dtype = _DTYPES.get(name)
    try:
        shape = torch.Size(int(n) for n in dims.split(",")) if dims else torch.Size()
    except ValueError:
        shape = None
    if dtype is None or shape is None or len(shape) > _MAX_DIMS or any(n < 0 for n in shape):
        raise CheckpointError(
            f"{where}: {descriptors[0][:100]!r} is not a dtype and a shape; the index is damaged"
        )
    needed = math.prod(shape) * dtype.itemsize  # in Python: a crafted shape cannot wrap around
    if needed != length:
        raise CheckpointError(
            f"{where}: {descriptors[0][:100]!r} needs {needed} bytes, the index gives {length}; the "
            "checkpoint is damaged"
        )
    return dtype, shape


def read_into(stream: Any, length: int, where: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read ``length`` bytes from ``stream`` (positioned at the entry) into ``out``'s memory (a
    contiguous CPU tensor of exactly that many bytes) or into a new byte tensor; the bytes as a
    ``uint8`` tensor. A file that ends early is a CheckpointError naming ``where``."""
    target = torch.empty(length, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)
    view = memoryview(target.numpy())
    done = 0
    while done < length:
        n = stream.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{where} ends {length - done} bytes early; the checkpoint is damaged")
        done += n
    return target
