"""Loading a checkpoint never runs code: crafted ``.metadata`` pickles are refused.

Each payload is a pickle program that, if any of its calls ran, would create a marker file. They are
written into a real checkpoint's ``.metadata`` two ways: with the manifest in ``.complete`` updated
to match (so verification passes and the unpickler itself must refuse), and without (verification
catches the change first and the run falls back to the previous checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import struct
import sys
import zlib

import pytest
import torch

from hookloop.engine import Trainer
from hookloop.engine.checkpoint_format import dcp_pickles
from hookloop.engine.checkpoint_format.dcp_pickles import MetadataUnpickler
from hookloop.engine.checkpoint_format.directory import MARKER, step_dir_name
from hookloop.engine.checkpoint_format.errors import CheckpointIndexBoundError, index_mb
from hookloop.engine.checkpoint_format.safe_read import (
    SafeReader,
    check_entry,
    load_metadata,
    verify_checkpoint,
)
from hookloop.engine.errors import ConfigError
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointError
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import run_process


# ------------------------------------------------------------------------------ pickle programs
def _text(value: str) -> bytes:
    raw = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def _call(fn: bytes, *args: bytes) -> bytes:
    return fn + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def _program(body: bytes) -> bytes:
    return pickle.PROTO + bytes([4]) + body + pickle.STOP


def _shell(marker) -> str:
    return f"touch {marker}"


def payload_os_system(marker) -> bytes:
    """Plain REDUCE of ``os.system``, the way ``__reduce__`` writes it."""

    class Evil:
        def __reduce__(self):
            return (os.system, (_shell(marker),))

    return pickle.dumps(Evil(), protocol=4)


def payload_attrgetter_chain(marker) -> bytes:
    """``torch.distributed.checkpoint.planner`` imports ``operator``: a dotted name walks to
    ``operator.attrgetter``/``itemgetter`` (classes), which then walk from a DCP class's
    ``__init__.__globals__`` to ``os.system``."""
    planner = "torch.distributed.checkpoint.planner"

    def attr(name: str) -> bytes:
        return _call(_global(planner, "operator.attrgetter"), _text(name))

    def item(key: str) -> bytes:
        return _call(_global(planner, "operator.itemgetter"), _text(key))

    dcp_class = _global("torch.distributed.checkpoint.metadata", "Metadata")
    module_globals = _call(attr("__init__.__globals__"), dcp_class)
    os_module = _call(item("os"), module_globals)
    system = _call(attr("system"), os_module)
    return _program(_call(system, _text(_shell(marker))))


def payload_builtins_eval(marker) -> bytes:
    return _program(_call(_global("builtins", "eval"), _text(f"open({str(marker)!r}, 'w')")))


def payload_builtins_getattr(marker) -> bytes:
    """``getattr`` walks from an allowed class to ``os.system`` without any dotted name."""
    getattr_ = _global("builtins", "getattr")
    init = _call(getattr_, _global("torch.distributed.checkpoint.metadata", "Metadata"), _text("__init__"))
    module_globals = _call(getattr_, init, _text("__globals__"))
    get = _call(getattr_, module_globals, _text("get"))
    os_module = _call(get, _text("os"))
    system = _call(getattr_, os_module, _text("system"))
    return _program(_call(system, _text(_shell(marker))))


def payload_nested_name(marker) -> bytes:
    """An attribute walk in the name of an allowed module: ``metadata.os.system``."""
    system = _global("torch.distributed.checkpoint.metadata", "os.system")
    return _program(_call(system, _text(_shell(marker))))


def payload_allowed_class_attribute(marker) -> bytes:
    """A dotted name that starts at an allowed class: ``Metadata.__init__.__globals__``."""
    name = "Metadata.__init__.__globals__"
    module_globals = _global("torch.distributed.checkpoint.metadata", name)
    get = _call(_global("builtins", "getattr"), module_globals, _text("get"))
    return _program(_call(get, _text("os")))


def payload_protocol_0(marker) -> bytes:
    """The classic text-protocol GLOBAL + REDUCE."""
    return f"cos\nsystem\n(V{_shell(marker)}\ntR.".encode()


def payload_inst(marker) -> bytes:
    """INST: find a class by name and call it with the stacked arguments."""
    return f"(V{_shell(marker)}\nios\nsystem\n.".encode()


def payload_build_on_class(marker) -> bytes:
    """BUILD with slot state on an allowed *class*: ``setattr(Metadata, "__eq__", ...)`` would
    rewrite DCP's class for the whole process."""
    metadata = "torch.distributed.checkpoint.metadata"
    slots = pickle.EMPTY_DICT + _text("__eq__") + _global(metadata, "StorageMeta") + pickle.SETITEM
    return _program(_global(metadata, "Metadata") + pickle.NONE + slots + pickle.TUPLE2 + pickle.BUILD)


