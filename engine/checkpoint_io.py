"""What a checkpoint looks like on disk, and how to read it without trusting it.

Layout of a checkpoint directory::

    <directory>/
        step_00000100/          one complete checkpoint per saved step
            .metadata           DCP's index (model + optimizer, sharded)
            __0_0.distcp ...    DCP's data files, one or more per rank
            rank_00000.json     per-rank state: counters, LR scheduler, handlers, data position, RNG
            .complete           the completion marker, written last, after every rank is durable
        step_00000200.partial-<session>/   a save in flight (or torn by a crash): never loaded
        latest                  the name of the newest complete checkpoint (write, fsync, rename)

A save writes into a ``.partial-<session>`` directory; once every rank's data is durable, rank 0
writes ``.complete`` into it, renames it to ``step_N`` and then moves ``latest``. A reader therefore
only ever considers ``step_N`` directories that hold ``.complete``.

Nothing here unpickles arbitrary objects: DCP's ``.metadata`` is read with an unpickler that admits
only DCP's own metadata classes, non-tensor DCP entries are loaded with ``weights_only=True``, and
the per-rank state is JSON (tensors and RNG states are base64 inside it).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from engine.errors import HookloopError

__all__ = [
    "MARKER",
    "CheckpointError",
    "SafeLoadPlanner",
    "SafeReader",
    "capture_rng",
    "complete_checkpoints",
    "data_generators",
    "decode",
    "encode",
    "fsync_dir",
    "is_complete",
    "parse_step",
    "read_json",
    "read_latest",
    "restore_rng",
    "step_dir_name",
    "write_json_atomic",
    "write_latest",
]

MARKER = ".complete"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(HookloopError, RuntimeError):
    """A checkpoint could not be written or read (missing, incomplete, from another model, unsafe)."""


# ---------------------------------------------------------------------------------------- layout
def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a complete-checkpoint directory name (``step_00000100`` -> 100), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(directory: str | os.PathLike) -> tuple[list[tuple[int, str]], list[str]]:
    """``([(step, path), ...] newest first, [torn step directories])`` found in ``directory``."""
    complete, torn = [], []
    if not os.path.isdir(directory):
        return complete, torn
    for name in os.listdir(directory):
        step = parse_step(name)
        path = os.path.join(directory, name)
        if step is None or not os.path.isdir(path):
            continue
        (complete.append((step, path)) if is_complete(path) else torn.append(path))
    complete.sort(reverse=True)
    return complete, sorted(torn)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_latest(directory: str | os.PathLike) -> str | None:
    """The directory name ``latest`` points to, or None."""
    path = os.path.join(directory, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_latest(directory: str | os.PathLike, name: str) -> None:
    path = os.path.join(directory, LATEST)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


# ------------------------------------------------------------------------------- JSON state codec
def encode(obj: Any, where: str = "state") -> Any:
    """A JSON-able form of ``obj``: tensors, numpy arrays, tuples and non-string dict keys are
    tagged so :func:`decode` restores them exactly. Anything else is refused, naming ``where``."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.numel() and t.dtype != torch.bool else t
        data = raw.numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": base64.b64encode(data).decode(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(obj, np.ndarray):
        return {
            "__ndarray__": base64.b64encode(obj.tobytes()).decode(),
            "dtype": obj.dtype.str,
            "shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(
            k.startswith("__") and k.endswith("__") for k in obj
        ):
            return {k: encode(v, f"{where}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(
        f"{where} holds a {type(obj).__name__}, which a checkpoint cannot store safely; state_dict() "
        "must return tensors, numbers, strings, bools, None, lists, tuples and dicts of these"
    )


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        dtype = getattr(torch, obj["dtype"])
        data = bytearray(base64.b64decode(obj["__tensor__"]))
        if not data:
            return torch.empty(obj["shape"], dtype=dtype)
        if dtype == torch.bool:
            return torch.frombuffer(data, dtype=torch.bool).reshape(obj["shape"]).clone()
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        raw = base64.b64decode(obj["__ndarray__"])
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if "__tuple__" in obj:
        return tuple(decode(v) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(decode(k)): decode(v) for k, v in obj["__items__"]}
    return {k: decode(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# ------------------------------------------------------------------------------------ RNG states
def capture_rng(generators: Iterable[torch.Generator] = ()) -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, every CUDA device) and those of
    ``generators``, in the JSON-able form :func:`encode` produces."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": [g.get_state() for g in generators],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return encode(state, "rng")


def restore_rng(encoded: dict[str, Any], generators: Iterable[torch.Generator] = ()) -> None:
    state = decode(encoded)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state.get("cuda"):
        torch.cuda.set_rng_state_all(state["cuda"])
    for g, s in zip(generators, state.get("generators", ())):
        g.set_state(s)


def data_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that decide a data source's order (a DataLoader's
    ``generator``, its sampler's and batch sampler's), each once."""
    found: list[torch.Generator] = []
    candidates = [data]
    for attr in ("sampler", "batch_sampler"):
        sub = getattr(data, attr, None)
        if sub is not None:
            candidates.append(sub)
            candidates.append(getattr(sub, "sampler", None))
    for obj in candidates:
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return found


# ------------------------------------------------------------------------------- safe DCP reading
_METADATA_MODULE_PREFIX = "torch.distributed.checkpoint."
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, torch dtypes/sizes/layouts and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        if module.startswith(_METADATA_MODULE_PREFIX):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # classes (dataclasses, enums) only, never functions
                return obj
        raise pickle.UnpicklingError(f"{module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's file reader, but its ``.metadata`` index is unpickled with an allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"{path} refers to {e}, which is not part of a DCP checkpoint index; refusing to "
                "unpickle it (only checkpoints written by torch.distributed.checkpoint load)"
            ) from None
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries loaded by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint entry {fqn!r} needs arbitrary unpickling ({str(e).splitlines()[0]}); "
                "refusing to load it"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
