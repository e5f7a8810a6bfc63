"""Checkpoint integrity: the manifest in ``.complete``, falling back past damaged checkpoints, and
errors that are always a CheckpointError naming the path.

Each test damages a real checkpoint the way storage does (flipped or lost bytes, missing files) and
checks which checkpoint loads and that its weights are exactly that checkpoint's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import textwrap
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hookloop.engine import Events, Trainer
from hookloop.engine.checkpoint_format.directory import MARKER, read_latest, step_dir_name
from hookloop.engine.checkpoint_format.manifest import (
    RecordingWriter,
    file_checksum,
    read_manifest,
    read_marker,
)
from hookloop.engine.checkpoint_format.safe_read import SafeReader, verify_checkpoint
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointError
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import full_snapshot, run_distributed, run_process

pytestmark = pytest.mark.usefixtures("deterministic")


def _trainer(seed: int = 0) -> Trainer:
    model = tiny_gpt(seed)
    return Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss, grad_accum_steps=2
    )


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, s in enumerate(trainer.optimizer.state.values()):
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(directory, mode: str = "sync", steps: int = 4) -> dict[int, dict]:
    """Checkpoints at steps 2 and 4; returns the state at the end of every step."""
    trainer = _trainer()
    AsyncCheckpointer(directory, mode=mode).attach(trainer)
    save_every(trainer, 2)
    states: dict[int, dict] = {}
    trainer.add_event_handler(
        Events.STEP_END, lambda e: states.update({e.state.step: _snapshot(e)}), priority=-100
    )
    trainer.run(token_batches(8, seed=1), max_steps=steps)
    return states


def _resume(directory, **kwargs) -> tuple[AsyncCheckpointer, dict]:
    """A new run resuming from ``directory``: the checkpointer and the state right after loading."""
    trainer = _trainer(seed=5)
    checkpointer = AsyncCheckpointer(directory, mode="sync", **kwargs).attach(trainer)
    loaded: dict = {}
    trainer.add_event_handler(Events.TRAIN_START, lambda e: loaded.update(_snapshot(e)))
    trainer.run(token_batches(8, seed=1), max_steps=6)
    return checkpointer, loaded


def _tensor_span(checkpoint) -> tuple[str, int, int]:
    """``(file, offset, length)`` of the largest stored tensor entry (its bytes are mostly raw data)."""
    metadata = SafeReader(checkpoint).read_metadata()
    info = max(metadata.storage_data.values(), key=lambda s: s.length)
    return info.relative_path, info.offset, info.length


def flip_tensor_bytes(checkpoint, name: str | None = None) -> str:
    """Invert 16 bytes in the middle of a tensor's data inside a ``.distcp`` file."""
    metadata = SafeReader(checkpoint).read_metadata()
    spans = [s for s in metadata.storage_data.values() if name is None or s.relative_path == name]
    info = max(spans, key=lambda s: s.length)
    path = os.path.join(checkpoint, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        chunk = f.read(16)
        f.seek(info.offset + info.length // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return info.relative_path


def _truncate_shard(checkpoint) -> str:
    name = _tensor_span(checkpoint)[0]
    path = checkpoint / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return name


def _delete_metadata(checkpoint) -> str:
    os.remove(checkpoint / ".metadata")
    return ".metadata"


def _replace_metadata(checkpoint) -> str:
    """A well-formed index that belongs to another checkpoint (same layout, different save)."""
    shutil.copy(checkpoint.parent / step_dir_name(2) / ".metadata", checkpoint / ".metadata")
    return ".metadata"


def _corrupt_rank_json(checkpoint) -> str:
    path = checkpoint / "rank_00000.json"
    path.write_bytes(path.read_bytes()[:100])
    return "rank_00000.json"


def _edit_rank_json(checkpoint) -> str:
    """Still valid JSON: only the checksum can tell."""
    path = checkpoint / "rank_00000.json"
    state = json.loads(path.read_text())
    state["counters"]["tokens_seen"] += 1
    path.write_text(json.dumps(state))
    return "rank_00000.json"


def _delete_shard(checkpoint) -> str:
    name = _tensor_span(checkpoint)[0]
    os.remove(checkpoint / name)
    return name


DAMAGE = {
    "flipped_bytes_in_distcp": flip_tensor_bytes,
    "truncated_distcp": _truncate_shard,
    "deleted_distcp": _delete_shard,
    "deleted_metadata": _delete_metadata,
    "altered_metadata": _replace_metadata,
    "corrupt_rank_json": _corrupt_rank_json,
    "edited_rank_json": _edit_rank_json,
}


# ------------------------------------------------------------------------------ manifest
def test_the_marker_lists_every_file_with_its_size_and_checksum(tmp_path):
    _train(tmp_path, mode="async")
    checkpoint = tmp_path / step_dir_name(4)
    marker = read_marker(checkpoint)
    assert marker["step"] == 4 and marker["manifest"]["algorithm"] == "crc32"
    files = marker["manifest"]["files"]
    on_disk = sorted(n for n in os.listdir(checkpoint) if n != MARKER)
    assert sorted(files) == on_disk and ".metadata" in files and "rank_00000.json" in files
    for name, entry in files.items():
        assert (entry["size"], entry["checksum"]) == file_checksum(checkpoint / name)
        assert entry["rank"] == 0
    assert verify_checkpoint(checkpoint) == ([], True)


# ------------------------------------------------------------------------------ fallback
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, caplog):
    states = _train(tmp_path)
    newest = tmp_path / step_dir_name(4)
    name = DAMAGE[damage](newest)
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(2))
    assert _equal(loaded, states[2])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in m and name in m and "damaged" in m for m in warned), warned


