"""The pickles inside a checkpoint, read without trusting them: allowlisted and bounded.

A DCP checkpoint holds two kinds of pickle: its index (``.metadata``) and, for every entry that is
not a tensor (optimizer hyper-parameters, a module's extra state), the bytes ``torch.save`` wrote.
Someone who can write the checkpoint directory can rewrite both (and the manifest that checks
them), so reading them must neither run code nor let a crafted file crash or stall the run.

*Code*: the index is read by an unpickler that resolves an exact list of DCP's classes and a few
torch values and checks every opcode that calls or fills in something (:class:`MetadataUnpickler`);
non-tensor entries go through ``torch.load(weights_only=True)``.

*Resources*: both kinds pass these bounds, checked while the pickle is read, before anything
depends on it (an entry's pickle is read once by a checker that builds inert stand-ins for every
object, then loaded by torch only if it passed):

* size: an index at most :data:`METADATA_MAX_BYTES`, an entry's pickle at most
  :data:`ENTRY_MAX_BYTES`;
* nesting: no tuple nests deeper than :data:`MAX_DEPTH` (hashing a tuple recurses in C without a
  limit: a million levels crash the interpreter with SIGSEGV);
* calls: every call (REDUCE, NEWOBJ, INST, OBJ) passes at most :data:`MAX_CALL_VALUES` values,
  nested ones included, of which at most :data:`MAX_SAME_HASH` share a hash value; every BUILD fills
  in at most that many fields;
* dictionaries: keys of a fixed kind (in the index: strings and DCP's ``MetadataIndex``; in an
  entry: numbers, strings, bytes, None and small tuples of these) and at most
  :data:`MAX_SAME_HASH` keys of one dictionary with the same hash value (keys crafted to share a
  hash make building a dictionary quadratic: tens of thousands of them take minutes);
* no set opcodes (a protocol-2 ``set(...)`` is a call, bounded as above), memo indices below
  2**32, and in the index no persistent ids or extension codes.

Under these bounds every opcode does a bounded amount of work, so accepting or refusing a pickle
takes time linear in its size: the largest index allowed is decided in seconds, and the crafted
files above are refused at the first value that breaks a bound. A refusal is a :class:`PickleRefused`
saying which bound; the checkpoint code names the file and treats it as damage.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
from typing import Any

import torch

from hookloop.engine.checkpoint_format.pickle_bounds import (
    ATOMS,
    MAX_CALL_VALUES,
    MAX_DEPTH,
    MAX_SAME_HASH,
    BoundedUnpickler,
    PickleRefused,
    show,
    walk,
)

__all__ = [
    "ENTRY_MAX_BYTES",
    "MAX_CALL_VALUES",
    "MAX_DEPTH",
    "MAX_SAME_HASH",
    "METADATA_MAX_BYTES",
    "MetadataUnpickler",
    "PickleRefused",
    "check_entry_pickle",
    "check_index_fields",
    "load_index",
]

#: The largest ``.metadata`` read by default (bytes; the checkpointer's ``max_index_mb`` sets another
#: bound). DCP's index grows with the number of tensors times the number of shards: about 90 kB for a
#: small GPT with AdamW on one rank, 7 MB for a 200-block one (36,000 entries), tens of MB for a large
#: model sharded over hundreds of ranks. Reading is linear in the size, at 3-5 MB/s for the slowest
#: pickles the bounds allow on a quiet 2-core machine, so 8 MiB are decided within about three seconds.
METADATA_MAX_BYTES = 8 << 20
#: The largest pickle of one non-tensor entry (bytes; its tensors' data is stored beside it and does
#: not count). Optimizer hyper-parameters take tens of bytes.
ENTRY_MAX_BYTES = 1 << 20


# ---------------------------------------------------------------------------------- the index
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """Everything a DCP ``.metadata`` pickle of this project may name, by exact module and name.

    Found by reading the globals of real checkpoints the shipped checkpointer wrote (one process,
    DDP, FSDP2 with DTensor shards, pipeline stages; model plus flattened AdamW state): DCP's
    metadata dataclasses and memory-format enum, the storage-info record of its file writer,
    ``torch.Size``, the torch dtypes, torch's layout lookup and ``pathlib.PosixPath`` (the
    checkpoint id). Each is a class or lookup whose construction has no side effect, so it does
    not matter what arguments a pickle calls it with."""
    from torch.distributed.checkpoint import filesystem as dcp_filesystem
    from torch.distributed.checkpoint import metadata as dcp_metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    for name, value in vars(torch).items():  # torch.float32 etc.: values, not callables
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}
_CALLABLE: dict[int, Any] = {}  # id -> what REDUCE, NEWOBJ, INST and OBJ may call
_BUILDABLE: dict[type, frozenset[str]] = {}  # the classes whose instances BUILD may fill in -> fields
_SETSTATE: set[type] = set()  # those of them that take their state through __setstate__
_INDEX_CLASS: list[type] = []  # DCP's MetadataIndex: the one dataclass a dictionary key may be


def _tables() -> dict[tuple[str, str], Any]:
    if not _ALLOWED_GLOBALS:
        allowed = _allowed_globals()
        _CALLABLE.update({id(v): v for v in allowed.values() if callable(v)})  # dtypes are values
        _BUILDABLE.update(
            (v, frozenset(f.name for f in dataclasses.fields(v)))
            for (module, _), v in allowed.items()
            if module.startswith("torch.distributed.checkpoint.") and dataclasses.is_dataclass(v)
        )
        _SETSTATE.update(kind for kind in _BUILDABLE if hasattr(kind, "__setstate__"))
        _INDEX_CLASS.append(allowed[("torch.distributed.checkpoint.metadata", "MetadataIndex")])
        _ALLOWED_GLOBALS.update(allowed)
    return _ALLOWED_GLOBALS


class MetadataUnpickler(BoundedUnpickler):
    """Reads DCP's ``.metadata``, resolving exactly the names of :func:`_allowed_globals`.

    ``find_class`` looks ``(module, name)`` up in a fixed table: no import, no attribute walk
    (``a.b.c`` names), no prefix match, so ``operator.attrgetter``, ``builtins.eval``/``getattr``,
    ``os.system`` and ``torch.distributed.checkpoint.planner.operator.attrgetter`` are refused.
    Every callable on a pickle's stack comes from there, and on top of that every call checks that
    what it calls is in the table, and BUILD only fills in an *instance* of one of DCP's
    dataclasses with its own field names: BUILD on a class would otherwise rewrite that class for
    the whole process (``Metadata.__eq__ = ...``). This is the pure-Python unpickler (the C one
    cannot be checked per opcode): about 6 MB/s here."""

    dispatch = dict(BoundedUnpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            where = f"{str(module)[:100]}.{str(name)[:100]}"
            raise PickleRefused(f"refers to {where}, which is not part of a DCP checkpoint index") from None

    def persistent_load(self, pid: Any) -> Any:
        raise PickleRefused(f"holds a persistent id ({str(pid)[:100]!r})")

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        _tables()

    def call(self, opcode: str, fn: Any, args: tuple, kwargs: dict | None = None) -> Any:
        if _CALLABLE.get(id(fn)) is not fn:
            raise PickleRefused(f"uses {opcode} on {show(fn)}, which is not one of DCP's metadata classes")
        if opcode.startswith("NEWOBJ"):
            return fn.__new__(fn, *args, **(kwargs or {}))
        return fn(*args)

    def load_newobj(self) -> None:  # the most common call in an index: a dataclass, no arguments
        args = self.stack.pop()
        cls = self.stack[-1]
        if args != () or _CALLABLE.get(id(cls)) is not cls:
            self.stack[-1] = self._checked_call("NEWOBJ", cls, args)
        else:
            self.stack[-1] = cls.__new__(cls)

    def build(self, inst: Any, state: Any) -> None:
        kind = type(inst)
        fields = _BUILDABLE.get(kind)
        if fields is None:
            raise PickleRefused(
                f"uses BUILD on {show(inst)}, which is not an instance of DCP's metadata classes"
            )
        if kind in _SETSTATE:
            if type(state) is not tuple:
                raise PickleRefused(f"uses BUILD on a {show(kind)} with state that is not a tuple")
            inst.__setstate__(state)
            return
        # the dataclasses without __setstate__ take a dict of their fields
        values = state[0] if type(state) is tuple and len(state) == 2 and state[1] is None else state
        if type(values) is not dict or not fields.issuperset(values):  # keys passed check_key
            raise PickleRefused(f"uses BUILD on a {show(kind)} with state that is not its fields")
        if kind is _INDEX_CLASS[0]:  # hashed as a key: a name and a shape only
            _check_index_key_fields(values.get("fqn"), values.get("offset"), values.get("index"))
        inst.__dict__.update(values)

    def check_key(self, key: Any) -> None:
        if type(key) is str:
            return
        if type(key) is _INDEX_CLASS[0]:
            _check_index_key_fields(key.fqn, key.offset, key.index)
            return
        raise PickleRefused(f"uses a {show(type(key))} as a dictionary key")

    dispatch[pickle.NEWOBJ[0]] = load_newobj


def _check_index_key_fields(fqn: Any, offset: Any, index: Any) -> None:
    if type(fqn) is not str or not (offset is None or type(offset) is torch.Size):
        raise PickleRefused("holds a MetadataIndex that is not a name and a shape")
    if not (index is None or type(index) is int):
        raise PickleRefused("holds a MetadataIndex whose index is not a number")


def load_index(data: bytes, limit: int | None = None) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, within this module's bounds (an
    index at most ``limit`` bytes, :data:`METADATA_MAX_BYTES` by default) and checked by
    :func:`check_index_fields`. PickleRefused for a broken rule; any other exception means the bytes are
    not a readable pickle."""
    limit = METADATA_MAX_BYTES if limit is None else limit
    if len(data) > limit:
        raise PickleRefused(f"has {len(data)} bytes, more than the {limit} an index may have")
    metadata = MetadataUnpickler(data).load()
    check_index_fields(metadata)
    return metadata


