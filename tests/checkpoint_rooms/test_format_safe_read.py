"""Verifying a checkpoint against its manifest: each kind of damage is named, the files are shared
out among the ranks by the rank that wrote them, and an index over the bound is a setting (an
error that pickles across ranks), not damage."""

from __future__ import annotations

import os
import pickle

import pytest

from hookloop.engine.checkpoint_format.directory import MARKER, write_json_atomic
from hookloop.engine.checkpoint_format.errors import CheckpointIndexBoundError, index_mb
from hookloop.engine.checkpoint_format.manifest import checksum_files, make_manifest
from hookloop.engine.checkpoint_format.safe_read import verify_checkpoint, verify_file
from tests.checkpoint_rooms import fakes


def test_each_kind_of_damage_to_a_file_is_named(tmp_path):
    (tmp_path / "a").write_bytes(b"abcd")
    entry = checksum_files(tmp_path, ["a"], 0)["a"]
    assert verify_file(tmp_path, "a", entry) is None
    (tmp_path / "a").write_bytes(b"abce")
    now = checksum_files(tmp_path, ["a"], 0)["a"]["checksum"]
    assert verify_file(tmp_path, "a", entry) == f"a has crc32 {now}, the manifest says {entry['checksum']}"
    (tmp_path / "a").write_bytes(b"abc")
    assert verify_file(tmp_path, "a", entry) == "a has 3 bytes, the manifest says 4"
    os.remove(tmp_path / "a")
    assert verify_file(tmp_path, "a", entry) == "a is missing"
    (tmp_path / "a").mkdir()
    assert verify_file(tmp_path, "a", entry) == "a is not a regular file"


def test_the_ranks_share_the_files_by_the_rank_that_wrote_them(tmp_path):
    for name in ("r0", "r1"):
        (tmp_path / name).write_bytes(name.encode())
    entries = {**checksum_files(tmp_path, ["r0"], 0), **checksum_files(tmp_path, ["r1"], 1)}
    write_json_atomic(tmp_path / MARKER, {"step": 1, "manifest": make_manifest(entries)})
    (tmp_path / "r1").write_bytes(b"XX")
    assert verify_checkpoint(tmp_path, rank=0, world_size=2) == ([], True)  # not rank 0's share
    problems, verified = verify_checkpoint(tmp_path, rank=1, world_size=2)
    assert verified and len(problems) == 1 and problems[0].startswith("r1 has crc32 ")
    assert len(verify_checkpoint(tmp_path)[0]) == 1  # one rank reads them all


def test_an_index_over_the_bound_is_a_setting_that_survives_the_trip_between_ranks(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer()
    path = fakes.save(tmp_path, 1, model, optimizer)
    size = os.path.getsize(os.path.join(path, ".metadata"))
    with pytest.raises(CheckpointIndexBoundError) as e:
        verify_checkpoint(path, index_limit=size - 1)
    error = pickle.loads(pickle.dumps(e.value))  # how a rank's error reaches the others
    assert (error.size, error.limit, error.needed) == (size, size - 1, index_mb(size))
    assert error.field == "checkpoint.max_index_mb" and str(error) == str(e.value)
    assert verify_checkpoint(path, index_limit=size) == ([], True)
    assert index_mb(1) == 0.1 and index_mb(2**20) == 1.0 and index_mb(2**20 + 1) == 1.1
