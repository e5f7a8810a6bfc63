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
import struct
import zlib

import pytest
import torch

from hookloop.engine import Trainer
from hookloop.engine import checkpoint_io as io
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointError
from hookloop.models.gpt import cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches


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
    AsyncCheckpointer(directory, mode="sync", every_steps=2).attach(trainer)
    trainer.run(token_batches(8, seed=1), max_steps=steps)


def _plant(checkpoint, payload: bytes, *, update_manifest: bool) -> None:
    (checkpoint / ".metadata").write_bytes(payload)
    if update_manifest:  # as if whoever planted it also rewrote the manifest to match
        marker = json.loads((checkpoint / io.MARKER).read_text())
        marker["manifest"]["files"][".metadata"].update(
            size=len(payload), checksum=f"{zlib.crc32(payload):08x}"
        )
        (checkpoint / io.MARKER).write_text(json.dumps(marker))


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_crafted_metadata_is_refused_by_the_unpickler_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "owned"
    payload = PAYLOADS[name](marker)
    with pytest.raises(CheckpointError, match="somewhere/.metadata"):
        io.load_metadata(payload, "somewhere/.metadata")
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_crafted_metadata_with_a_matching_manifest_errors_cleanly_on_resume(tmp_path, name):
    """Verification passes (the manifest was rewritten to match): the unpickler refuses, on the
    direct reader and through the checkpointer's resume path, and nothing runs."""
    marker = tmp_path / "owned"
    _write_checkpoints(tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / io.step_dir_name(4)
    _plant(newest, PAYLOADS[name](marker), update_manifest=True)
    assert io.verify_checkpoint(newest) == ([], True)
    with pytest.raises(CheckpointError, match=str(newest / ".metadata")):
        io.SafeReader(newest).read_metadata()
    resumed = _trainer(seed=3)
    AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(resumed)
    with pytest.raises(CheckpointError, match="metadata"):
        resumed.run(token_batches(8, seed=1), max_steps=6)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["os_system", "attrgetter_chain", "builtins_getattr"])
def test_crafted_metadata_without_a_matching_manifest_is_never_unpickled(tmp_path, name, caplog):
    """The manifest check comes first: the changed ``.metadata`` is damage, the run falls back to
    the previous checkpoint and never unpickles a byte of the planted file."""
    marker = tmp_path / "owned"
    _write_checkpoints(tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / io.step_dir_name(4)
    _plant(newest, PAYLOADS[name](marker), update_manifest=False)
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        io.SafeReader(newest).read_metadata()
    resumed = _trainer(seed=3)
    checkpointer = AsyncCheckpointer(tmp_path / "ckpt", mode="sync").attach(resumed)
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        resumed.run(token_batches(8, seed=1), max_steps=5)
    assert checkpointer.resumed_from == str(tmp_path / "ckpt" / io.step_dir_name(2))
    assert any(str(newest) in r.getMessage() and ".metadata" in r.getMessage() for r in caplog.records)
    assert not marker.exists()


def test_build_cannot_rewrite_an_allowed_class():
    from torch.distributed.checkpoint.metadata import Metadata

    before = dict(vars(Metadata))
    with pytest.raises(CheckpointError, match="BUILD"):
        io.load_metadata(payload_build_on_class(None), "x/.metadata")
    assert dict(vars(Metadata)) == before


def test_real_metadata_of_every_kind_uses_only_allowlisted_globals(tmp_path):
    """What one process writes (model + flattened AdamW state) loads through the allowlist; the
    distributed layouts (DDP, FSDP2, pipeline stages) load through it in their own tests."""
    _write_checkpoints(tmp_path)
    for step in (2, 4):
        metadata = io.SafeReader(tmp_path / io.step_dir_name(step)).read_metadata()
        assert any(k.startswith("optim.state.") for k in metadata.state_dict_metadata)
        assert any(k.startswith("model.") for k in metadata.state_dict_metadata)


def test_allowed_names_cannot_reach_anything_else():
    """Only exact (module, name) pairs resolve: nothing is imported or walked for a name."""
    unpickler = io._MetadataUnpickler(__import__("io").BytesIO(b""))
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
        io.load_metadata(pickle.dumps({"state_dict_metadata": {}}), tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match="not a readable DCP checkpoint index"):
        io.load_metadata(pickle.dumps([1, 2, 3])[:-3], tmp_path / ".metadata")
