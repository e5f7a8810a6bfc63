"""Model layout: the same parameters under another pipeline split map name to name (and back), and
another layout is described in a few words (split, layer counts, shapes, names)."""

from __future__ import annotations

import torch

from hookloop.handlers.checkpoint.model_layout import (
    back_to_names,
    describe_layout_difference,
    names_across_split,
    under_names,
)

PLAIN = {"embed.weight": (8, 4), "blocks.0.w": (4, 4), "blocks.1.w": (4, 4), "head.weight": (8, 4)}
STAGED = {"0.embed.weight": (8, 4), "0.blocks.0.w": (4, 4), "1.blocks.1.w": (4, 4), "1.head.weight": (8, 4)}


def test_the_same_parameters_under_stage_prefixes_map_both_ways():
    assert names_across_split(PLAIN, PLAIN) is None  # same names: no map needed
    assert names_across_split(STAGED, PLAIN) == {k: f"{s}.{k}" for k, s in zip(PLAIN, "0011")}
    assert names_across_split(PLAIN, STAGED) == {f"{s}.{k}": k for k, s in zip(PLAIN, "0011")}


def test_no_map_when_the_split_holds_other_parameters_or_a_name_twice():
    wider = {**STAGED, "1.head.weight": (9, 4)}
    assert names_across_split(wider, PLAIN) is None
    twice = {"0.blocks.0.w": (4, 4), "1.blocks.0.w": (4, 4)}  # two stages, one name
    assert names_across_split(twice, {"blocks.0.w": (4, 4)}) is None


def test_state_dicts_are_renamed_for_the_load_and_back_in_place():
    names = {"w": "0.w"}
    weight, moment = torch.zeros(2), torch.zeros(2)
    state = {"model": {"w": weight}, "optim": {"state.w.exp_avg": moment, "param_groups.w.lr": 0.1}}
    renamed = under_names(state, names)
    assert renamed["model"]["0.w"] is weight  # the same tensor: DCP loads into it in place
    assert renamed["optim"]["state.0.w.exp_avg"] is moment
    assert renamed["optim"]["param_groups.0.w.lr"] == 0.1
    renamed["optim"]["param_groups.0.w.lr"] = 0.5  # DCP replaces non-tensor values
    back_to_names(renamed, state, names)
    assert state["optim"]["param_groups.w.lr"] == 0.5 and state["model"]["w"] is weight


def test_a_layout_difference_names_the_split_the_counts_and_the_shapes():
    assert describe_layout_difference(PLAIN, dict(PLAIN)) is None
    split = describe_layout_difference(STAGED, {**PLAIN, "head.weight": (9, 4)})
    assert "written by a pipeline-parallel run" in split and "head.weight (8, 4) vs (9, 4)" in split
    deeper = {**PLAIN, "blocks.2.w": (4, 4)}
    assert describe_layout_difference(PLAIN, deeper) == "blocks: 2 in the checkpoint, 3 in this model"
    renamed = {"embedding.weight" if k == "embed.weight" else k: v for k, v in PLAIN.items()}
    text = describe_layout_difference(PLAIN, renamed)
    assert "1 parameters not in the checkpoint (embedding.weight)" in text
    assert "1 parameters not in this model (embed.weight)" in text
