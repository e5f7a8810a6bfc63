"""Stop at step 10 (exit 75) and resume: the final model, optimizer, RNG states and counters are
bitwise those of an uninterrupted run, with dropout on, for every loader the project ships or
documents: MixtureLoader with and without worker processes, a shuffled DataLoader, a plain list."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hookloop.engine import Events, ExitCode, Priority, Trainer
from hookloop.engine.data import MixtureDataset, MixtureLoader, MixtureSampler
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches

TOTAL, STOP = 16, 10


pytestmark = pytest.mark.usefixtures("deterministic")


def _pairs(n: int, seed: int) -> list:
    return [(x[0], y[0]) for x, y in token_batches(n, batch=1, seed=seed)]


def make_loader(kind: str):
    if kind == "list":
        return token_batches(24, seed=4)
    if kind == "shuffled":
        return torch.utils.data.DataLoader(
            _pairs(24, 3), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
    mixture = MixtureDataset({"a": _pairs(40, 1), "b": _pairs(30, 2)})
    sampler = MixtureSampler(mixture, {"a": 1.0, "b": 2.0}, seed=5)
    workers = 2 if kind == "mixture_workers" else 0
    return MixtureLoader(sampler, 2, num_workers=workers)


def prepare(microbatch, device):
    x, y = microbatch[0], microbatch[1]  # a mixture batch carries its source index third
    return x.to(device), y.to(device)


def make_trainer(seed: int) -> Trainer:
    model = tiny_gpt(seed, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    return Trainer(
        model,
        optimizer,
        cross_entropy_loss,
        lr_scheduler=scheduler,
        grad_accum_steps=2,
        prepare_batch=prepare,
    )


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def final_state(trainer: Trainer) -> dict:
    out = {f"p.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, s in enumerate(trainer.optimizer.state.values()):
        out.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    out["rng.torch"] = torch.get_rng_state()
    out["rng.python"] = torch.tensor(random.getstate()[1])
    out["rng.numpy"] = torch.from_numpy(np.random.get_state()[1].astype(np.int64))
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} tensors differ: {different[:6]}"


@pytest.mark.parametrize("kind", ["mixture", "mixture_workers", "shuffled", "list"])
def test_stop_and_resume_is_bitwise_with_every_shipped_loader(tmp_path, kind):
    seed_all(11)
    ref = make_trainer(0)
    AsyncCheckpointer(tmp_path / "ref", mode="sync").attach(ref)
    save_every(ref, 5)
    ref.run(make_loader(kind), max_steps=TOTAL)
    expected, expected_counters = final_state(ref), ref.state.counters()

    seed_all(11)
    first = make_trainer(0)
    AsyncCheckpointer(tmp_path / "run", mode="sync").attach(first)
    save_every(first, 5)

    @first.on(Events.STEP_END, priority=Priority.DECIDE)
    def stop(engine):
        if engine.state.step == STOP:
            engine.control.request_stop("test stop", ExitCode.STOPPED)

    state = first.run(make_loader(kind), max_steps=TOTAL)
    assert (state.step, state.control.exit_code) == (STOP, ExitCode.STOPPED)

    seed_all(99)  # a new process starts from other RNG states and another model init
    second = make_trainer(7)
    AsyncCheckpointer(tmp_path / "run", mode="sync").attach(second)
    save_every(second, 5)
    second.run(make_loader(kind), max_steps=TOTAL)
    assert second.state.counters() == expected_counters
    assert_bitwise(final_state(second), expected)