@pytest.mark.parametrize("mode", ["sync", "async_copy"])
def test_flipped_bytes_are_caught_in_every_save_mode(tmp_path, mode):
    states = _train(tmp_path, mode=mode)
    flip_tensor_bytes(tmp_path / step_dir_name(4))
    checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(2))
    assert _equal(loaded, states[2])


def test_every_checkpoint_damaged_is_a_checkpoint_error_naming_them(tmp_path):
    _train(tmp_path)
    for step in (2, 4):
        flip_tensor_bytes(tmp_path / step_dir_name(step))
    with pytest.raises(CheckpointError, match="damaged") as info:
        _resume(tmp_path)
    assert str(tmp_path / step_dir_name(2)) in str(info.value)
    assert str(tmp_path / step_dir_name(4)) in str(info.value)


def test_an_unreadable_marker_is_damage(tmp_path, caplog):
    states = _train(tmp_path)
    (tmp_path / step_dir_name(4) / MARKER).write_text('{"step": 4, "manifest": {"algor')
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(2))
    assert _equal(loaded, states[2])
    assert any(MARKER in r.getMessage() for r in caplog.records)


def test_unlisted_extra_files_are_ignored(tmp_path):
    states = _train(tmp_path)
    (tmp_path / step_dir_name(4) / "notes.txt").write_text("copied here by hand")
    checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(4))
    assert _equal(loaded, states[4])


def test_a_checkpoint_without_manifest_loads_with_an_unverified_warning(tmp_path, caplog):
    """Checkpoints written before markers carried a manifest still load."""
    states = _train(tmp_path)
    for step in (2, 4):
        marker = tmp_path / step_dir_name(step) / MARKER
        legacy = {k: v for k, v in json.loads(marker.read_text()).items() if k != "manifest"}
        marker.write_text(json.dumps(legacy))
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(4))
    assert _equal(loaded, states[4])
    assert any("unverified" in r.getMessage() for r in caplog.records)


