"""A rank state file is read without trusting it: what a save wrote comes back as it was, and a
crafted file is refused naming the file and the field, before the restore could act on it."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.state_codec import encode
from hookloop.handlers.checkpoint import rank_file as rank_file_room
from hookloop.handlers.checkpoint.rank_file import FORMAT, MAX_DEPTH, VERSION, rank_file, read_rank_file
from hookloop.handlers.checkpoint.rank_state import RankState
from hookloop.handlers.checkpoint.resume_settings import ResumeSettings
from tests.checkpoint_rooms import fakes


@pytest.fixture
def saved(tmp_path, sess) -> dict:
    """What a save of step 4 writes for a bare trainer with one stateful handler."""
    trainer = fakes.bare_trainer()
    trainer.state.iteration = 4
    trainer.register_stateful("counts", Counts())
    reader = fakes.reader(fakes.store(tmp_path, sess), sess)
    state = RankState(trainer, reader, ResumeSettings(sess), load_optimizer=True, long_wait=fakes.LongWaits())
    return json.loads(json.dumps(state.capture(4)))


class Counts:
    def __init__(self) -> None:
        self.seen = {"a": 1}

    def state_dict(self) -> dict:
        return {"seen": dict(self.seen), "weights": torch.arange(3.0)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = dict(state["seen"])


COUNTERS = fakes.bare_trainer().state.counters()


def write(directory, state) -> str:
    path = os.path.join(directory, "rank_00000.json")
    with open(path, "w") as f:
        f.write(state if isinstance(state, str) else json.dumps(state))
    return path


def test_what_a_save_wrote_reads_back_as_it_was(tmp_path, saved):
    assert saved["format"] == FORMAT and saved["version"] == VERSION
    assert read_rank_file(write(tmp_path, saved), COUNTERS, 4) == saved


def test_each_rank_reads_its_own_file_or_rank_0s_when_the_world_changed(tmp_path):
    (tmp_path / "rank_00000.json").write_text("{}")
    (tmp_path / "rank_00001.json").write_text("{}")
    assert rank_file(str(tmp_path), 1) == (str(tmp_path / "rank_00001.json"), False)
    assert rank_file(str(tmp_path), 2) == (str(tmp_path / "rank_00000.json"), True)


def crafted(saved: dict, where: str, value) -> dict:
    state = copy.deepcopy(saved)
    *path, last = where.split(".")
    target = state
    for key in path:
        target = target[key]
    target[last] = value
    return state


REFUSALS = [
    ("format", "pickle", "is not a hookloop-checkpoint v1 state file"),
    ("version", 2, "is not a hookloop-checkpoint v1 state file"),
    ("step", 5, "holds step = '5', not the checkpoint's step 4"),
    ("counters.step", 3, "holds counters.step = '3', not the state's step 4"),
    ("counters.epoch", -1, "holds counters.epoch = '-1', not a count"),
    ("counters.tokens_seen", True, "holds counters.tokens_seen = 'True', not a count"),
    ("counters.__class__", 1, "holds counters the trainer does not keep: __class__"),
    ("epoch_length", 0, "holds epoch_length = '0', not a length or null"),
    ("handlers", [], "holds handlers = '[]', not an object"),
    ("handlers.counts", {"__tensor__": "", "dtype": "os.system", "shape": []}, "is not a torch dtype"),
    ("handlers.counts", {"__tensor__": "AAAA", "dtype": "float32", "shape": [10**6]}, "takes 4000000 bytes"),
    ("lr_scheduler", [1, 2], "holds lr_scheduler = '[1, 2]', not a scheduler's state_dict"),
    ("data", {"microbatches": -1, "steps": 0}, "holds data.microbatches = '-1', not a count"),
    ("rng.python", [3, [0] * 3, None], "ValueError"),
    ("rng.torch", [1, 2], "holds rng.torch = '[1, 2]', not a tensor"),
    ("rng.generators", "x", "holds rng.generators = 'x', not a list"),
    ("last.loss", "nan", "holds last.loss = 'nan', not a number"),
    ("last.metrics", {"val_loss": [1]}, "holds last.metrics.val_loss = '[1]', not a number"),
]


@pytest.mark.parametrize(("where", "value", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_crafted_field_is_refused_naming_the_file_and_the_field(tmp_path, saved, where, value, message):
    path = write(tmp_path, crafted(saved, where, value))
    with pytest.raises(CheckpointError) as e:
        read_rank_file(path, COUNTERS, 4)
    assert str(e.value).startswith(path) and message in str(e.value)


def test_a_torch_rng_state_torch_refuses_is_refused(tmp_path, saved):
    path = write(tmp_path, crafted(saved, "rng.torch", encode(torch.zeros(3, dtype=torch.uint8))))
    with pytest.raises(CheckpointError, match="is not a state file this version can restore"):
        read_rank_file(path, COUNTERS, 4)


def test_deep_nesting_oversize_and_non_json_are_refused(tmp_path, saved, monkeypatch):
    nested: list = []
    for _ in range(MAX_DEPTH + 1):
        nested = [nested]
    with pytest.raises(CheckpointError, match=f"nests deeper than {MAX_DEPTH} levels"):
        read_rank_file(write(tmp_path, crafted(saved, "handlers.counts", nested)), COUNTERS, 4)
    with pytest.raises(CheckpointError, match="is not a state file this version can .*JSONDecodeError"):
        read_rank_file(write(tmp_path, "{not json"), COUNTERS, 4)
    monkeypatch.setattr(rank_file_room, "MAX_BYTES", 100)
    with pytest.raises(CheckpointError, match=r"has \d+ bytes, more than the 100 a rank state file may have"):
        read_rank_file(write(tmp_path, saved), COUNTERS, 4)
    with pytest.raises(CheckpointError, match=r"cannot read .*rank_00009\.json"):
        read_rank_file(str(tmp_path / "rank_00009.json"), COUNTERS, 4)
