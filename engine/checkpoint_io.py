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

Integrity: ``.complete`` is JSON and carries a manifest of every file of the checkpoint, all ranks'::

    {"step": 100, "world_size": 2, "mode": "async", "time": 1700000000.0,
     "manifest": {"algorithm": "crc32",
                  "files": {".metadata":       {"size": 121444, "checksum": "9f2c01ab", "rank": 0},
                            "__0_0.distcp":    {"size": 802816, "checksum": "0c1d2e3f", "rank": 0},
                            "__1_0.distcp":    {...,                                   "rank": 1},
                            "rank_00000.json": {...}, "rank_00001.json": {...}}}}

Each rank checksums the files it wrote while it makes them durable (:class:`RecordingWriter`, on
DCP's writer thread for an async save); rank 0 collects the entries and writes the marker. A loader
verifies the manifest (sizes, then CRC-32 of every listed file; files it does not list are ignored)
before it reads anything else, and treats a checkpoint whose marker has no manifest (written by an
earlier version) as unverified. DCP stores no checksum of its own: without this, flipped bytes
inside a tensor load silently.

Nothing here unpickles arbitrary objects: DCP's ``.metadata`` is checked against the manifest and
then read with an unpickler that resolves only an exact list of DCP's metadata classes and a few
torch values (no module prefixes, no attribute walks, no builtins), non-tensor DCP entries are
loaded with ``weights_only=True``, and the per-rank state is JSON (tensors and RNG states are
base64 inside it). Both pickles are also read within stated bounds (size, nesting, values per
call, keys per hash value: :mod:`engine.checkpoint_pickle`), so a crafted one is refused in time
linear in its size instead of crashing or stalling the reader; verification already checks them,
so a crafted checkpoint is skipped like a damaged one.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import mmap
import os
import pickle
import random
import re
import stat
import threading
import time
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.checkpoint.planner import ReadItem

from hookloop.engine import checkpoint_pickle
from hookloop.engine.checkpoint_pickle import PickleRefused
from hookloop.engine.errors import ConfigError, HookloopError
from hookloop.engine.intra_op import use_one_intra_op_thread

__all__ = [
    "MARKER",
    "CHECKSUM_ALGORITHM",
    "CheckpointError",
    "CheckpointLayoutError",
    "RecordingWriter",
    "SafeLoadPlanner",
    "SafeReader",
    "all_finite",
    "capture_rng",
    "check_entry",
    "check_loadable",
    "checksum_files",
    "complete_checkpoints",
    "data_generators",
    "decode",
    "encode",
    "file_checksum",
    "fsync_dir",
    "fsync_file",
    "is_complete",
    "index_mb",
    "load_metadata",
    "make_manifest",
    "parse_step",
    "read_json",
    "read_latest",
    "read_manifest",
    "read_marker",
    "resolve_checkpoint",
    "restore_rng",
    "step_dir_name",
    "verify_checkpoint",
    "verify_file",
    "write_json_atomic",
    "write_latest",
]

logger = logging.getLogger(__name__)

MARKER = ".complete"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(HookloopError, RuntimeError):
    """A checkpoint could not be written or read (missing, incomplete, from another model, unsafe)."""


class CheckpointLayoutError(CheckpointError, ConfigError):
    """The checkpoint to load holds another model layout (other layers, widths or pipeline split).

    Also a :class:`ConfigError` naming the field that chose the checkpoint (``checkpoint.resume``),
    since the fix is a setting: resume with the layout that wrote it or start fresh. Raised before
    anything is loaded, so the running model and the saved checkpoints are untouched."""


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


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, bool]:
    """``(checkpoint, from_directory)``: the complete checkpoint a path a user gave names. A
    complete ``step_N`` directory is itself; a directory of checkpoints (the ``checkpoints`` folder
    of a run, holding ``step_N`` directories) names its newest complete one (``from_directory``
    True; verifying it on load may still fall back to an older one beside it). Anything else is a
    CheckpointError in one line saying what the path is and what to pass instead; nothing is
    created or changed."""
    path = os.path.abspath(path)
    what = "pass a complete step_N directory or the directory that holds them (its newest complete one loads)"
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; {what}")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is not a directory; {what}")
    if is_complete(path):
        return path, False
    name = os.path.basename(path)
    if parse_step(name) is not None or ".partial-" in name:
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker: it was being written when the run "
            f"stopped, or it is being pruned); {what}"
        )
    try:
        complete, torn = complete_checkpoints(path)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be listed ({e.strerror or e}); {what}") from None
    if complete:
        return complete[0][1], True
    if torn:
        raise CheckpointError(
            f"checkpoint directory {path} holds no complete checkpoint (only incomplete ones, e.g. "
            f"{os.path.basename(torn[-1])}); {what}"
        )
    hint = ""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        hint = f" (did you mean {os.path.join(path, 'checkpoints')}?)"
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {MARKER} marker) nor a directory of checkpoints (no "
        f"step_N directories in it){hint}; {what}"
    )


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Make the contents of the (closed) file at ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so a reader sees the old file or the whole new one."""
    write_text_atomic(path, json.dumps(obj))


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


# ------------------------------------------------------------------------------ integrity manifest
CHECKSUM_ALGORITHM = "crc32"
_READ_CHUNK = 4 << 20


def file_checksum(path: str | os.PathLike, mapped: bool = False) -> tuple[int, str]:
    """``(size, crc32 as 8 hex digits)`` of the regular file at ``path``.

    CRC-32 (``zlib.crc32``) runs at several GB/s here and releases the GIL on large buffers, so the
    background thread that computes it barely touches training. It detects accidental damage
    (flipped or lost bytes, truncation); it is no defence against someone who can rewrite the
    checkpoint (they could rewrite the manifest too): that is the job of the unpickling allowlist.

    ``mapped``: read through ``mmap`` (no copy out of the page cache: 6 GB/s against 4.7 GB/s with
    ``readinto`` for 200 MB on this machine). Only for files this process just wrote and nobody
    truncates: a file truncated under a mapping kills the reader with SIGBUS, so verifying a
    checkpoint on load reads in chunks."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if mapped and size:
            try:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        return len(view), f"{zlib.crc32(view):08x}"
                    finally:
                        view.release()
            except (OSError, ValueError):  # a file system without mmap: read it in chunks
                pass
        crc, size = 0, 0
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
        return size, f"{crc:08x}"