def _rollback_past_damage(tmp_path, damage) -> None:
    """Train 4 steps saving every 2, ``damage(step-4 checkpoint)``, then a rollback lands on step 2."""
    trainer = _trainer()
    checkpointer = AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    save_every(trainer, 2)
    states: dict = {}
    trainer.add_event_handler(
        Events.STEP_END, lambda e: states.update({e.state.step: _snapshot(e)}), priority=-100
    )
    trainer.run(token_batches(8, seed=1), max_steps=4)
    damage(tmp_path / step_dir_name(4))
    assert checkpointer.restore_latest() == 2
    assert _equal(_snapshot(trainer), states[2])


def test_rollback_skips_a_damaged_newest_checkpoint(tmp_path):
    _rollback_past_damage(tmp_path, flip_tensor_bytes)


def test_finetune_from_a_damaged_checkpoint_takes_the_older_one_beside_it(tmp_path, caplog):
    states = _train(tmp_path / "pre")
    _delete_metadata(tmp_path / "pre" / step_dir_name(4))
    trainer = _trainer(seed=5)
    AsyncCheckpointer(tmp_path / "ft", mode="sync", finetune_from=tmp_path / "pre" / step_dir_name(4)).attach(
        trainer
    )
    loaded: dict = {}
    trainer.add_event_handler(
        Events.TRAIN_START,
        lambda e: loaded.update({f"p.{n}": p.detach().clone() for n, p in e.model.named_parameters()}),
    )
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        trainer.run(token_batches(8, seed=1), max_steps=1)
    assert _equal(loaded, {k: v for k, v in states[2].items() if k.startswith("p.")})
    assert any("damaged" in r.getMessage() for r in caplog.records)


def test_an_explicit_damaged_checkpoint_with_nothing_older_is_a_checkpoint_error(tmp_path):
    _train(tmp_path, steps=2)
    only = tmp_path / step_dir_name(2)
    _delete_metadata(only)
    with pytest.raises(CheckpointError, match="damaged") as info:
        _resume(tmp_path / "elsewhere", resume=only)
    assert str(only) in str(info.value)
    with pytest.raises(CheckpointError, match=r"\.metadata"):  # the reader alone: never a raw OSError
        SafeReader(only).read_metadata()


# ------------------------------------------------------------------------------ crafted rank state
def _rank_state(checkpoint) -> dict:
    return json.loads((checkpoint / "rank_00000.json").read_text())


def _retyped(**changes) -> Callable[[Path], bytes]:
    """A rank state file of ``checkpoint`` with its entries at dotted ``changes`` replaced."""

    def craft(checkpoint: Path) -> bytes:
        state = _rank_state(checkpoint)
        for dotted, value in changes.items():
            *outer, last = dotted.split("__")
            target = state
            for key in outer:
                target = target[key]
            target[last] = value
        return json.dumps(state).encode()

    return craft


CRAFTED_RANK_STATE: dict[str, Callable[[Path], bytes]] = {
    "garbage": lambda _: b"\x00\xff not json at all {",
    "not_an_object": lambda _: b"[1, 2, 3]",
    "huge": lambda c: json.dumps({**_rank_state(c), "pad": "x" * (80 << 20)}).encode(),
    "deep_nesting": lambda _: b"[" * 200_000 + b"]" * 200_000,
    "nested_within_json_limits": lambda c: (
        json.dumps(_rank_state(c))
        .replace('"handlers": {}', '"handlers": {"x": ' + "[" * 500 + "]" * 500 + "}", 1)
        .encode()
    ),
    "huge_integer": lambda c: (
        json.dumps(_rank_state(c)).replace('"step": 4', '"step": ' + "9" * 5000, 1).encode()
    ),
    "step_as_string": _retyped(counters__step="4"),
    "counters_as_list": _retyped(counters=[4, 1]),
    "unknown_counter": _retyped(counters__max_iters=1),
    "negative_counter": _retyped(counters__tokens_seen=-5),
    "step_not_the_checkpoints": _retyped(step=3),
    "rng_as_string": _retyped(rng="seeded"),
    "torch_rng_short": _retyped(rng__torch={"__tensor__": "AAAA", "dtype": "uint8", "shape": [3]}),
    "empty_tensor_of_huge_shape": _retyped(
        rng__torch={"__tensor__": "", "dtype": "float32", "shape": [1 << 20, 1 << 20]}
    ),
    "dtype_that_is_a_function": _retyped(rng__torch={"__tensor__": "AAAA", "dtype": "load", "shape": [3]}),
    "object_ndarray": _retyped(
        rng__numpy={
            "__tuple__": ["MT19937", {"__ndarray__": "AAAAAAAAAAA=", "dtype": "|O", "shape": [1]}, 0, 0, 0.0]
        }
    ),
    "handlers_as_list": _retyped(handlers=["x"]),
    "data_position_of_wrong_types": _retyped(data={"microbatches": "many", "steps": None}),
    "epoch_length_as_float": _retyped(epoch_length=2.5),
    "last_loss_as_dict": _retyped(last={"loss": {"x": 1}, "metrics": {}}),
}