def payload_build_class_swap(marker) -> bytes:
    """BUILD with slot state on a real instance: ``__class__`` would turn it into another class."""
    metadata = "torch.distributed.checkpoint.metadata"
    instance = _global(metadata, "StorageMeta") + pickle.EMPTY_TUPLE + pickle.NEWOBJ
    slots = pickle.EMPTY_DICT + _text("__class__") + _global(metadata, "Metadata") + pickle.SETITEM
    return _program(instance + pickle.NONE + slots + pickle.TUPLE2 + pickle.BUILD)


def payload_extension_code(marker) -> bytes:
    return pickle.PROTO + bytes([4]) + pickle.EXT1 + bytes([7]) + pickle.STOP


def payload_persistent_id(marker) -> bytes:
    return pickle.PROTO + bytes([4]) + _text(_shell(marker)) + pickle.BINPERSID + pickle.STOP


PAYLOADS = {
    "os_system": payload_os_system,
    "attrgetter_chain": payload_attrgetter_chain,
    "builtins_eval": payload_builtins_eval,
    "builtins_getattr": payload_builtins_getattr,
    "nested_name": payload_nested_name,
    "allowed_class_attribute": payload_allowed_class_attribute,
    "protocol_0": payload_protocol_0,
    "inst": payload_inst,
    "persistent_id": payload_persistent_id,
    "build_on_class": payload_build_on_class,
    "build_class_swap": payload_build_class_swap,
    "extension_code": payload_extension_code,
}


# ------------------------------------------------------------------------------ checkpoints
def _trainer(seed: int = 0) -> Trainer:
    model = tiny_gpt(seed)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


def _write_checkpoints(directory, steps: int = 4) -> None:
    trainer = _trainer()
    AsyncCheckpointer(directory, mode="sync").attach(trainer)
    save_every(trainer, 2)
    trainer.run(token_batches(8, seed=1), max_steps=steps)


def _plant(checkpoint, payload: bytes, *, update_manifest: bool) -> None:
    (checkpoint / ".metadata").write_bytes(payload)
    if update_manifest:  # as if whoever planted it also rewrote the manifest to match
        marker = json.loads((checkpoint / MARKER).read_text())
        marker["manifest"]["files"][".metadata"].update(
            size=len(payload), checksum=f"{zlib.crc32(payload):08x}"
        )
        (checkpoint / MARKER).write_text(json.dumps(marker))


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_crafted_metadata_is_refused_by_the_unpickler_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "owned"
    payload = PAYLOADS[name](marker)
    with pytest.raises(CheckpointError, match="somewhere/.metadata"):
        load_metadata(payload, "somewhere/.metadata")
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_crafted_metadata_with_a_matching_manifest_is_refused_and_the_run_falls_back(tmp_path, name, caplog):
    """The manifest was rewritten to match, so the checksums pass: the unpickler refuses, on the
    direct reader (CheckpointError naming the file), in verification (the checkpoint counts as
    damaged) and through the checkpointer's resume path, which loads the previous checkpoint.
    Nothing runs."""
    marker = tmp_path / "owned"
    _write_checkpoints(tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / step_dir_name(4)
    _plant(newest, PAYLOADS[name](marker), update_manifest=True)
    with pytest.raises(CheckpointError, match=str(newest / ".metadata")):
        SafeReader(newest).read_metadata()
    problems, verified = verify_checkpoint(newest)
    assert verified and len(problems) == 1 and str(newest / ".metadata") in problems[0]
    resumed = _trainer(seed=3)
    checkpointer = AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(resumed)
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        resumed.run(token_batches(8, seed=1), max_steps=6)
    assert checkpointer.resumed_from == str(tmp_path / "ckpt" / step_dir_name(2))
    assert any(str(newest / ".metadata") in r.getMessage() for r in caplog.records)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["os_system", "attrgetter_chain", "builtins_getattr"])
