"""Activation checkpointing: same gradients, fewer saved activations, unchanged checkpoint keys,
and the ``train.activation_checkpointing`` setting."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from hookloop.engine.activation_checkpointing import (
    apply_activation_checkpointing,
    saved_activation_bytes,
    transformer_blocks,
)
from hookloop.engine.config import TrainConfig
from hookloop.engine.errors import ConfigError
from hookloop.models.gpt import Block, cross_entropy_loss
from tests.conftest import tiny_gpt, token_batches


def grads(mode: str) -> dict[str, torch.Tensor]:
    model = apply_activation_checkpointing(tiny_gpt(n_layers=4), mode)
    x, y = token_batches(1)[0]
    cross_entropy_loss(model(x), y).backward()
    return {k.replace("._checkpoint_wrapped_module", ""): p.grad for k, p in model.named_parameters()}


def wrapped(model) -> list[bool]:
    return [isinstance(block, CheckpointWrapper) for _, _, block in transformer_blocks(model)]


def test_modes_wrap_every_block_or_every_other():
    assert wrapped(apply_activation_checkpointing(tiny_gpt(n_layers=4), "full")) == [True] * 4
    assert wrapped(apply_activation_checkpointing(tiny_gpt(n_layers=4), "selective")) == [
        True,
        False,
        True,
        False,
    ]
    assert wrapped(apply_activation_checkpointing(tiny_gpt(n_layers=4), "none")) == [False] * 4
    # by module type, and applying twice does not wrap twice
    model = apply_activation_checkpointing(tiny_gpt(), "full", module_types=[Block])
    apply_activation_checkpointing(model, "full", module_types=[Block])
    assert wrapped(model) == [True, True]
    assert not isinstance(model.blocks["0"]._checkpoint_wrapped_module, CheckpointWrapper)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_match_the_plain_model(mode):
    reference, checkpointed = grads("none"), grads(mode)
    assert reference.keys() == checkpointed.keys()
    for name, g in reference.items():
        torch.testing.assert_close(checkpointed[name], g, atol=1e-6, rtol=0, msg=name)


def test_full_checkpointing_saves_fewer_bytes_for_backward():
    x, _ = token_batches(1)[0]
    saved = {
        mode: saved_activation_bytes(apply_activation_checkpointing(tiny_gpt(n_layers=4), mode), x)
        for mode in ("none", "selective", "full")
    }
    assert saved["full"] < saved["selective"] < saved["none"]
    # what full AC keeps per block is its input: one (batch, seq, d_model) float tensor
    assert saved["full"] < saved["none"] / 4


def test_state_dict_keys_are_the_same_with_and_without_checkpointing():
    plain = tiny_gpt(seed=1)
    ac = apply_activation_checkpointing(tiny_gpt(seed=2), "full")
    assert list(ac.state_dict()) == list(plain.state_dict())
    assert list(get_model_state_dict(ac)) == list(get_model_state_dict(plain))
    # weights saved with AC load without it and the other way round
    set_model_state_dict(plain, get_model_state_dict(ac))
    torch.testing.assert_close(plain.state_dict(), ac.state_dict(), atol=0, rtol=0)
    other = apply_activation_checkpointing(tiny_gpt(seed=3), "selective")
    other.load_state_dict(plain.state_dict())
    torch.testing.assert_close(other.state_dict(), plain.state_dict(), atol=0, rtol=0)


@pytest.mark.parametrize("value", ["partial", "Full", None, True])
def test_config_names_the_field(value):
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing"):
        TrainConfig(activation_checkpointing=value).validate()
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing"):
        apply_activation_checkpointing(tiny_gpt(), value)


def test_config_accepts_the_modes():
    for mode in ("none", "full", "selective"):
        TrainConfig(activation_checkpointing=mode).validate()