def _plant_rank_state(checkpoint: Path, content: bytes) -> None:
    """Write ``content`` as rank 0's state file and the manifest to match, as whoever crafted it would."""
    (checkpoint / "rank_00000.json").write_bytes(content)
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["manifest"]["files"]["rank_00000.json"].update(
        size=len(content), checksum=f"{zlib.crc32(content):08x}"
    )
    (checkpoint / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("craft", sorted(CRAFTED_RANK_STATE))
def test_a_crafted_rank_state_file_falls_back_to_the_previous_checkpoint(tmp_path, craft, caplog):
    """The manifest matches (whoever wrote the file wrote the manifest too): the file's content is
    checked before anything is loaded, and a file the restore could not take is damage."""
    states = _train(tmp_path)
    newest = tmp_path / step_dir_name(4)
    _plant_rank_state(newest, CRAFTED_RANK_STATE[craft](newest))
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(2))
    assert _equal(loaded, states[2])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(newest) in m and "rank_00000.json" in m and "damaged" in m for m in warned), warned


def test_a_crafted_rank_state_file_is_damage_to_a_rollback_too(tmp_path):
    _rollback_past_damage(
        tmp_path, lambda newest: _plant_rank_state(newest, _retyped(counters__epoch="first")(newest))
    )


def test_an_intact_rank_state_file_passes_the_check(tmp_path):
    states = _train(tmp_path)
    checkpointer, loaded = _resume(tmp_path)
    assert checkpointer.resumed_from == str(tmp_path / step_dir_name(4))
    assert _equal(loaded, states[4])


