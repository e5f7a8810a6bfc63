"""The files a checkpoint writer makes: each one's size and CRC-32 recorded as it is written (large
writes checksummed beside their copy, small ones gathered), renames followed, nothing recorded for
a file whose write failed; a large entry's whole pages written to the disk directly, and every byte
still written where a file system refuses that; and the rank state file written in place with its
checksum."""

from __future__ import annotations

import errno
import fcntl
import os
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hookloop.engine.checkpoint_format import durable_files
from hookloop.engine.checkpoint_format.durable_files import ChecksummingFileSystem, write_durable
from hookloop.engine.checkpoint_format.manifest import RecordingWriter, all_finite, file_checksum
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process
from tests.checkpoint_rooms import fakes


def test_streams_record_the_size_and_crc32_of_what_they_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(durable_files, "WRITEBACK_CHUNK", 1 << 20)  # writeback started mid-file
    fs = ChecksummingFileSystem()
    pieces = [b"header", os.urandom(3 << 20), b"x" * 100, os.urandom((1 << 20) - 1), bytearray(b"end")]
    try:
        with fs.create_stream(tmp_path / "data.tmp", "wb") as stream:
            for piece in pieces:
                assert stream.write(memoryview(piece)) == len(piece)
            assert stream.tell() == sum(map(len, pieces))
        fs.rename(tmp_path / "data.tmp", tmp_path / "data")
    finally:
        fs.close()
    whole = b"".join(pieces)
    assert (tmp_path / "data").read_bytes() == whole
    assert fs.entries == {"data": (len(whole), zlib.crc32(whole))}
    assert file_checksum(tmp_path / "data") == (len(whole), f"{zlib.crc32(whole):08x}")


def test_a_file_left_for_reuse_is_written_over_and_cut_to_its_new_size_a_link_never(tmp_path):
    reuse = tmp_path / "reuse"
    reuse.mkdir()
    (reuse / "__0_0.distcp").write_bytes(os.urandom(3 << 20))  # larger than what comes
    inode = os.stat(reuse / "__0_0.distcp").st_ino
    outside = tmp_path / "outside"
    outside.write_bytes(b"not a checkpoint's")
    os.symlink(outside, reuse / "__1_0.distcp")
    fs = ChecksummingFileSystem(reuse)
    data = {name: os.urandom((1 << 20) + 5) for name in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp")}
    try:
        for name, payload in data.items():
            with fs.create_stream(tmp_path / name, "wb") as stream:
                stream.write(memoryview(payload))
    finally:
        fs.close()
    for name, payload in data.items():
        assert (tmp_path / name).read_bytes() == payload and not os.path.islink(tmp_path / name)
        assert fs.entries[name] == (len(payload), zlib.crc32(payload))
    assert os.stat(tmp_path / "__0_0.distcp").st_ino == inode  # the same file, written over
    assert outside.read_bytes() == b"not a checkpoint's"  # a link is never written through
    assert os.listdir(reuse) == ["__1_0.distcp"]


def test_a_stream_whose_write_failed_records_nothing(tmp_path):
    fs = ChecksummingFileSystem()
    with pytest.raises(RuntimeError), fs.create_stream(tmp_path / "data", "wb") as stream:
        stream.write(b"partial")
        raise RuntimeError("serialization failed")
    fs.close()
    assert fs.entries == {} and stream.closed


def test_multi_dimensional_buffers_are_written_and_checksummed_as_bytes(tmp_path):
    array = torch.arange(1 << 19, dtype=torch.float32).reshape(512, 1024).numpy()  # 2 MiB
    fs = ChecksummingFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(memoryview(array))
    fs.close()
    assert fs.entries["a"] == (array.nbytes, zlib.crc32(array.tobytes()))


def test_write_durable_returns_what_a_reader_computes(tmp_path):
    data = b'{"a": 1}'
    assert write_durable(tmp_path / "rank.json", data) == (8, zlib.crc32(data))
    assert file_checksum(tmp_path / "rank.json") == (8, f"{zlib.crc32(data):08x}")


def test_a_save_through_the_writer_is_checksummed_as_on_disk_and_loads(tmp_path):
    state = {"w": torch.randn(1024, 1024), "b": torch.zeros(3), "n": 7}
    writer = RecordingWriter(tmp_path, rank=0, checked={"w", "b"})
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
        loaded = {"w": torch.zeros(1024, 1024), "b": torch.ones(3), "n": 0}
        dcp.load(loaded, storage_reader=SafeReader(tmp_path), no_dist=True)
    for name, entry in writer.entries.items():
        assert (entry["size"], entry["checksum"]) == file_checksum(tmp_path / name)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["n"] == 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_finite_check_finds_every_nan_and_inf_and_only_those(dtype):
    big = torch.full((1000,), torch.finfo(dtype).max / 2, dtype=dtype)  # finite; its sum overflows
    assert all_finite({"big": big}, ["big"]) is True
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 517, 999):
            t = torch.randn(1000).to(dtype)
            t[where] = bad
            assert all_finite({"t": t, "ok": torch.ones(3, dtype=dtype)}, ["ok", "t"]) is False
    both = torch.zeros(4, dtype=dtype)
    both[1], both[2] = float("inf"), float("-inf")  # cancel out into NaN, still caught
    assert all_finite({"both": both}, ["both"]) is False


def test_the_finite_check_skips_integers_and_reads_complex_tensors():
    assert all_finite({"i": torch.arange(10), "e": torch.empty(0)}, ["i", "e"]) is True
    z = torch.zeros(3, dtype=torch.complex64)
    assert all_finite({"z": z}, ["z"]) is True
    z[1] = complex(0, float("nan"))
    assert all_finite({"z": z}, ["z"]) is False