def check_index_fields(metadata: Any) -> None:
    """Refuse a ``Metadata`` whose fields are not what DCP's file reader expects: the entries'
    records, the data files' plain names (a crafted index could otherwise point the reader at any
    file on the machine) and non-negative byte ranges."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    def refuse(what: str) -> None:
        raise PickleRefused(f"is not a DCP checkpoint index: {what}")

    if type(metadata) is not Metadata:
        refuse(f"it holds a {show(type(metadata))}")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        refuse("state_dict_metadata is not a dictionary")
    for name, entry in entries.items():
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            refuse(f"entry {name[:100]!r} is a {show(type(entry))}")
        if type(entry.properties) is not TensorProperties or type(entry.size) is not torch.Size:
            refuse(f"entry {name[:100]!r} has no tensor properties or shape")
        if type(entry.chunks) is not list:
            refuse(f"entry {name[:100]!r} has no list of chunks")
        for chunk in entry.chunks:
            if (
                type(chunk) is not ChunkStorageMetadata
                or type(chunk.offsets) is not torch.Size
                or type(chunk.sizes) is not torch.Size
                or not len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            ):
                refuse(f"entry {name[:100]!r} has a chunk that does not match its shape")
    storage = metadata.storage_data
    if type(storage) is not dict:
        refuse("storage_data is not a dictionary")
    for key, info in storage.items():
        if type(key) is not MetadataIndex or type(info) is not _StorageInfo:
            refuse("storage_data holds something other than file ranges")
        path = info.relative_path
        if type(path) is not str or path in ("", ".", "..") or os.path.basename(path) != path or "\\" in path:
            refuse(f"entry {key.fqn[:100]!r} is stored in {str(path)[:100]!r}, not a file of the checkpoint")
        if not all(type(v) is int and 0 <= v < 1 << 63 for v in (info.offset, info.length)):
            refuse(f"entry {key.fqn[:100]!r} has a byte range that is not two non-negative numbers")
        descriptors = info.transform_descriptors
        if descriptors is not None and (
            type(descriptors) not in (list, tuple) or not all(type(d) is str for d in descriptors)
        ):
            refuse(f"entry {key.fqn[:100]!r} has transform descriptors that are not names")
    planner = metadata.planner_data
    if planner is not None:
        if type(planner) is not dict:
            refuse("planner_data is not a dictionary")
        for path in planner.values():
            if type(path) not in (tuple, list) or not all(type(p) in (str, int) for p in path):
                refuse("planner_data holds something other than state_dict paths")
    meta = metadata.storage_meta
    if meta is not None and type(meta) is not StorageMeta:
        refuse(f"storage_meta is a {show(type(meta))}")
    if metadata.version is not None and type(metadata.version) is not str:
        refuse("version is not a string")


# ------------------------------------------------------------------------------ non-tensor entries
class _Inert:
    """What the entry checker builds for every object torch would build (a class, a tensor, a
    persistent storage): nothing runs, and the shape of the pickle around it is checked."""

    __slots__ = ()


class _EntryChecker(BoundedUnpickler):
    """Reads the pickle of a ``torch.save`` entry with this module's bounds and inert stand-ins for
    every global, call result and persistent id: what ``torch.load(weights_only=True)`` would then
    build has the same nesting, keys and call arguments, all within the bounds."""

    dispatch = dict(BoundedUnpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        return _Inert()

    def persistent_load(self, pid: Any) -> Any:
        walk(pid, "a persistent id")
        return _Inert()

    def call(self, opcode: str, fn: Any, args: tuple, kwargs: dict | None = None) -> Any:
        return _Inert()

    def build(self, inst: Any, state: Any) -> None:
        pass

    def set_item(self, target: Any, key: Any, value: Any) -> None:
        if type(target) is dict:
            target[key] = value
        elif type(target) is not _Inert:  # an OrderedDict or Counter torch builds
            raise PickleRefused(f"sets an item of a {show(type(target))}, which is not a dictionary")

    def check_key(self, key: Any) -> None:
        if isinstance(key, ATOMS):
            return
        if type(key) is tuple and len(key) <= MAX_CALL_VALUES and all(isinstance(a, ATOMS) for a in key):
            return
        raise PickleRefused(f"uses a {show(type(key))} as a dictionary key")


def check_entry_pickle(data: bytes) -> None:
    """Refuse the bytes of a non-tensor checkpoint entry unless ``torch.save`` wrote them (its zip
    format) and their pickle keeps to this module's bounds. Reads the pickle with torch's own
    archive reader, as ``torch.load`` then does."""
    try:
        archive = torch._C.PyTorchFileReader(io.BytesIO(data))
        size = archive.get_record_size("data.pkl") if archive.has_record("data.pkl") else None
    except Exception as e:  # noqa: BLE001 - whatever torch's reader says, it is not torch.save's format
        raise PickleRefused(f"is not in torch.save's format ({str(e).splitlines()[0][:100]})") from None
    if size is None:
        raise PickleRefused("is not in torch.save's format (no data.pkl)")
    if size > ENTRY_MAX_BYTES:
        raise PickleRefused(f"has a {size}-byte pickle, more than the {ENTRY_MAX_BYTES} an entry may have")
    _EntryChecker(archive.get_record("data.pkl")).load()