# ------------------------------------------------------------------------------ full disk
_FULL_DISK = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from hookloop.engine import Events, Trainer
    from hookloop.engine.checkpoint_format.directory import complete_checkpoints, read_latest
    from hookloop.models.gpt import cross_entropy_loss
    from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointError
    from tests.cadence import save_every
    from tests.conftest import tiny_gpt, token_batches

    directory, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)

    def trainer(seed):
        model = tiny_gpt(seed)
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)

    first = trainer(0)
    checkpointer = AsyncCheckpointer(directory, mode=mode).attach(first)
    save_every(first, 2)
    filler = os.path.join(directory, "filler")

    @first.on(Events.STEP_START)
    def fill_the_disk(engine):
        if engine.state.step == 4:  # step 2 is published; the save of step 4 finds no space
            checkpointer.wait()
            st = os.statvfs(directory)
            with open(filler, "wb") as f:
                f.write(bytes(st.f_bavail * st.f_frsize - 100_000))

    out = {}
    try:
        first.run(token_batches(8), max_steps=6)
        out["error"] = None
    except CheckpointError as e:
        out["error"], out["message"] = "CheckpointError", str(e)
    except BaseException as e:
        out["error"], out["message"] = type(e).__name__, str(e)[-500:]
    out["latest"] = read_latest(directory)
    out["complete"] = [s for s, _ in complete_checkpoints(directory)[0]]
    os.remove(filler)
    second = trainer(1)
    resumed = AsyncCheckpointer(directory, mode=mode).attach(second)
    second.run(token_batches(8), max_steps=3)
    out["resumed_from"] = resumed.resumed_from
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_into_a_full_disk_is_a_checkpoint_error_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """A real full disk: an 8 MB tmpfs mounted in a private mount namespace (``unshare``), filled
    to 100 kB before the save of step 4 (the rank state fits, DCP's shard does not)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a private tmpfs")
    directory = tmp_path / "small"
    directory.mkdir()
    script = 'mount -t tmpfs -o size=8m tmpfs "$0" || exit 99; exec "$1" -c "$2" "$0" "$3"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    proc = run_process([*cmd, str(directory), sys.executable, _FULL_DISK, mode], timeout=120)
    if proc.returncode == 99 or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["error"] == "CheckpointError", result
    assert "step 4" in result["message"] and str(directory) in result["message"]
    assert result["latest"] == step_dir_name(2) and result["complete"] == [2]
    assert result["resumed_from"] == str(directory / step_dir_name(2))


def test_a_failing_background_write_is_a_checkpoint_error(tmp_path, monkeypatch):
    """The write fails with ENOSPC inside DCP's writer thread: CheckpointError at the next poll."""
    import errno

    trainer = _trainer()
    AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    save_every(trainer, 2)
    original = RecordingWriter.write_data

    def failing(self, plan, planner):
        if "step_00000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)

    monkeypatch.setattr(RecordingWriter, "write_data", failing)
    with pytest.raises(CheckpointError, match="step 4") as info:
        trainer.run(token_batches(12, seed=1), max_steps=6)
    assert "No space left on device" in str(info.value)
    assert read_latest(tmp_path) == step_dir_name(2)


# ------------------------------------------------------------------------------ two ranks


def _one_rank_damaged_worker(rank: int, world: int, directory: str) -> dict:
    """FSDP2 on 2 ranks saves steps 2 and 4; rank 1 flips bytes in its own shard of step 4; a
    resumed run must load step 2 on both ranks."""
    import torch.distributed as dist

    from hookloop.engine.parallel import init_distributed, wrap_data_parallel

    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    data = token_batches(8, seed=10 + rank)

    def build(seed: int) -> Trainer:
        model = wrap_data_parallel(tiny_gpt(seed), "fsdp", mesh=info.mesh)
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)

    first = build(0)
    ck = AsyncCheckpointer(directory, mode="async").attach(first)
    save_every(first, 2)
    states: dict = {}
    first.add_event_handler(
        Events.STEP_END, lambda e: states.update({e.state.step: full_snapshot(e)}), priority=-100
    )
    first.run(data, max_steps=4)
    ck.close()
    newest = os.path.join(directory, step_dir_name(4))
    own = sorted(
        n for n in os.listdir(newest) if n.startswith("__1_") and n.endswith(".distcp")
    )  # DCP's naming
    assert all(read_manifest(newest)[n]["rank"] == 1 for n in own)
    dist.barrier()
    if rank == 1:
        flip_tensor_bytes(newest, own[0])
    dist.barrier()

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("hookloop.handlers.checkpoint").addHandler(Collect(level=logging.WARNING))
    second = build(7)
    ck2 = AsyncCheckpointer(directory, mode="async").attach(second)
    loaded: dict = {}
    second.add_event_handler(Events.TRAIN_START, lambda e: loaded.update(full_snapshot(e)))
    second.run(data, max_steps=5)
    ck2.close()
    return {
        "resumed_from": ck2.resumed_from,
        "equal_step_2": _equal(loaded, states[2]),
        "damaged_file": own[0],
        "warnings": messages,
    }


def test_two_ranks_agree_on_the_fallback_when_only_one_rank_sees_the_damage(tmp_path):
    results = run_distributed(_one_rank_damaged_worker, 2, str(tmp_path))
    expected = str(tmp_path / step_dir_name(2))
    for r in results:
        assert r["resumed_from"] == expected and r["equal_step_2"], r
        assert any(r["damaged_file"] in m and "damaged" in m for m in r["warnings"]), r["warnings"]