def checksum_files(
    directory: str | os.PathLike, names: Iterable[str], rank: int
) -> dict[str, dict[str, Any]]:
    """Manifest entries ``{name: {"size", "checksum", "rank"}}`` for files ``rank`` wrote in ``directory``."""
    entries = {}
    for name in sorted(set(names)):
        size, checksum = file_checksum(os.path.join(directory, name), mapped=True)
        entries[name] = {"size": size, "checksum": checksum, "rank": rank}
    return entries


def make_manifest(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``manifest`` a completion marker carries: the checksum algorithm and every file's entry."""
    return {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(entries.items()))}


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of checkpoint directory ``path`` as a dict (CheckpointError when it is
    missing or not a JSON object)."""
    marker = os.path.join(path, MARKER)
    try:
        value = read_json(marker)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker} cannot be read ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{marker} is not a JSON object")
    return value


def read_manifest(path: str | os.PathLike) -> dict[str, dict[str, Any]] | None:
    """The files listed in ``path``'s completion marker (``{name: entry}``), or None for a checkpoint
    written before markers carried a manifest. CheckpointError when the marker or manifest is damaged."""
    marker = read_marker(path)
    if "manifest" not in marker:
        return None
    where = os.path.join(path, MARKER)
    manifest = marker["manifest"]
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{where}: the manifest is not a JSON object with a 'files' object")
    if manifest.get("algorithm") != CHECKSUM_ALGORITHM:
        raise CheckpointError(
            f"{where}: checksum algorithm {manifest.get('algorithm')!r} is not {CHECKSUM_ALGORITHM!r}; "
            "this version cannot verify it"
        )
    files = manifest["files"]
    for name, entry in files.items():
        well_formed = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("checksum"), str)
            and isinstance(entry.get("rank", 0), int)
        )
        # Plain names inside the checkpoint directory only: a manifest never sends a reader elsewhere.
        if not well_formed or name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
            raise CheckpointError(f"{where}: malformed manifest entry {name[:80]!r}")
    return files


def verify_file(directory: str | os.PathLike, name: str, entry: dict[str, Any]) -> str | None:
    """What is wrong with file ``name`` against its manifest ``entry`` (None: intact)."""
    path = os.path.join(directory, name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file"
    if st.st_size != entry["size"]:
        return f"{name} has {st.st_size} bytes, the manifest says {entry['size']}"
    try:
        size, checksum = file_checksum(path)
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    if size != entry["size"]:
        return f"{name} changed size while it was read ({size} bytes, the manifest says {entry['size']})"
    if checksum != entry["checksum"]:
        return f"{name} has {CHECKSUM_ALGORITHM} {checksum}, the manifest says {entry['checksum']}"
    return None


def verify_checkpoint(
    path: str | os.PathLike, rank: int = 0, world_size: int = 1, index_limit: int | None = None
) -> tuple[list[str], bool]:
    """Check this rank's share of checkpoint ``path`` against its manifest.

    Returns ``(problems, verified)``: ``problems`` lists what is damaged (empty: intact as far as this
    rank looked), ``verified`` is False for a checkpoint without a manifest (written by an earlier
    version: nothing to check it against). The files are shared out by the rank that wrote them
    (``writer % world_size == rank``), so every file is read once across the ranks, and each rank
    mostly reads what it wrote; the ranks combine their problems before choosing (see the
    checkpointer). Files the manifest does not list are ignored; a listed file that is missing,
    has another size or another checksum is damage, and so is an unreadable marker or manifest. The
    rank that checks ``.metadata`` then also checks that it and every non-tensor entry are safe to
    load (:func:`check_loadable`): a crafted index is damage too, so the loader falls back."""
    try:
        files = read_manifest(path)
    except CheckpointError as e:
        return [str(e)], True
    if files is None:
        return (check_loadable(path, index_limit) if rank == 0 else []), False
    problems = []
    for name, entry in files.items():
        if entry.get("rank", 0) % world_size != rank:
            continue
        problem = verify_file(path, name, entry)
        if problem is not None:
            problems.append(problem)
        elif name == ".metadata":  # intact as written: now whether it is safe to load
            problems.extend(check_loadable(path, index_limit))
    return problems, True


# ------------------------------------------------------------------------------- safe DCP writing
class RecordingWriter(_FileSystemWriter):
    """DCP's file writer that also produces this rank's manifest entries.

    Once DCP has written and closed this rank's data files (and, on the coordinator, ``.metadata``),
    the writer makes them durable itself: it fsyncs each file and the directory while a helper
    thread checksums the same files, so the checksum costs the write only what it takes beyond the
    fsync (at ~6 GB/s it usually takes less). DCP's own fsync is off (``sync_files=False``): it
    syncs before the last buffered bytes are flushed, this one after the file is closed. All of it
    runs where DCP writes: on its background thread for an async save. ``entries`` then holds
    ``{name: {"size", "checksum", "rank"}}``; ``timings`` how long the checksums took and how much
    of that the write waited for beyond its fsyncs.

    It derives from DCP's plain writer, not from ``FileSystemWriter``, on purpose: that one is also an
    ``AsyncStager``, and ``async_save`` would then stage through it instead of the stager it uses
    for a bare path, which would change how (and how fast) async saves copy the state."""

    def __init__(self, path: str | os.PathLike, rank: int = 0, checked: Iterable[str] = ()) -> None:
        super().__init__(path, sync_files=False)
        self.writer_rank = rank
        self.checked = set(checked)
        self.entries: dict[str, dict[str, Any]] = {}
        self.timings = {"checksum": 0.0, "exposed": 0.0, "finite": 0.0}
        self.finite: bool | None = None
        self._owner = threading.get_ident()

    def write_data(self, plan: Any, planner: Any) -> Any:
        if threading.get_ident() != self._owner:  # DCP's background thread (async_save): copies of
            use_one_intra_op_thread()  # views must not start an OpenMP team beside training's
        outcome: dict[str, Any] = {}
        helper = None
        if self.checked:  # beside the write: the state as DCP writes it (the host copy when staged)

            def check() -> None:
                use_one_intra_op_thread()  # isnan/isinf reductions stay off training's cores
                start = time.perf_counter()
                try:
                    outcome["finite"] = all_finite(getattr(planner, "state_dict", {}), self.checked)
                except Exception as e:  # noqa: BLE001 - no verdict: the checkpoint is not known-good
                    logger.warning("could not check the saved state for NaN/Inf: %r", e)
                outcome["seconds"] = time.perf_counter() - start

            helper = threading.Thread(target=check, name="hookloop-checkpoint-finite", daemon=True)
            helper.start()
        try:
            future = super().write_data(plan, planner)
            self._make_durable(sorted({result.storage_data.relative_path for result in future.wait()}))
        finally:
            if helper is not None:
                helper.join()
                self.finite = outcome.get("finite")
                self.timings["finite"] += outcome.get("seconds", 0.0)
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        rank = self.rank if (self.rank is not None and not self.use_collectives) else None
        self._make_durable([os.path.basename(self._get_metadata_path(rank))])

    def _make_durable(self, names: list[str]) -> None:
        directory = os.fspath(self.path)
        outcome: dict[str, Any] = {}

        def checksum() -> None:
            start = time.perf_counter()
            try:
                outcome["entries"] = checksum_files(directory, names, self.writer_rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the writing thread below
                outcome["error"] = e
            outcome["seconds"] = time.perf_counter() - start

        helper = threading.Thread(target=checksum, name="hookloop-checkpoint-checksum", daemon=True)
        helper.start()
        try:
            for name in names:
                fsync_file(os.path.join(directory, name))
            fsync_dir(directory)
        finally:
            synced = time.perf_counter()
            helper.join()
            self.timings["exposed"] += time.perf_counter() - synced
        if "error" in outcome:
            raise outcome["error"]
        self.entries.update(outcome["entries"])
        self.timings["checksum"] += outcome["seconds"]


def all_finite(state_dict: dict[str, Any], names: Iterable[str]) -> bool:
    """Whether every tensor of ``state_dict`` (DCP's flattened one) named in ``names`` holds only
    finite values, this rank's shard of a sharded one: one reduction per tensor, one read per
    device."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for name in names:
        value = state_dict.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        to_local = getattr(value, "to_local", None)  # a DTensor's own shard
        local = to_local() if callable(to_local) else value
        flags.setdefault(local.device, []).append(torch.isfinite(local).all())
    return all(bool(torch.stack(device_flags).all()) for device_flags in flags.values())


# ------------------------------------------------------------------------------- safe DCP reading
def load_metadata(data: bytes, where: str | os.PathLike, index_limit: int | None = None) -> Any:
    """Unpickle DCP's ``.metadata`` from ``data`` with the allowlist and the bounds of
    :mod:`engine.checkpoint_pickle` (an index at most ``index_limit`` bytes, its
    ``METADATA_MAX_BYTES`` by default); ``where`` names the file in the CheckpointError."""
    try:
        return checkpoint_pickle.load_index(data, index_limit)
    except PickleRefused as e:
        raise CheckpointError(
            f"{where} {e}; refusing to unpickle it (only checkpoints written by "
            "torch.distributed.checkpoint load). Delete this checkpoint directory; resume='auto' "
            "then loads the previous one"
        ) from None
    except Exception as e:  # truncated or malformed pickle: the damage, not the reader, is at fault
        raise CheckpointError(
            f"{where} is not a readable DCP checkpoint index ({type(e).__name__}: {str(e)[:200]}); "
            "the checkpoint is damaged: delete it or resume from an older one"
        ) from None


def check_entry(data: bytes, where: str) -> None:
    """Refuse (CheckpointError naming ``where``) the bytes of a non-tensor entry that
    ``torch.load(weights_only=True)`` should not be given: see :func:`checkpoint_pickle.check_entry`."""
    try:
        checkpoint_pickle.check_entry(data)
    except PickleRefused as e:
        raise CheckpointError(
            f"{where} {e}; refusing to load it: the checkpoint is damaged or crafted"
        ) from None
    except Exception as e:  # noqa: BLE001 - a pickle the checker cannot even read
        raise CheckpointError(
            f"{where} is not a readable pickle ({type(e).__name__}: {str(e)[:200]}): "
            "the checkpoint is damaged"
        ) from None


def index_mb(size: int) -> float:
    """The smallest ``checkpoint.max_index_mb`` (in tenths of a MiB) that lets an index of ``size``
    bytes be read."""
    return math.ceil(size / 2**20 * 10) / 10


def _read_index(path: str, limit: int | None) -> bytes:
    """The bytes of the ``.metadata`` at ``path``, or CheckpointError when it has more than ``limit``
    (:data:`checkpoint_pickle.METADATA_MAX_BYTES` when None)."""
    limit = checkpoint_pickle.METADATA_MAX_BYTES if limit is None else limit
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise CheckpointError(
                    f"{path} has {size} bytes, more than the {limit} ({limit / 2**20:.3g} MiB) a DCP "
                    "checkpoint index may have (checkpoint.max_index_mb): if this run wrote it, set "
                    f"checkpoint.max_index_mb to at least {index_mb(size):g}; otherwise the checkpoint "
                    "is damaged or crafted: resume from an older one"
                )
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(
            f"cannot read {path} ({e.strerror}): the checkpoint is damaged or incomplete; resume "
            "from an older one (resume='auto' falls back by itself)"
        ) from None
    if len(data) > limit:
        raise CheckpointError(f"{path} grew past {limit} bytes while it was read; the checkpoint is damaged")
    return data


def check_loadable(path: str | os.PathLike, index_limit: int | None = None) -> list[str]:
    """What makes checkpoint ``path`` unsafe to load beyond its manifest: its ``.metadata`` must
    unpickle within the bounds and every non-tensor entry must pass :func:`check_entry` (read from
    the data files at the byte ranges the index gives). Empty: loadable."""
    directory = os.fspath(path)
    where = os.path.join(directory, ".metadata")
    try:
        metadata = load_metadata(_read_index(where, index_limit), where, index_limit)
    except CheckpointError as e:
        return [str(e)]
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    problems = []
    byte_entries = {k for k, v in metadata.state_dict_metadata.items() if type(v) is BytesStorageMetadata}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_entries or info.transform_descriptors:
            continue  # transformed bytes are checked when they are loaded
        name = os.path.join(directory, info.relative_path)
        try:
            with open(name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(min(info.offset, size))
                data = f.read(max(0, min(info.length, size - info.offset)))
        except OSError as e:
            problems.append(f"{name} cannot be read ({e.strerror})")
            continue
        try:
            check_entry(data, f"checkpoint entry {index.fqn[:200]!r} (in {name})")
        except CheckpointError as e:
            problems.append(str(e))
            if len(problems) >= 3:
                break
    return problems


class SafeReader(FileSystemReader):
    """DCP's file reader, but its ``.metadata`` index is checked against the checkpoint's manifest
    (when the directory has one) before any byte of it is unpickled, and then unpickled with an
    exact allowlist (an index at most ``index_limit`` bytes: :func:`load_metadata`)."""

    def __init__(self, path: str | os.PathLike, *, index_limit: int | None = None) -> None:
        super().__init__(path)
        self.index_limit = index_limit

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        directory = os.fspath(self.path)
        name = os.path.basename(path)
        entry = None
        if os.path.exists(os.path.join(directory, MARKER)):
            files = read_manifest(directory)
            if files is not None:
                entry = files.get(name)
                if entry is None:
                    raise CheckpointError(
                        f"{path} is not listed in the manifest of {os.path.join(directory, MARKER)}: "
                        "the checkpoint is damaged; resume from an older one"
                    )
        data = _read_index(path, self.index_limit)
        if entry is not None:
            checksum = f"{zlib.crc32(data):08x}"
            if len(data) != entry["size"] or checksum != entry["checksum"]:
                raise CheckpointError(
                    f"{path} does not match its manifest ({len(data)} bytes, {CHECKSUM_ALGORITHM} "
                    f"{checksum}; recorded {entry['size']} bytes, {entry['checksum']}): the checkpoint "
                    "is damaged; resume from an older one"
                )
        metadata = load_metadata(data, path, self.index_limit)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries loaded by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        check_entry(value.getvalue(), f"checkpoint entry {fqn!r}")
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
