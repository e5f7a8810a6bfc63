"""The reader: the checkpoint to load is the newest intact one (damaged ones named and skipped,
the same choice on every rank), an index over the bound is a setting and never damage, another
model layout is refused before anything loads, and a load puts back exactly what was saved."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hookloop.engine.checkpoint_format.directory import MARKER, read_json, write_json_atomic
from hookloop.engine.checkpoint_format.errors import (
    CheckpointError,
    CheckpointIndexBoundError,
    CheckpointLayoutError,
)
from hookloop.handlers.checkpoint.dcp_calls import STATE_DICT_OPTIONS
from hookloop.handlers.checkpoint.session import CheckpointSession
from tests.checkpoint_rooms import fakes

LOGGER = "hookloop.handlers.checkpoint"


def write_three(directory, sess, nan_at: tuple[int, ...] = ()) -> dict[int, str]:
    """Complete checkpoints of steps 1, 2 and 3 of one model (keep_last=10), NaN weights at ``nan_at``."""
    st = fakes.store(directory, sess, keep_last=10)
    model, optimizer = fakes.model_and_optimizer()
    paths = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model[0].weight.fill_(float("nan") if step in nan_at else float(step))
        paths[step] = fakes.save(directory, step, model, optimizer, st=st)
    return paths


def flip_a_byte(path: str) -> None:
    data_file = next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".distcp"))
    with open(data_file, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def test_auto_is_the_newest_intact_checkpoint_and_none_without_one(tmp_path, sess):
    assert fakes.reader(fakes.store(tmp_path, sess), sess).agreed_checkpoint("auto") is None
    paths = write_three(tmp_path, sess)
    assert fakes.reader(fakes.store(tmp_path, sess), sess).agreed_checkpoint("auto") == paths[3]


def test_damage_is_named_and_the_next_older_checkpoint_is_chosen(tmp_path, sess, caplog):
    paths = write_three(tmp_path, sess)
    flip_a_byte(paths[3])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        chosen = fakes.reader(fakes.store(tmp_path, sess), sess).agreed_checkpoint("auto")
    assert chosen == paths[2]
    assert f"checkpoint {paths[3]} is damaged" in caplog.text and "manifest says" in caplog.text
    assert f"loading {paths[2]} instead of the damaged {paths[3]}" in caplog.text


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path, sess):
    paths = write_three(tmp_path, sess)
    for path in paths.values():
        flip_a_byte(path)
    with pytest.raises(CheckpointError, match="every complete checkpoint to load from is damaged") as e:
        fakes.reader(fakes.store(tmp_path, sess), sess).agreed_checkpoint("auto")
    assert all(path in str(e.value) for path in paths.values())


def test_a_path_falls_back_beside_itself_and_a_directory_means_its_newest(tmp_path, sess):
    paths = write_three(tmp_path, sess)
    flip_a_byte(paths[2])
    rd = fakes.reader(fakes.store(tmp_path / "unused", sess), sess)
    assert rd.agreed_checkpoint(paths[2]) == paths[1]
    assert rd.agreed_checkpoint(str(tmp_path)) == paths[3]
    with pytest.raises(CheckpointError, match=r"checkpoint\.finetune_from: checkpoint .* does not exist"):
        rd.agreed_checkpoint(str(tmp_path / "nowhere"), field="checkpoint.finetune_from")


def test_a_rollback_chooses_at_or_before_a_step_and_only_finite_checkpoints(tmp_path, sess, caplog):
    paths = write_three(tmp_path, sess, nan_at=(2,))
    rd = fakes.reader(fakes.store(tmp_path, sess), sess)
    assert rd.agreed_checkpoint("auto", at_or_before=2) == paths[2]  # a resume takes it as it is
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rd.agreed_checkpoint("auto", at_or_before=2, finite_only=True) == paths[1]
    assert f"not rolling back to {paths[2]}: its parameters or optimizer state held NaN/Inf" in caplog.text
    assert rd.agreed_checkpoint("auto", at_or_before=0) is None


def test_what_the_check_finds_is_damage_too(tmp_path, sess, caplog):
    paths = write_three(tmp_path, sess)
    rd = fakes.reader(fakes.store(tmp_path, sess), sess)
    refused = {paths[3]: ["rank_00000.json holds step = 'x', not the checkpoint's step 3"]}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        chosen = rd.agreed_checkpoint("auto", check=lambda path: refused.get(path, []))
    assert chosen == paths[2] and "holds step = 'x'" in caplog.text


def test_a_check_that_raises_counts_as_damage_and_never_escapes(tmp_path, sess):
    paths = write_three(tmp_path, sess)

    def check(path: str) -> list[str]:
        if path == paths[3]:
            raise OSError("slow storage gave up")
        return []

    assert fakes.reader(fakes.store(tmp_path, sess), sess).agreed_checkpoint("auto", check=check) == paths[2]


def test_an_index_over_the_bound_is_a_setting_and_nothing_older_is_tried(tmp_path, sess):
    write_three(tmp_path, sess)
    rd = fakes.reader(fakes.store(tmp_path, sess), sess, index_limit=64)
    with pytest.raises(CheckpointIndexBoundError, match=r"checkpoint\.max_index_mb.*nothing was loaded"):
        rd.agreed_checkpoint("auto")


def test_a_checkpoint_without_a_manifest_loads_unverified_with_a_warning(tmp_path, sess, caplog):
    paths = write_three(tmp_path, sess)
    marker = read_json(os.path.join(paths[3], MARKER))
    del marker["manifest"]
    write_json_atomic(os.path.join(paths[3], MARKER), marker)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        chosen = fakes.reader(fakes.store(tmp_path, sess), sess).agreed_checkpoint("auto")
    assert chosen == paths[3] and "loading it unverified" in caplog.text


def test_a_load_puts_back_the_saved_model_and_optimizer_state(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer(seed=0)
    path = fakes.save(tmp_path, 1, model, optimizer)
    other, other_optimizer = fakes.model_and_optimizer(seed=5)
    model_sd, optim_sd = get_state_dict(other, other_optimizer, options=STATE_DICT_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    fakes.reader(fakes.store(tmp_path, sess), sess).load(path, state)
    loaded = {"model_state_dict": state["model"], "optim_state_dict": state["optim"]}
    set_state_dict(other, other_optimizer, **loaded, options=STATE_DICT_OPTIONS)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"]) for i in saved)


def test_another_layout_is_refused_by_field_before_anything_loads(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer(width=4)
    path = fakes.save(tmp_path, 1, model, optimizer)
    wider, _ = fakes.model_and_optimizer(width=6)
    before = fakes.parameters(wider)
    rd = fakes.reader(fakes.store(tmp_path, sess), sess)
    with pytest.raises(CheckpointLayoutError, match=r"checkpoint\.finetune_from: .*another model") as e:
        rd.load_weights(wider, path)
    assert "0.weight (3, 4) vs (3, 6)" in e.value.difference
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())  # untouched


def test_load_weights_takes_the_model_only(tmp_path, sess):
    model, optimizer = fakes.model_and_optimizer(seed=0)
    path = fakes.save(tmp_path, 1, model, optimizer)
    fresh, fresh_optimizer = fakes.model_and_optimizer(seed=3)
    optimizer_before = fresh_optimizer.state_dict()["state"][0]["exp_avg"].clone()
    fakes.reader(fakes.store(tmp_path, sess), sess).load_weights(fresh, path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], optimizer_before)


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank in this process: the exchange the ranks' choice goes
    through runs (list on rank 0, broadcast, every rank's verdict gathered)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = CheckpointSession()
    try:
        s.open()
        yield s
    finally:
        s.close()
        dist.destroy_process_group()


def test_the_agreed_choice_goes_through_the_process_group(tmp_path, one_rank_group):
    s = one_rank_group
    assert s.group is not None and len(s.id) == 8
    paths = write_three(tmp_path, s)
    flip_a_byte(paths[3])
    rd = fakes.reader(fakes.store(tmp_path, s), s)
    assert rd.agreed_checkpoint("auto") == paths[2]
    refused = {paths[2]: ["this rank cannot read its state file"]}
    assert rd.agreed_checkpoint("auto", check=lambda p: refused.get(p, [])) == paths[1]
