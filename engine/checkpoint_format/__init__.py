"""The checkpoint format: what a checkpoint looks like on disk, and how to read it without trusting
it. One module per part, imported by its own name (this package hands no names on)::

    errors          CheckpointError and its kinds (another model layout, an index over the bound)
    directory       step_N names, the .complete marker, ``latest``, resolving a path a user gave
    manifest        checksums, the manifest in the marker, RecordingWriter (DCP's writer, recording)
    durable_files   the files RecordingWriter writes: checksummed as written, fsynced once at close
    tensor_bytes    how the data files hold tensors: their bytes, dtype and shape in DCP's index
    safe_read       verify_checkpoint, pickle_problems, SafeReader / SafeLoadPlanner (DCP's reader)
    dcp_pickles     the allowlists for DCP's index and non-tensor entries
    pickle_bounds   the bounded unpickler both are read with
    state_codec     the JSON form of the per-rank state (tensors, arrays, RNG states)

Only ``manifest``, ``durable_files`` and ``safe_read`` import ``torch.distributed.checkpoint`` when
they are imported (their classes extend DCP's); the checkpoint handler imports them to save and load, so
``import hookloop`` does not load DCP.

A directory of checkpoints::

    <directory>/
        step_00000100/          one complete checkpoint per saved step
            .metadata           DCP's index (model + optimizer, sharded)
            __0_0.distcp ...    DCP's data files, one or more per rank (tensors as their bytes)
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

Each rank checksums the files it writes as it writes them and fsyncs each once it is closed
(:class:`RecordingWriter`, on DCP's writer thread for an async save); rank 0 collects the entries
and writes the marker, whose fsync of the directory makes every file's name durable before the
rename to ``step_N``. A loader
verifies the manifest (sizes, then CRC-32 of every listed file; files it does not list are ignored)
before it reads anything else, and treats a checkpoint whose marker has no manifest (written by an
earlier version) as unverified. DCP stores no checksum of its own: without this, flipped bytes
inside a tensor load silently.

Nothing here unpickles arbitrary objects: DCP's ``.metadata`` is checked against the manifest and
its pickles are read allowlisted and bounded (:mod:`.dcp_pickles`), so a crafted one is refused in
time linear in its size; verification already checks them, so a crafted checkpoint is skipped like
a damaged one. The per-rank state is JSON (tensors and RNG states are base64 inside it).
"""
