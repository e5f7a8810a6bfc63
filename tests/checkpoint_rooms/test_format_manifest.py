"""The manifest: checksums that match what is on disk, a marker whose manifest is read only when
well formed (never a name that leads out of the checkpoint), and RecordingWriter, DCP's writer that
records every file it made durable and whether the saved state is finite."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hookloop.engine.checkpoint_format.directory import MARKER, write_json_atomic
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.manifest import (
    RecordingWriter,
    all_finite,
    checksum_files,
    file_checksum,
    make_manifest,
    read_manifest,
    read_marker,
)
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process


def test_checksums_are_crc32_of_the_whole_file_read_either_way(tmp_path):
    data = os.urandom(5 << 20) + b"tail"  # more than one read chunk
    (tmp_path / "f").write_bytes(data)
    expected = (len(data), f"{zlib.crc32(data):08x}")
    assert file_checksum(tmp_path / "f") == expected == file_checksum(tmp_path / "f", mapped=True)
    (tmp_path / "empty").write_bytes(b"")
    assert file_checksum(tmp_path / "empty", mapped=True) == (0, "00000000")
    entries = checksum_files(tmp_path, ["f", "empty", "f"], rank=3)
    assert entries["empty"] == {"size": 0, "checksum": "00000000", "rank": 3}
    assert entries["f"] == {"size": expected[0], "checksum": expected[1], "rank": 3} and len(entries) == 2


def marker_with(tmp_path, manifest) -> str:
    write_json_atomic(tmp_path / MARKER, {"step": 1, "manifest": manifest})
    return str(tmp_path)


def test_a_well_formed_manifest_reads_back_and_a_marker_without_one_is_unverified(tmp_path):
    entries = {"a.distcp": {"size": 1, "checksum": "00000001", "rank": 0}}
    assert read_manifest(marker_with(tmp_path, make_manifest(entries))) == entries
    write_json_atomic(tmp_path / MARKER, {"step": 1})
    assert read_manifest(tmp_path) is None


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({"algorithm": "md5", "files": {}}, "checksum algorithm 'md5' is not 'crc32'"),
        ({"algorithm": "crc32", "files": []}, "not a JSON object with a 'files' object"),
        ({"algorithm": "crc32", "files": {"../x": {"size": 1, "checksum": "0"}}}, "malformed manifest entry"),
        ({"algorithm": "crc32", "files": {"a/b": {"size": 1, "checksum": "0"}}}, "malformed manifest entry"),
        ({"algorithm": "crc32", "files": {"..": {"size": 1, "checksum": "0"}}}, "malformed manifest entry"),
        ({"algorithm": "crc32", "files": {"a": {"size": "1", "checksum": "0"}}}, "malformed manifest entry"),
    ],
)
def test_a_malformed_manifest_is_refused(tmp_path, manifest, message):
    with pytest.raises(CheckpointError, match=message):
        read_manifest(marker_with(tmp_path, manifest))


def test_a_marker_that_is_not_a_json_object_is_refused(tmp_path):
    (tmp_path / MARKER).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a JSON object"):
        read_marker(tmp_path)
    (tmp_path / MARKER).write_text("{")
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_marker(tmp_path)


def test_the_recording_writer_lists_every_file_it_wrote_with_its_checksum(tmp_path):
    state = {"w": torch.randn(8, 8), "b": torch.zeros(3)}
    writer = RecordingWriter(tmp_path, rank=0, checked={"w", "b"})
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert set(writer.entries) == set(os.listdir(tmp_path)) and ".metadata" in writer.entries
    for name, entry in writer.entries.items():
        assert (entry["size"], entry["checksum"]) == file_checksum(tmp_path / name) and entry["rank"] == 0
    assert writer.finite is True


def test_the_recording_writer_says_when_a_checked_tensor_is_not_finite(tmp_path):
    state = {"w": torch.tensor([1.0, float("inf")]), "mask": torch.tensor([float("-inf")])}
    writer = RecordingWriter(tmp_path, checked={"w"})
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.finite is False
    assert all_finite(state, ["mask"]) is False and all_finite(state, ["missing"]) is True
    assert all_finite({"ok": torch.ones(2)}, ["ok"]) is True