def test_crafted_metadata_without_a_matching_manifest_is_never_unpickled(tmp_path, name, caplog):
    """The manifest check comes first: the changed ``.metadata`` is damage, the run falls back to
    the previous checkpoint and never unpickles a byte of the planted file."""
    marker = tmp_path / "owned"
    _write_checkpoints(tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / step_dir_name(4)
    _plant(newest, PAYLOADS[name](marker), update_manifest=False)
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        SafeReader(newest).read_metadata()
    resumed = _trainer(seed=3)
    checkpointer = AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(resumed)
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        resumed.run(token_batches(8, seed=1), max_steps=5)
    assert checkpointer.resumed_from == str(tmp_path / "ckpt" / step_dir_name(2))
    assert any(str(newest) in r.getMessage() and ".metadata" in r.getMessage() for r in caplog.records)
    assert not marker.exists()


def test_build_cannot_rewrite_an_allowed_class():
    from torch.distributed.checkpoint.metadata import Metadata

    before = dict(vars(Metadata))
    with pytest.raises(CheckpointError, match="BUILD"):
        load_metadata(payload_build_on_class(None), "x/.metadata")
    assert dict(vars(Metadata)) == before


def test_real_metadata_of_every_kind_uses_only_allowlisted_globals(tmp_path):
    """What one process writes (model + flattened AdamW state) loads through the allowlist; the
    distributed layouts (DDP, FSDP2, pipeline stages) load through it in their own tests."""
    _write_checkpoints(tmp_path)
    for step in (2, 4):
        metadata = SafeReader(tmp_path / step_dir_name(step)).read_metadata()
        assert any(k.startswith("optim.state.") for k in metadata.state_dict_metadata)
        assert any(k.startswith("model.") for k in metadata.state_dict_metadata)


def test_allowed_names_cannot_reach_anything_else():
    """Only exact (module, name) pairs resolve: nothing is imported or walked for a name."""
    unpickler = MetadataUnpickler(b"")
    assert unpickler.find_class("torch", "Size") is torch.Size
    assert unpickler.find_class("torch", "bfloat16") is torch.bfloat16
    for module, name in [
        ("torch", "load"),
        ("torch", "Size.__init__"),
        ("torch.distributed.checkpoint.metadata", "os"),
        ("torch.distributed.checkpoint.planner", "operator"),
        ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"),
        ("torch.distributed.checkpoint.state_dict_loader", "load"),
        ("pathlib", "Path.write_text"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
        ("collections", "OrderedDict"),
    ]:
        with pytest.raises(pickle.UnpicklingError):
            unpickler.find_class(module, name)


def test_valid_pickle_that_is_not_an_index_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a DCP checkpoint index"):
        load_metadata(pickle.dumps({"state_dict_metadata": {}}), tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match="not a readable DCP checkpoint index"):
        load_metadata(pickle.dumps([1, 2, 3])[:-3], tmp_path / ".metadata")


# ------------------------------------------------------------------------------ resources
# A crafted pickle that runs no code may still crash the reader (hashing a deeply nested tuple
# recurses in C) or stall it (keys crafted to share one hash make a dictionary quadratic). Each of
# these is refused at the first value that breaks a stated bound.
_P61 = (1 << 61) - 1  # every multiple of this int hashes to 0


def deep_key_pickle(depth: int, protocol: int = 4) -> bytes:
    """``{((...(1,)...),): None}``: a dict whose key is a tuple nested ``depth`` deep."""
    body = pickle.EMPTY_DICT + pickle.BININT1 + b"\x01" + pickle.TUPLE1 * depth + pickle.NONE + pickle.SETITEM
    return pickle.PROTO + bytes([protocol]) + body + pickle.STOP


def int_flood_pickle(n: int, protocol: int = 4) -> bytes:
    """A dict of ``n`` distinct int keys that all hash to 0."""
    keys = b"".join(
        pickle.LONG1 + bytes([10]) + (k * _P61).to_bytes(10, "little", signed=True) + pickle.NONE
        for k in range(1, n + 1)
    )
    body = pickle.EMPTY_DICT + pickle.MARK + keys + pickle.SETITEMS
    return pickle.PROTO + bytes([protocol]) + body + pickle.STOP


def torch_save_raw(payload: bytes) -> bytes:
    """What ``torch.save`` writes, with ``payload`` as its pickle (``data.pkl``)."""

    class Raw:
        def __init__(self, f, protocol=2):
            self.f = f

        def dump(self, obj):
            self.f.write(payload)

    buffer = __import__("io").BytesIO()
    torch.save(None, buffer, pickle_module=type("raw", (), {"__name__": "raw", "Pickler": Raw}))
    return buffer.getvalue()


def _index(checkpoint):
    return dcp_pickles.load_index((checkpoint / ".metadata").read_bytes())


def _rewrite_index(checkpoint, metadata) -> None:
    """Write ``metadata`` as the checkpoint's ``.metadata`` the way DCP does (a plain pickle), with
    the manifest updated to match."""
    _plant(checkpoint, pickle.dumps(metadata), update_manifest=True)


def _plant_entry(checkpoint, entry: bytes) -> str:
    """Point the checkpoint's first non-tensor entry at ``entry`` (in a new data file); its name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = _index(checkpoint)
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if type(v) is BytesStorageMetadata)
    key = next(k for k in metadata.storage_data if k.fqn == fqn)
    (checkpoint / "__planted.distcp").write_bytes(entry)
    metadata.storage_data[key] = _StorageInfo("__planted.distcp", 0, len(entry))
    _rewrite_index(checkpoint, metadata)
    return fqn


def test_a_deeply_nested_tuple_is_refused_at_the_depth_bound(tmp_path):
    where = tmp_path / ".metadata"
    bound = dcp_pickles.MAX_DEPTH
    with pytest.raises(CheckpointError, match=rf"{where} nests tuples more than {bound} levels deep"):
        load_metadata(deep_key_pickle(dcp_pickles.MAX_DEPTH + 1), where)
    with pytest.raises(CheckpointError, match="nests tuples"):  # the million-deep one: no SIGSEGV
        load_metadata(deep_key_pickle(1_000_000), where)
    # a tuple as deep as the bound is no problem of nesting (it is no index either)
    with pytest.raises(CheckpointError, match="dictionary key"):
        load_metadata(deep_key_pickle(dcp_pickles.MAX_DEPTH - 1), where)


def test_dictionary_keys_that_share_a_hash_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = tmp_path / ".metadata"
    with pytest.raises(CheckpointError, match="uses a builtins.int as a dictionary key"):
        load_metadata(int_flood_pickle(20_000), where)
    # DCP's own keys can be crafted to collide too: offsets 0, +-P, +-2P, ... all hash alike.
    colliding = [MetadataIndex("w", torch.Size([k * _P61])) for k in (0, 1, -1, 2, -2, 3, -3, 4, -4)]
    assert len({hash(k) for k in colliding}) == 1 and len(set(colliding)) == 9
    allowed = dict.fromkeys(colliding[: dcp_pickles.MAX_SAME_HASH])
    with pytest.raises(CheckpointError, match="is not a DCP checkpoint index"):  # within the bound
        load_metadata(pickle.dumps(allowed), where)
    bound = dcp_pickles.MAX_SAME_HASH
    with pytest.raises(CheckpointError, match=f"more than {bound} keys with one hash"):
        load_metadata(pickle.dumps(dict.fromkeys(colliding)), where)


def test_calls_sizes_and_file_references_are_bounded(tmp_path, monkeypatch):
    _write_checkpoints(tmp_path / "ckpt")
    checkpoint = tmp_path / "ckpt" / step_dir_name(4)
    where = checkpoint / ".metadata"
    with pytest.raises(CheckpointError, match="passes more than 128 values to REDUCE of torch.Size"):
        load_metadata(pickle.dumps(torch.Size([1] * 200)), where)
    # an index that points the reader at a file outside the checkpoint
    metadata = _index(checkpoint)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key].relative_path = "/etc/passwd"
    _rewrite_index(checkpoint, metadata)
    with pytest.raises(CheckpointError, match="'/etc/passwd', not a file of the checkpoint"):
        SafeReader(checkpoint).read_metadata()
    # a file larger than an index may be is refused before a byte of it is unpickled
    _write_checkpoints(tmp_path / "other")
    intact = tmp_path / "other" / step_dir_name(4)
    monkeypatch.setattr(dcp_pickles, "METADATA_MAX_BYTES", 1000)
    with pytest.raises(CheckpointError, match=r"more than the 1000 \(.*\) this setting lets a run read"):
        SafeReader(intact).read_metadata()
    with pytest.raises(CheckpointIndexBoundError):  # verification too: intact, but over the bound
        verify_checkpoint(intact)


def test_the_index_bound_is_the_checkpointers_setting(tmp_path):
    """``checkpoint.max_index_mb`` bounds the index a resume reads (the module's default is only a
    default): an intact index over it is refused naming the setting and the value that fits, by
    the reader and by verification alike, and the same checkpoints load with that value (the run
    side of it is in test_checkpoint_index_bound.py)."""
    small = int(0.01 * 2**20)  # smaller than a tiny GPT's index (~90 kB)
    _write_checkpoints(tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / step_dir_name(4)
    size = (newest / ".metadata").stat().st_size
    assert size > small and index_mb(size) * 2**20 >= size
    expected = rf"more than the 10485 \(0.01 MiB\).*checkpoint.max_index_mb to at least {index_mb(size):g}"
    with pytest.raises(CheckpointIndexBoundError, match=expected) as info:
        SafeReader(newest, index_limit=small).read_metadata()
    assert isinstance(info.value, ConfigError) and info.value.field == "checkpoint.max_index_mb"
    with pytest.raises(CheckpointIndexBoundError, match=expected):
        verify_checkpoint(newest, index_limit=small)
    assert not verify_checkpoint(newest)[0], "within the default bound it is intact"
    # an index over the bound that is not the one its manifest lists is damage, not a setting
    (newest / ".metadata").write_bytes((newest / ".metadata").read_bytes() + b"\0")
    assert "the manifest says" in str(verify_checkpoint(newest, index_limit=small)[0])
    with pytest.raises(CheckpointError, match="its manifest says") as info:
        SafeReader(newest, index_limit=small).read_metadata()
    assert not isinstance(info.value, ConfigError)
    resumed = _trainer(seed=3)
    checkpointer = AsyncCheckpointer(tmp_path / "ckpt", mode="sync", max_index_mb=1).attach(resumed)
    resumed.run(token_batches(8, seed=1), max_steps=6)
    assert checkpointer.resumed_from == str(tmp_path / "ckpt" / step_dir_name(2))


def test_max_index_mb_is_checked_up_front(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.max_index_mb"):
        AsyncCheckpointer(tmp_path / "ckpt", max_index_mb=0)
    assert not (tmp_path / "ckpt").exists()


def test_non_tensor_entries_are_checked_before_torch_loads_them():
    """Every non-tensor entry passes the same bounds before ``torch.load(weights_only=True)`` sees
    it (torch's own reader crashes on the deep key and takes minutes on the flood)."""
    for value in [(0.9, 0.999), {"extra": torch.ones(2, 3), "ids": [1, 2, (3, 4)], 5: None, "s": {"x"}}]:
        ok = __import__("io").BytesIO()
        torch.save(value, ok)
        check_entry(ok.getvalue(), "entry 'betas'")  # what torch.save writes passes
    for payload, match in [
        (deep_key_pickle(1_000_000, protocol=2), "entry 'x' nests tuples"),
        (int_flood_pickle(20_000, protocol=2), "entry 'x' has more than 8 keys with one hash"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            check_entry(torch_save_raw(payload), "entry 'x'")
    with pytest.raises(CheckpointError, match="not in torch.save's format"):
        check_entry(pickle.dumps(0.9), "entry 'x'")
    big = torch_save_raw(pickle.dumps(b"x" * (dcp_pickles.ENTRY_MAX_BYTES + 10), protocol=2))
    with pytest.raises(CheckpointError, match="pickle, more than the"):
        check_entry(big, "entry 'x'")


# ------------------------------------------------------------------------------ a real resume
_MODEL = """
import torch

def build(dim: int = 16):
    return torch.nn.Sequential(torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256))
"""
_CONFIG = """
model: {target: tiny.py:build}
train: {seq_len: 8, local_batch_size: 2}
step_scheduler: {global_batch_size: 2, max_steps: 8, ckpt_every_steps: 4}
lr: {warmup_steps: 0}
data: {cache_dir: data}
"""


@pytest.fixture(scope="module")
def trained_project(tmp_path_factory):
    """A ``hookloop train`` run with checkpoints of steps 0, 4 and 8 (trained once per module)."""
    project = tmp_path_factory.mktemp("project")
    (project / "tiny.py").write_text(_MODEL)
    (project / "run.yaml").write_text(_CONFIG)
    first = run_process([sys.executable, "-m", "hookloop", "train", "run.yaml"], cwd=project, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    return project


def _plant_deep_index(checkpoint) -> str:
    _plant(checkpoint, deep_key_pickle(1_000_000), update_manifest=True)
    return str(checkpoint / ".metadata")


def _plant_flood_index(checkpoint) -> str:
    _plant(checkpoint, int_flood_pickle(80_000), update_manifest=True)
    return str(checkpoint / ".metadata")


def _plant_deep_entry(checkpoint) -> str:
    fqn = _plant_entry(checkpoint, torch_save_raw(deep_key_pickle(1_000_000, protocol=2)))
    return f"checkpoint entry {fqn!r}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "plant", [_plant_deep_index, _plant_flood_index, _plant_deep_entry], ids=lambda f: f.__name__
)
def test_a_crafted_pickle_in_the_newest_checkpoint_is_skipped_on_resume(trained_project, tmp_path, plant):
    """A 1 MB pickle whose key nests a million deep (the reader crashed with SIGSEGV), one of 80000
    int keys with one hash (minutes), or a non-tensor entry with the deep key, each with a
    manifest that matches: the resume names the file, skips the checkpoint and trains on from the
    previous one, well within the run's timeout."""
    project = tmp_path / "project"
    shutil.copytree(trained_project, project)
    checkpoints = project / "runs" / "run" / "checkpoints"
    named = plant(checkpoints / step_dir_name(8))
    resumed = run_process(
        [sys.executable, "-m", "hookloop", "train", "run.yaml", "step_scheduler.max_steps=10"],
        cwd=project,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {checkpoints / step_dir_name(8)} is damaged" in resumed.stderr
    assert named in resumed.stderr, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / step_dir_name(4)} (step 4)" in resumed.stderr
    status = json.loads((project / "runs" / "run" / "exit_status.json").read_text())
    assert status["code"] == 0 and status["step"] == 10