needs_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


def _misaligned(size: int, shift: int) -> memoryview:
    """``size`` random bytes starting ``shift`` bytes past a page boundary in memory."""
    backing = torch.empty(size + 2 * durable_files.PAGE, dtype=torch.uint8)
    start = (-backing.data_ptr()) % durable_files.PAGE + shift
    view = backing[start : start + size]
    view.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    return memoryview(view.numpy())


@needs_direct
def test_a_placed_large_entry_goes_to_the_disk_in_whole_pages_and_reads_back_exactly(tmp_path, monkeypatch):
    writes = fakes.spy_writes(monkeypatch)
    fs = ChecksummingFileSystem()
    views = [_misaligned((3 << 20) + 123, shift) for shift in (0, 17, 4000)]
    offsets = []
    try:
        with fs.create_stream(tmp_path / "data", "wb") as stream:
            stream.write(b"a small entry first")
            for view in views:
                stream.place(view)
                offsets.append(stream.tell())
                stream.write(view)
    finally:
        fs.close()
    on_disk = (tmp_path / "data").read_bytes()
    for offset, view in zip(offsets, views):
        assert on_disk[offset : offset + len(view)] == view.tobytes()
    gaps = [on_disk[19 : offsets[0]]] + [
        on_disk[offsets[i] + len(views[i]) : offsets[i + 1]] for i in range(len(views) - 1)
    ]
    assert all(
        gap == bytes(len(gap)) and len(gap) < durable_files.PAGE for gap in gaps
    )  # zeros, under a page
    assert fs.entries == {"data": (len(on_disk), zlib.crc32(on_disk))}
    direct = sum(n for n, d, _ in writes if d)
    assert direct >= sum(len(v) - 2 * durable_files.PAGE for v in views)  # all but the edge pages
    assert direct % durable_files.PAGE == 0 and fs.direct
    page = durable_files.PAGE
    assert all(at % page == 0 and n % page == 0 for n, d, at in writes if d)

    def pages(direct: bool) -> set[int]:
        return {
            q for n, d, at in writes if d == direct and n for q in range(at // page, (at + n - 1) // page + 1)
        }

    direct_pages, buffered_pages = pages(True), pages(False)
    assert not direct_pages & buffered_pages  # no page is written both ways


@needs_direct
@pytest.mark.parametrize("refusal", ["fcntl", "write"])
def test_a_file_system_that_refuses_direct_writes_still_gets_every_byte(tmp_path, monkeypatch, refusal):
    """A file system without O_DIRECT (refused as the flag is set) or with a stricter alignment
    (refused at the write): the page cache takes the bytes, and the files after it too."""
    writes = fakes.spy_writes(monkeypatch)
    if refusal == "fcntl":
        real_fcntl = fcntl.fcntl

        def refusing_fcntl(fd, cmd, arg=0):
            if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(fcntl, "fcntl", refusing_fcntl)
    else:
        spying = os.write

        def refusing_write(fd, data):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return spying(fd, data)

        monkeypatch.setattr(os, "write", refusing_write)
    fs = ChecksummingFileSystem()
    views = [_misaligned((2 << 20) + 7, 100), _misaligned(3 << 20, 0)]
    try:
        for i, view in enumerate(views):
            with fs.create_stream(tmp_path / f"f{i}", "wb") as stream:
                stream.write(b"head")
                stream.place(view)
                offset = stream.tell()
                stream.write(view)
            on_disk = (tmp_path / f"f{i}").read_bytes()
            assert on_disk[offset:] == view.tobytes() and on_disk[:4] == b"head"
            assert fs.entries[f"f{i}"] == (len(on_disk), zlib.crc32(on_disk))
    finally:
        fs.close()
    assert not fs.direct and not any(d for _, d, _ in writes)


def test_a_save_of_large_and_odd_tensors_written_directly_over_a_pruned_file_loads_exactly(
    tmp_path, monkeypatch
):
    writes = fakes.spy_writes(monkeypatch) if hasattr(os, "O_DIRECT") else []
    base = torch.randn(2048, 513)
    state = {"odd": torch.randn(1000, 777), "view": base[:, 1:], "b": torch.arange(5.0), "n": 3}
    reuse = tmp_path / "reuse"
    reuse.mkdir()
    (reuse / "__0_0.distcp").write_bytes(
        os.urandom(12 << 20)
    )  # a pruned checkpoint's, longer than what comes
    writer = RecordingWriter(tmp_path / "ckpt", rank=0, checked={"odd", "view", "b"}, reuse=reuse)
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
        loaded = {"odd": torch.zeros(1000, 777), "view": torch.zeros(2048, 512), "b": torch.zeros(5), "n": 0}
        dcp.load(loaded, storage_reader=SafeReader(tmp_path / "ckpt"), no_dist=True)
    for name, entry in writer.entries.items():
        assert (entry["size"], entry["checksum"]) == file_checksum(tmp_path / "ckpt" / name)
    assert all(torch.equal(loaded[k], state[k]) for k in ("odd", "view", "b")) and loaded["n"] == 3
    assert os.path.getsize(tmp_path / "ckpt" / "__0_0.distcp") < 12 << 20 and not os.listdir(reuse)
    if hasattr(os, "O_DIRECT"):
        assert sum(n for n, d, _ in writes if d) > 6 << 20  # both large tensors, all but their edge pages
