"""The optimizer's hyperparameters in a checkpoint: one entry per group of parameters with equal
settings, loaded back exactly into the flattened form; checkpoints with one entry per parameter
(the earlier layout) still load; a damaged or incomplete entry is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers.checkpoint import optim_layout, writer
from hookloop.handlers.checkpoint.dcp_calls import STATE_DICT_OPTIONS
from tests.checkpoint_rooms import fakes


def two_groups(seed: int, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A three-layer model whose AdamW has two groups (the middle layer without weight decay, its
    own learning rate and betas) and has taken one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    groups = [
        {"params": [*model[0].parameters(), *model[2].parameters()]},
        {"params": list(model[1].parameters()), "lr": lr / 2, "weight_decay": 0.0, "betas": (0.8, 0.9)},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def load_into(tmp_path, sess, path: str, model, optimizer) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    fakes.reader(fakes.store(tmp_path, sess), sess).load(path, state)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=STATE_DICT_OPTIONS,
    )


def settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def stored_keys(path: str) -> list[str]:
    return sorted(k for k in SafeReader(path).read_metadata().state_dict_metadata if k.startswith("optim."))


def test_compact_keeps_one_entry_per_group_and_non_plain_settings_flat():
    flat = {
        "state.a.exp_avg": torch.zeros(1),
        "param_groups.a.lr": 0.1,
        "param_groups.a.betas": (0.9, 0.95),
        "param_groups.b.c.lr": 0.1,
        "param_groups.b.c.betas": (0.9, 0.95),
        "param_groups.d.lr": 0.1,
        "param_groups.d.betas": (0.9, 0.96),
        "param_groups.e.lr": 0.1,
        "param_groups.e.betas": [0.9, 0.95],  # a list is not the tuple
        "param_groups.f.lr": torch.tensor(0.1),
        "param_groups.f.betas": (0.9, 0.95),
    }
    out = optim_layout.compact(flat)
    assert out["hyperparameters.a"] == (("a", "b.c"), (("lr", 0.1), ("betas", (0.9, 0.95))))
    assert out["hyperparameters.d"] == (("d",), (("lr", 0.1), ("betas", (0.9, 0.96))))
    assert type(out["hyperparameters.e"][1][1][1]) is list
    assert out["param_groups.f.lr"] is flat["param_groups.f.lr"] and out["param_groups.f.betas"] == (
        0.9,
        0.95,
    )
    assert out["state.a.exp_avg"] is flat["state.a.exp_avg"]
    assert sorted(out) == sorted(
        [
            "state.a.exp_avg",
            "hyperparameters.a",
            "hyperparameters.d",
            "hyperparameters.e",
            "param_groups.f.lr",
            "param_groups.f.betas",
        ]
    )


def test_groups_are_saved_once_and_load_back_exactly(tmp_path, sess):
    model, optimizer = two_groups(seed=0)
    path = fakes.save(tmp_path, 1, model, optimizer)
    keys = stored_keys(path)
    assert not [k for k in keys if k.startswith("optim.param_groups.")]
    assert [k for k in keys if k.startswith("optim.hyperparameters.")] == [
        "optim.hyperparameters.0.weight",
        "optim.hyperparameters.1.weight",
    ]
    other, other_optimizer = two_groups(seed=3, lr=5.0)
    assert settings(other_optimizer) != settings(optimizer)
    load_into(tmp_path, sess, path, other, other_optimizer)
    assert settings(other_optimizer) == settings(optimizer)
    assert type(other_optimizer.param_groups[1]["betas"]) is tuple
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg_sq"], loaded[i]["exp_avg_sq"]) for i in saved)


def test_a_checkpoint_with_settings_per_parameter_still_loads(tmp_path, sess, monkeypatch):
    monkeypatch.setattr(writer.optim_layout, "compact", lambda optim_sd: optim_sd)  # the earlier writer
    model, optimizer = two_groups(seed=0)
    path = fakes.save(tmp_path, 1, model, optimizer)
    assert "optim.param_groups.1.weight.lr" in stored_keys(path)
    other, other_optimizer = two_groups(seed=3, lr=5.0)
    load_into(tmp_path, sess, path, other, other_optimizer)
    assert settings(other_optimizer) == settings(optimizer)


def test_a_damaged_entry_and_a_missing_setting_are_refused_by_name(tmp_path, sess, monkeypatch):
    model, optimizer = two_groups(seed=0)
    path = fakes.save(tmp_path, 1, model, optimizer)
    other, other_optimizer = two_groups(seed=3)
    other_optimizer.param_groups[1]["momentum_decay"] = 0.5  # a setting the checkpoint never had
    before = settings(other_optimizer)
    with pytest.raises(
        CheckpointError,
        match=r"no optimizer setting param_groups\.1\.bias\.momentum_decay.*"
        r"load_optimizer=False",
    ):
        load_into(tmp_path, sess, path, other, other_optimizer)
    assert settings(other_optimizer) == before

    compact = optim_layout.compact

    def damaged(optim_sd):
        out = compact(optim_sd)
        out["hyperparameters.0.weight"] = ("0.weight", "lr")
        return out

    monkeypatch.setattr(writer.optim_layout, "compact", damaged)
    path = fakes.save(tmp_path / "damaged", 1, model, optimizer)
    other, other_optimizer = two_groups(seed=3)
    with pytest.raises(CheckpointError, match=r"is damaged: its entry 'optim\.hyperparameters\.0\.weight'"):
        load_into(tmp_path, sess, path, other, other_optimizer)


def test_a_large_group_is_split_into_entries_the_reader_accepts():
    import io

    from hookloop.engine.checkpoint_format.dcp_pickles import ENTRY_MAX_BYTES

    names = [f"blocks.{i}.{'very_long_submodule_name.' * 8}weight" for i in range(2500)]
    flat = {f"param_groups.{n}.{k}": v for n in names for k, v in (("lr", 0.1), ("betas", (0.9, 0.95)))}
    out = optim_layout.compact(flat)
    assert sorted(out) == [f"hyperparameters.{names[i]}" for i in (0, 1000, 2000)]
    for value in out.values():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        assert buffer.tell() < ENTRY_MAX_BYTES / 2
    # what DCP does on load: the wanted keys the index lacks swapped for its entries, then filled in
    wanted = dict.fromkeys(flat)
    expand = optim_layout.request(wanted, {f"optim.{k}" for k in out}, "ckpt")
    assert sorted(wanted) == sorted(out)
    wanted.update(out)
    expand()
    assert wanted == flat
