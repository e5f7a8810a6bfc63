"""Tensors in a checkpoint's data files as their bytes: every dtype and shape comes back exactly
(views, scalars, empty tensors, bf16, bool, complex), parts of an entry load into smaller targets,
checkpoints whose entries are ``torch.save`` archives still load, DCP's own reader refuses these
entries by name instead of misreading them, and a damaged or crafted descriptor is refused."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hookloop.engine.checkpoint_format import tensor_bytes
from hookloop.engine.checkpoint_format.manifest import RecordingWriter
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "i64": torch.arange(-5, 5),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(41.5),
        "step": torch.tensor(12, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # not contiguous
        "slice": base[1:4, ::2],  # a view into a larger storage
        "big": torch.randn(600, 600, generator=g),  # over the size written beside its checksum
    }


def _save(state: dict, path) -> RecordingWriter:
    writer = RecordingWriter(path, rank=0)
    with quiet_single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def _load(target: dict, path) -> dict:
    with quiet_single_process():
        dcp.load(target, storage_reader=SafeReader(path), no_dist=True)
    return target


def test_every_dtype_and_shape_comes_back_exactly_and_the_entries_are_their_bytes(tmp_path):
    state = _state()
    _save(state, tmp_path)
    index = SafeReader(tmp_path).read_metadata()
    described = {key.fqn: info for key, info in index.storage_data.items()}
    for name, value in state.items():
        info = described[name]
        assert info.transform_descriptors == [tensor_bytes.descriptor(value)], name
        assert info.length == value.numel() * value.element_size(), name  # nothing around the bytes
    target = {name: torch.full_like(value, 7).contiguous() for name, value in state.items()}
    loaded = _load(target, tmp_path)
    for name, value in state.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name


def test_a_non_contiguous_target_and_a_part_of_an_entry_load_too(tmp_path):
    whole = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    _save({"w": whole}, tmp_path)
    target = torch.zeros(8, 6).t()  # the stored shape, strided the other way
    assert _load({"w": target}, tmp_path)["w"].equal(whole)

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = SafeReader(tmp_path)
    index = reader.read_metadata()
    reader.set_up_storage_reader(index, True)
    part = torch.zeros(2, 3)

    class Planner:
        def resolve_tensor(self, item):
            return part

        def commit_tensor(self, item, tensor):
            assert tensor.data_ptr() == part.data_ptr()

    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w"),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", torch.Size([0, 0]), 0),
        storage_offsets=torch.Size([2, 4]),
        lengths=torch.Size([2, 3]),
    )
    reader.read_data(LoadPlan([item]), Planner()).wait()
    assert part.equal(whole[2:4, 4:7])


def test_a_checkpoint_of_torch_save_archives_still_loads(tmp_path):
    state = {"w": torch.randn(4, 4), "n": 3, "v": torch.arange(5)}
    with quiet_single_process():
        dcp.save(state, checkpoint_id=tmp_path, no_dist=True)  # DCP's own writer
    loaded = _load({"w": torch.zeros(4, 4), "n": 0, "v": torch.zeros(5, dtype=torch.int64)}, tmp_path)
    assert loaded["w"].equal(state["w"]) and loaded["v"].equal(state["v"]) and loaded["n"] == 3


def test_dcps_own_reader_refuses_these_entries_by_name(tmp_path):
    _save({"w": torch.randn(4, 4)}, tmp_path)
    with pytest.raises(BaseException, match="hookloop.raw"):
        with quiet_single_process():
            dcp.load({"w": torch.zeros(4, 4)}, storage_reader=FileSystemReader(tmp_path), no_dist=True)


@pytest.mark.parametrize(
    "descriptor, message",
    [
        ("hookloop.raw/float32:4,5", "needs 80 bytes"),  # a shape that is not what was written
        ("hookloop.raw/float99:4,4", "is not a dtype and a shape"),
        ("hookloop.raw/float32:4,-4", "is not a dtype and a shape"),
        ("hookloop.raw/float32:4,x", "is not a dtype and a shape"),
        ("hookloop.raw/Tensor:4,4", "is not a dtype and a shape"),  # torch attributes are not dtypes
        ("hookloop.raw/qint8:4,16", "is not a dtype and a shape"),  # never written as bytes
        ("hookloop.raw/float32:4294967296,4294967296,0", "needs 0 bytes"),  # nothing to read: refused
        ("hookloop.raw/float32:1099511627776,1099511627776", "needs 4835703278458516698824704 bytes"),
    ],
)
def test_a_crafted_descriptor_is_refused_with_the_entry_named(tmp_path, descriptor, message):
    _save({"w": torch.randn(4, 4)}, tmp_path)
    index_path = tmp_path / ".metadata"
    index = pickle.loads(index_path.read_bytes())
    for info in index.storage_data.values():
        info.transform_descriptors = [descriptor]
    index_path.write_bytes(pickle.dumps(index))  # no marker here: nothing to check it against
    with pytest.raises(BaseException, match=message) as raised:
        _load({"w": torch.zeros(4, 4)}, tmp_path)
    assert "'w'" in str(raised.value)


def test_an_entry_past_the_end_of_its_file_is_refused(tmp_path):
    _save({"w": torch.randn(16, 16)}, tmp_path)
    (data,) = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(BaseException, match="past the end of its file"):
        _load({"w": torch.zeros(16, 16)}, tmp_path)
