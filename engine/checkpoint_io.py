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

from hookloop.engine.checkpoint_layout import (
    LATEST,
    MARKER,
    CheckpointError,
    CheckpointIndexBoundError,
    CheckpointLayoutError,
    complete_checkpoints,
    is_complete,
    parse_step,
    read_json,
    read_latest,
    resolve_checkpoint,
    step_dir_name,
    write_json_atomic,
    write_latest,
)
from hookloop.engine.checkpoint_manifest import (
    CHECKSUM_ALGORITHM,
    RecordingWriter,
    all_finite,
    checksum_files,
    file_checksum,
    make_manifest,
    read_manifest,
    read_marker,
)
from hookloop.engine.checkpoint_safe_read import (
    SafeLoadPlanner,
    SafeReader,
    check_entry,
    check_loadable,
    index_mb,
    load_metadata,
    verify_checkpoint,
    verify_file,
)
from hookloop.engine.files import fsync_dir, fsync_file
from hookloop.engine.rng import capture_rng, data_generators, restore_rng
from hookloop.engine.state_codec import decode, encode

__all__ = [
    "LATEST",
    "MARKER",
    "CHECKSUM_ALGORITHM",
    "CheckpointError",
    "CheckpointIndexBoundError",
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
