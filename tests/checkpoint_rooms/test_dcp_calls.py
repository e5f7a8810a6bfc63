"""How the wing calls DCP: which entries decide known-good, which a background save copies at once,
errors in one line, a Ctrl-C that reached DCP kept a Ctrl-C, and small values serialized once and
loaded back exactly (values that compare equal but differ kept apart)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from hookloop.handlers.checkpoint import dcp_calls
from hookloop.handlers.checkpoint.dcp_calls import (
    STATE_DICT_OPTIONS,
    SavePlanner,
    copy_buffers,
    last_line,
    quiet_single_process,
    reraise_interrupt,
    trained_entries,
)


def norm_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_known_good_is_decided_by_parameters_and_floating_optimizer_state_not_buffers():
    model, optimizer = norm_model()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    entries = trained_entries(model_sd, optim_sd, model)
    params = {f"model.{name}" for name, _ in model.named_parameters()}
    assert params <= entries
    assert not any("running_mean" in e or "num_batches_tracked" in e for e in entries)
    assert "optim.state.0.weight.exp_avg" in entries
    assert not any(e.endswith(".lr") for e in entries)  # hyper-parameters are no state


def test_a_background_save_copies_buffers_at_once_and_shares_parameters():
    model, optimizer = norm_model()
    model_sd, _ = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    copied = copy_buffers(model_sd, model)
    assert copied["0.weight"].data_ptr() == model[0].weight.data_ptr()
    running = model[1].running_mean.clone()
    model(torch.randn(4, 3) * 10)  # a forward changes the statistics
    assert torch.equal(copied["1.running_mean"], running)


def test_an_error_in_one_line_and_an_interrupt_kept_what_it_is():
    assert last_line(RuntimeError("rank 0: Traceback\n  ...\nOSError: disk full")) == "OSError: disk full"
    assert last_line(RuntimeError()) == "RuntimeError()"
    with pytest.raises(KeyboardInterrupt):
        reraise_interrupt(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        reraise_interrupt(CheckpointException("save", {0: (KeyboardInterrupt(), None)}))
    reraise_interrupt(CheckpointException("save", {0: (OSError("disk full"), None)}))  # no interrupt
    reraise_interrupt(ValueError("not an interrupt"))


def test_small_values_are_serialized_once_and_load_back_exactly_equal_looking_ones_apart(tmp_path):
    values = {"a": 0.0, "b": -0.0, "c": 1, "d": True, "e": 1.0, "f": (0.9, 0.999), "g": [1, 2], "h": None}
    values["i"], values["j"] = "adamw", {"nested": 1}  # a dict is not cached: serialized each time
    for i in range(2):  # the second save takes the cached bytes
        with quiet_single_process():
            dcp.save(dict(values), checkpoint_id=tmp_path / str(i), planner=SavePlanner(), no_dist=True)
        loaded = {key: "placeholder" for key in values}
        loaded["j"] = {"nested": 0}
        with quiet_single_process():
            dcp.load(loaded, checkpoint_id=tmp_path / str(i), no_dist=True)
        assert [(type(v), repr(v)) for v in loaded.values()] == [(type(v), repr(v)) for v in values.values()]
    cached = {key for key in dcp_calls._SERIALIZED if key[1] in ("0.0", "-0.0", "1", "True", "1.0")}
    assert len(cached) == 5  # one entry each: equal values of other types or signs are not shared
