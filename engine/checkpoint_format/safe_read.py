"""Reading a checkpoint without trusting it: verifying its files against the manifest, and
reading DCP's index and non-tensor entries through the bounded allowlists of
:mod:`.dcp_pickles`. The whole picture is in :mod:`hookloop.engine.checkpoint_format`."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import stat
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

from hookloop.engine.checkpoint_format import dcp_pickles, tensor_bytes
from hookloop.engine.checkpoint_format.directory import MARKER
from hookloop.engine.checkpoint_format.durable_files import crc32
from hookloop.engine.checkpoint_format.errors import CheckpointError, CheckpointIndexBoundError
from hookloop.engine.checkpoint_format.manifest import CHECKSUM_ALGORITHM, file_checksum, read_manifest
from hookloop.engine.checkpoint_format.pickle_bounds import PickleRefused

__all__ = [
    "SafeLoadPlanner",
    "SafeReader",
    "check_entry",
    "load_metadata",
    "pickle_problems",
    "verify_checkpoint",
    "verify_file",
]


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
    load (:func:`pickle_problems`): a crafted index is damage too, so the loader falls back. An intact
    index larger than ``index_limit`` is no damage but a setting: CheckpointIndexBoundError."""
    try:
        files = read_manifest(path)
    except CheckpointError as e:
        return [str(e)], True
    if files is None:
        return (pickle_problems(path, index_limit) if rank == 0 else []), False
    problems = []
    over: CheckpointIndexBoundError | None = None
    for name, entry in files.items():
        if entry.get("rank", 0) % world_size != rank:
            continue
        problem = verify_file(path, name, entry)
        if problem is not None:
            problems.append(problem)
        elif name == ".metadata":  # intact as written: now whether it is safe to load
            try:
                problems.extend(pickle_problems(path, index_limit))
            except CheckpointIndexBoundError as e:
                over = e
    if over is not None and not problems:
        raise over
    return problems, True


# ------------------------------------------------------------------------------- safe DCP reading
def load_metadata(data: bytes, where: str | os.PathLike, index_limit: int | None = None) -> Any:
    """Unpickle DCP's ``.metadata`` from ``data`` with the allowlist and the bounds of
    :mod:`.dcp_pickles` (an index at most ``index_limit`` bytes, its
    ``METADATA_MAX_BYTES`` by default); ``where`` names the file in the CheckpointError."""
    try:
        return dcp_pickles.load_index(data, index_limit)
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
    ``torch.load(weights_only=True)`` should not be given: see :func:`dcp_pickles.check_entry_pickle`."""
    try:
        dcp_pickles.check_entry_pickle(data)
    except PickleRefused as e:
        raise CheckpointError(
            f"{where} {e}; refusing to load it: the checkpoint is damaged or crafted"
        ) from None
    except Exception as e:  # noqa: BLE001 - a pickle the checker cannot even read
        raise CheckpointError(
            f"{where} is not a readable pickle ({type(e).__name__}: {str(e)[:200]}): "
            "the checkpoint is damaged"
        ) from None


def _read_index(path: str, limit: int | None, written: int | None = None) -> bytes:
    """The bytes of the ``.metadata`` at ``path`` (``written`` bytes long by its manifest, when
    known). More than ``limit`` (:data:`dcp_pickles.METADATA_MAX_BYTES` when None) is a
    CheckpointIndexBoundError, a setting to raise; a size other than the manifest's is damage."""
    limit = dcp_pickles.METADATA_MAX_BYTES if limit is None else limit
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit and written is not None and size != written:
                raise CheckpointError(
                    f"{path} has {size} bytes, its manifest says {written}: the checkpoint is damaged; "
                    "resume from an older one"
                )
            if size > limit:
                raise CheckpointIndexBoundError(path, size, limit, "to read it (nothing was loaded)")
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(
            f"cannot read {path} ({e.strerror}): the checkpoint is damaged or incomplete; resume "
            "from an older one (resume='auto' falls back by itself)"
        ) from None
    if len(data) > limit:
        raise CheckpointError(f"{path} grew past {limit} bytes while it was read; the checkpoint is damaged")
    return data


def pickle_problems(path: str | os.PathLike, index_limit: int | None = None) -> list[str]:
    """What makes checkpoint ``path`` unsafe to load beyond its manifest: its ``.metadata`` must
    unpickle within the bounds and every non-tensor entry must pass :func:`check_entry` (read from
    the data files at the byte ranges the index gives). Empty: loadable. An index over
    ``index_limit`` raises CheckpointIndexBoundError."""
    directory = os.fspath(path)
    where = os.path.join(directory, ".metadata")
    try:
        metadata = load_metadata(_read_index(where, index_limit), where, index_limit)
    except CheckpointIndexBoundError:
        raise  # a setting, not damage: the caller decides
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
        data = _read_index(path, self.index_limit, None if entry is None else entry["size"])
        if entry is not None:
            checksum = f"{crc32(data):08x}"
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

    def read_data(self, plan: Any, planner: Any) -> Any:
        """Read the entries of ``plan``: those held as their bytes (:mod:`.tensor_bytes`) here,
        straight into the tensors they load into when a request covers a whole entry; all others
        (``torch.save`` archives, non-tensor entries) as DCP reads them."""
        others: list[ReadItem] = []
        per_file: dict[str, list[tuple[int, ReadItem, Any]]] = {}  # raw entries: (offset, item, info)
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type != LoadItemType.BYTE_IO and tensor_bytes.is_raw(info.transform_descriptors):
                per_file.setdefault(info.relative_path, []).append((info.offset, item, info))
            else:
                others.append(item)
        for relative_path, entries in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                size = os.fstat(stream.fileno()).st_size
                for _, item, info in sorted(entries, key=lambda entry: entry[0]):
                    self._read_raw(stream, size, path, item, info, planner)
        if others or not per_file:
            return super().read_data(dataclasses.replace(plan, items=others), planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_raw(self, stream: Any, size: int, path: Any, item: ReadItem, info: Any, planner: Any) -> None:
        where = f"checkpoint entry {item.storage_index.fqn[:200]!r} (in {path})"
        dtype, shape = tensor_bytes.geometry(info.transform_descriptors, info.length, where)
        if info.offset + info.length > size:
            raise CheckpointError(
                f"{where} lies past the end of its file ({size} bytes); the checkpoint is damaged"
            )
        target = planner.resolve_tensor(item).detach()
        stream.seek(info.offset)
        whole = list(item.storage_offsets) == [0] * len(shape) and torch.Size(item.lengths) == shape
        direct = target.shape == shape and target.dtype == dtype and target.device.type == "cpu"
        if whole and direct and target.is_contiguous():
            tensor_bytes.read_into(stream, info.length, where, out=target)
        else:
            stored = tensor_bytes.read_into(stream, info.length, where).view(dtype).reshape(shape)
            part = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
            if target.size() != part.size():
                raise CheckpointError(
                    f"{where} holds {tuple(part.size())} for a tensor of {tuple(target.size())}; the "
                    "checkpoint is damaged or was written for another model"
                )
            target.copy_(part)
        planner.commit_tensor(item, target)


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
