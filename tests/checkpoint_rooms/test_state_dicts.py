"""The state dicts a save writes are torch's ``get_state_dict`` exactly, at every save: with names
renamed by wrappers (activation checkpointing, ``torch.compile``), shared parameters, several
parameter groups, a changed learning rate; torch is asked once per layout and again whenever the
layout changes (a parameter replaced, an optimizer made anew) or its answer cannot be reproduced
(an optimizer state nested in dicts, an optimizer without state yet)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import state_dict as torch_state_dict

from hookloop.handlers.checkpoint import state_dicts
from hookloop.handlers.checkpoint.dcp_calls import STATE_DICT_OPTIONS
from hookloop.handlers.checkpoint.state_dicts import StateDicts


class _Net(torch.nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6))
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.register_buffer("scale", torch.ones(6))
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)) * self.scale)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.arange(8) % 11).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_exactly_torchs(mine: tuple, model: torch.nn.Module, optimizer) -> None:
    """``mine`` is what torch's ``get_state_dict`` gives now: the same keys in the same order, the
    same tensors (memory, shape, strides) and the same values."""
    theirs = torch_state_dict.get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    for got, want in zip(mine, theirs):
        assert list(got) == list(want)
        for key in want:
            if isinstance(want[key], torch.Tensor):
                assert isinstance(got[key], torch.Tensor), key
                assert (got[key].data_ptr(), got[key].shape, got[key].stride()) == (
                    want[key].data_ptr(),
                    want[key].shape,
                    want[key].stride(),
                ), key
                assert torch.equal(got[key], want[key]), key
            else:
                assert got[key] == want[key], key


@pytest.fixture
def torch_calls(monkeypatch) -> list[int]:
    """How many times torch's ``get_state_dict`` was asked (by :class:`StateDicts`)."""
    calls: list[int] = []
    real = state_dicts.get_state_dict

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(state_dicts, "get_state_dict", counted)
    return calls


def _wrapped() -> torch.nn.Module:
    """The parameters' names carry the checkpoint wrapper's prefix, the state dict's keys not."""
    net = _Net()
    net.block = checkpoint_wrapper(net.block)
    return net


def _compiled_block() -> torch.nn.Module:
    """Some keys renamed (``block._orig_mod.``), others not: torch moves the renamed ones to the
    end, which the learned naming must reproduce."""
    net = _Net()
    net.block = torch.compile(net.block)
    return net


@pytest.mark.parametrize(
    "make",
    [_Net, _wrapped, lambda: torch.compile(_Net()), _compiled_block, lambda: _Net(tied=True)],
    ids=["plain", "checkpoint-wrapped", "compiled", "compiled-block", "tied"],
)
def test_every_save_gets_torchs_state_dicts_and_torch_is_asked_once_per_layout(make, torch_calls) -> None:
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if "weight" in n], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if "weight" not in n], "weight_decay": 0.0},
        ],
        lr=1e-3,
    )
    _train(model, optimizer)
    dicts = StateDicts()
    for _ in range(4):
        _assert_exactly_torchs(dicts.get(model, optimizer), model, optimizer)
        _train(model, optimizer, steps=2)
        for group in optimizer.param_groups:  # a scheduler's change shows in the next save
            group["lr"] *= 0.5
    assert len(torch_calls) == 1
    assert dicts._names is not None


def test_a_changed_layout_asks_torch_again(torch_calls) -> None:
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer)
    dicts = StateDicts()
    dicts.get(model, optimizer)
    dicts.get(model, optimizer)
    assert len(torch_calls) == 1

    # a parameter replaced in the model and the optimizer made anew: new names to learn
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer)
    _assert_exactly_torchs(dicts.get(model, optimizer), model, optimizer)
    assert len(torch_calls) == 2
    dicts.get(model, optimizer)
    assert len(torch_calls) == 2

    # an optimizer that holds a parameter the model no longer has: torch's answer (its error) stands
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    with pytest.raises(Exception) as theirs:
        torch_state_dict.get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    with pytest.raises(type(theirs.value)):
        dicts.get(model, optimizer)


def test_an_optimizer_without_state_is_left_to_torch_until_it_has_state(torch_calls) -> None:
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters())
    dicts = StateDicts()
    first = dicts.get(model, optimizer)  # torch makes the state (a step with zero gradients)
    assert any(key.endswith(".exp_avg") for key in first[1])
    _assert_exactly_torchs(dicts.get(model, optimizer), model, optimizer)
    assert len(torch_calls) == 1  # the state now exists: renamed without torch


class _Nested(torch.optim.SGD):
    """An optimizer whose per-parameter state holds a dict (as Shampoo's does)."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["stats"] = {"norm": p.detach().norm().clone()}


def test_a_nested_optimizer_state_is_left_to_torch_at_every_save(torch_calls) -> None:
    model = _Net()
    optimizer = _Nested(model.parameters(), lr=0.1)
    _train(model, optimizer)
    dicts = StateDicts()
    for _ in range(3):
        _assert_exactly_torchs(dicts.get(model, optimizer), model, optimizer)
    assert dicts._names is None
    assert len(torch_calls) == 3
