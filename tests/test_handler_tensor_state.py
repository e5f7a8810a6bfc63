"""Handler tensor state (``tensor_state_dict()``): saved through DCP beside the model, not in the
rank file, restored on resume and rollback, verified by the manifest, with no cap but the model's."""

from __future__ import annotations

import glob
import json
import logging
import os

import pytest
import torch

from hookloop.engine import Events, ExitCode, Handler, Priority
from hookloop.engine.checkpoint_format.directory import step_dir_name
from hookloop.engine.checkpoint_format.safe_read import SafeReader
from hookloop.handlers.checkpoint import AsyncCheckpointer, CheckpointError
from hookloop.handlers.checkpoint.rank_file import MAX_BYTES
from tests.cadence import save_every
from tests.test_checkpoint import assert_bitwise, make_trainer, seed_all, shuffled_loader, snapshot, stop_at

pytestmark = pytest.mark.usefixtures("deterministic")


class WeightSum(Handler):
    """Sums the weights after every step into parameter-shaped tensors (tensor state) and counts the
    steps (small state, in the rank file)."""

    def __init__(self, extra_numel: int = 0) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.extra_numel = extra_numel

    def attach(self, trainer):
        self.sums = {n: torch.zeros_like(p) for n, p in trainer.model.named_parameters()}
        if self.extra_numel:  # larger than the rank file may hold
            self.sums["big"] = torch.zeros(self.extra_numel)
        trainer.add_event_handler(Events.STEP_END, self._add, priority=Priority.OBSERVE)
        return super().attach(trainer)

    @torch.no_grad()
    def _add(self, trainer) -> None:
        for n, p in trainer.model.named_parameters():
            self.sums[n].add_(p)
        if "big" in self.sums:
            self.sums["big"].add_(1.0)
        self.steps += 1

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]

    def tensor_state_dict(self) -> dict[str, torch.Tensor]:
        return self.sums


def sums(handler: WeightSum) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in handler.sums.items()}


@pytest.mark.parametrize(("mode", "stop"), [("async", 5), ("sync", 4), ("async_copy", 7)])
def test_tensor_state_goes_through_dcp_and_resumes_bitwise(tmp_path, mode, stop):
    seed_all()
    ref = make_trainer()
    expected = WeightSum().attach(ref)
    ref.run(shuffled_loader(), max_steps=9)

    seed_all()
    first = make_trainer()
    WeightSum().attach(first)
    AsyncCheckpointer(tmp_path, mode=mode).attach(first)
    save_every(first, 3)
    stop_at(first, stop)
    assert first.run(shuffled_loader(), max_steps=9).control.exit_code == ExitCode.STOPPED

    path = os.path.join(tmp_path, step_dir_name(stop))
    index = SafeReader(path).read_metadata().state_dict_metadata
    saved = {k for k in index if k.startswith("handlers.WeightSum.")}
    assert saved == {f"handlers.WeightSum.{n}" for n in expected.sums}
    (rank_file,) = glob.glob(os.path.join(path, "rank_*.json"))
    with open(rank_file) as f:
        small = json.load(f)["handlers"]["WeightSum"]
    assert 0 < len(json.dumps(small)) < 100  # the small state stays in the rank file, the tensors not

    seed_all(99)
    second = make_trainer(seed=5)
    resumed = WeightSum().attach(second)
    AsyncCheckpointer(tmp_path, mode=mode).attach(second)
    save_every(second, 3)
    second.run(shuffled_loader(), max_steps=9)
    assert resumed.steps == expected.steps == 9
    assert_bitwise(sums(resumed), sums(expected))
    assert_bitwise(snapshot(second), snapshot(ref))


def test_tensor_state_larger_than_the_rank_file_cap_saves_and_is_verified(tmp_path):
    numel = MAX_BYTES // 4 + 1024  # over the cap even as raw float32 bytes
    trainer = make_trainer()
    big = WeightSum(extra_numel=numel).attach(trainer)
    AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    save_every(trainer, 2)
    trainer.run(shuffled_loader(), max_steps=2)
    assert float(big.sums["big"][0]) == 2.0

    path = os.path.join(tmp_path, step_dir_name(2))
    # flip one byte of the largest DCP file: the manifest finds it and the resume refuses the checkpoint
    data = max(glob.glob(os.path.join(path, "*.distcp")), key=os.path.getsize)
    assert os.path.getsize(data) > numel * 4
    other = make_trainer(seed=1)
    restored = WeightSum(extra_numel=numel).attach(other)
    AsyncCheckpointer(tmp_path, resume=path).attach(other)
    other.run(shuffled_loader(), max_steps=2)  # resumed at the last step: nothing left to train
    assert float(restored.sums["big"][-1]) == 2.0

    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged = make_trainer(seed=1)
    WeightSum(extra_numel=numel).attach(damaged)
    AsyncCheckpointer(tmp_path, resume=path).attach(damaged)
    with pytest.raises(CheckpointError, match="damaged"):
        damaged.run(shuffled_loader(), max_steps=3)


def test_rollback_restores_tensor_state_with_the_model(tmp_path):
    trainer = make_trainer()
    handler = WeightSum().attach(trainer)
    AsyncCheckpointer(tmp_path, mode="async").attach(trainer)
    save_every(trainer, 3)
    at_save, after = {}, {}

    @trainer.on(Events.STEP_END, priority=Priority.DECIDE - 900)
    def _remember(engine):
        if engine.state.step == 3 and not at_save:
            at_save.update(sums(handler))

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def _bad_step(engine):
        if engine.state.step == 5 and not after:
            engine.control.request_skip()
            engine.control.request_rollback()
            engine.fire(Events.ROLLBACK)
            after.update(sums(handler))

    trainer.run(shuffled_loader(), max_steps=6)
    assert trainer.state.rollbacks == 1
    assert_bitwise(after, at_save)


def test_missing_tensor_state_starts_fresh_and_another_shape_is_refused(tmp_path, caplog):
    first = make_trainer()
    AsyncCheckpointer(tmp_path).attach(first)
    save_every(first, 2)
    first.run(shuffled_loader(), max_steps=2)  # no tensor state in this checkpoint

    second = make_trainer()
    fresh = WeightSum().attach(second)
    AsyncCheckpointer(tmp_path).attach(second)
    save_every(second, 2)
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        second.run(shuffled_loader(), max_steps=4)
    assert "handler tensor state 'WeightSum' is not in the checkpoint" in caplog.text
    assert fresh.steps == 2  # steps 3 and 4 only

    third = make_trainer()
    wrong = WeightSum().attach(third)
    wrong.sums = {k: torch.zeros(v.numel() + 1) for k, v in wrong.sums.items()}
    AsyncCheckpointer(tmp_path).attach(third)
    with pytest.raises(CheckpointError, match=r"handler 'WeightSum' tensor .* has shape"):
        third.run(shuffled_loader(), max_steps=6)


def test_tensor_state_dict_must_return_tensors(tmp_path):
    class Bad(WeightSum):
        def tensor_state_dict(self):
            return {"n": 3}

    trainer = make_trainer()
    Bad().attach(trainer)
    AsyncCheckpointer(tmp_path).attach(trainer)
    save_every(trainer, 1)
    with pytest.raises(CheckpointError, match=r"tensor_state_dict\(\) must return a dict of name -> tensor"):
        trainer.run(shuffled_loader(), max_steps=1)
