"""The trainer's constructor refuses each argument it cannot take, by name, before it builds anything."""

import pytest
import torch

from hookloop.engine import Trainer
from hookloop.engine.errors import ConfigError


def _parts():
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"model": "not a module"}, TypeError, "model must be a torch.nn.Module"),
        ({"optimizer": object()}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
        ({"prepare_batch": "x"}, TypeError, "prepare_batch must be callable"),
        ({"grad_clip_norm": 0}, ConfigError, "grad_clip_norm"),
        ({"grad_clip_norm": True}, ConfigError, "grad_clip_norm"),
        ({"precision": "fp8"}, ConfigError, "precision"),
        ({"hang_timeout_s": float("inf")}, ConfigError, "hang_timeout_s"),
        ({"hang_timeout_s": True}, ConfigError, "hang_timeout_s"),
        ({"grad_accum_steps": 0}, ConfigError, "grad_accum_steps"),
        ({"step_body": object()}, TypeError, "step_body"),
    ],
)
def test_each_argument_is_refused_by_name(kwargs, error, names):
    model, optimizer, loss_fn = _parts()
    args = {"model": model, "optimizer": optimizer, "loss_fn": loss_fn, **kwargs}
    with pytest.raises(error, match=names):
        Trainer(args.pop("model"), args.pop("optimizer"), args.pop("loss_fn"), **args)
