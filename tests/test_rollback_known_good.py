"""Rollback goes to a known-good state, with the handlers attached as the example attaches them
(``handlers.attach_handlers``: scheduler, checkpointer, NaN detector, metrics, loggers).

- A bad update leaves finite losses for two steps, then NaN: the checkpoints written after it hold
  poisoned weights. Rollback must reach a clean one, and none may be saved during the bad streak.
- A NaN before the first checkpoint rolls back to the step-0 checkpoint instead of crashing.
- After a rollback, checkpoint and validation cadence is exactly what it is without one.
"""

from __future__ import annotations

import json

import pytest
import torch

from hookloop.engine import Events, ExitCode, Trainer
from hookloop.engine.checkpoint_format.directory import MARKER, complete_checkpoints, parse_step
from hookloop.engine.checkpoint_format.manifest import read_marker
from hookloop.handlers import Places, attach_handlers, load_run_config
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches


class Poisonable(torch.nn.Module):
    """The tiny GPT plus a buffer that records a bad update (saved in checkpoints like weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt(0)
        self.register_buffer("poisoned_at", torch.tensor(-1))

    def forward(self, x):
        return self.gpt(x)


def build(tmp_path, overrides: list[str], steps: int):
    cfg = load_run_config(
        None,
        [
            f"train.run_dir={tmp_path}",
            "train.local_batch_size=2",
            "step_scheduler.global_batch_size=2",
            f"step_scheduler.max_steps={steps}",
            "checkpoint.mode=sync",
            "logging.console=false",
            "logging.log_interval=1",
            *overrides,
        ],
        world_size=1,
    )
    model = Poisonable()

    def loss_fn(output, targets):
        loss = cross_entropy_loss(output, targets)
        at = int(model.poisoned_at)
        if at >= 0 and trainer.state.step >= at + 2:  # finite for two steps after the bad update
            return loss * float("nan")
        return loss

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn)
    data = token_batches(steps + 40, batch=2)
    attached = attach_handlers(trainer, cfg, dataloader=data, dp_size=1)
    return cfg, trainer, data, attached


def steps_logged(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_poisoned_update_rolls_back_past_the_checkpoints_written_after_it(tmp_path):
    cfg, trainer, data, attached = build(
        tmp_path,
        ["step_scheduler.ckpt_every_steps=1", "checkpoint.keep_last=3", "nan.max_consecutive=2",
         "nan.max_rollbacks=3"],
        steps=24,
    )  # fmt: skip
    saved, restored = [], []
    trainer.add_event_handler(
        Events.CHECKPOINT_SAVED, lambda e, step=None, path=None: saved.append((len(restored), step))
    )
    trainer.add_event_handler(Events.ROLLBACK, lambda e: restored.append(e.state.step), priority=-10)

    @trainer.on(Events.STEP_END(once=12), priority=5)  # after the step-12 checkpoint (priority 10)
    def bad_update(engine):
        engine.model.poisoned_at.fill_(12)

    state = trainer.run(data)
    assert state.control.exit_code == ExitCode.SUCCESS and state.step == 24
    # steps 14 and 15 are NaN -> restore 13 (poisoned, NaN at once) -> restore 12, which is clean
    assert restored == [13, 12]
    assert int(trainer.model.poisoned_at) == -1
    assert torch.isfinite(torch.tensor(state.loss))
    # nothing saved during the bad streaks (14-15, then 14 again after restoring 13) ...
    assert [step for r, step in saved if r == 0] == list(range(0, 14))
    assert [step for r, step in saved if r == 1] == []
    # ... and training from the clean step 12 saves every step again, through the end
    assert [step for r, step in saved if r == 2] == list(range(13, 25))


def test_a_nan_before_the_first_checkpoint_rolls_back_to_the_initial_state(tmp_path):
    cfg, trainer, data, _ = build(
        tmp_path, ["step_scheduler.ckpt_every_steps=50", "nan.max_consecutive=2"], steps=10
    )
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    restored, snapshot = [], {}
    trainer.add_event_handler(Events.ROLLBACK, lambda e: restored.append(e.state.step), priority=-10)

    @trainer.on(Events.STEP_END(once=1), priority=5)
    def bad_update(engine):
        if not snapshot:  # once: the step after the rollback is step 1 again
            engine.model.poisoned_at.fill_(0)  # NaN from step 2 on

    @trainer.on(Events.ROLLBACK, priority=-20)
    def after_restore(engine):
        snapshot.update({k: v.clone() for k, v in engine.model.state_dict().items()})

    state = trainer.run(data)
    assert restored == [0]
    assert all(torch.equal(snapshot[k], initial[k]) for k in initial)
    assert state.step == 10 and state.control.exit_code == ExitCode.SUCCESS


def test_cadence_after_a_rollback_is_the_cadence_without_one(tmp_path):
    cfg, trainer, data, _ = build(
        tmp_path,
        ["step_scheduler.ckpt_every_steps=4", "step_scheduler.val_every_steps=4", "nan.max_consecutive=1"],
        steps=20,
    )
    trainer.set_validation(token_batches(2, batch=2, seed=5), eval_iters=1)
    saved, validated = [], []
    trainer.add_event_handler(Events.CHECKPOINT_SAVED, lambda e, step=None, path=None: saved.append(step))
    trainer.add_event_handler(Events.VALIDATION_END, lambda e: validated.append(e.state.step))
    nan_steps = {10}

    def loss_at_10(output, targets):
        loss = cross_entropy_loss(output, targets)
        return loss * float("nan") if trainer.state.step in nan_steps else loss

    trainer.loss_fn = loss_at_10
    restored = []
    trainer.add_event_handler(Events.ROLLBACK, lambda e: restored.append(e.state.step), priority=-10)

    @trainer.on(Events.ROLLBACK, priority=-20)
    def heal(_engine):
        nan_steps.clear()

    state = trainer.run(data)
    assert restored == [8] and state.step == 20
    after = [s for s in saved if s > 8]
    assert after == [12, 16, 20], saved
    assert [s for s in validated if s > 8] == [12, 16, 20], validated
    assert steps_logged(tmp_path).count(10) >= 1  # the step that triggered the rollback is logged
    assert isinstance(trainer.get_handler(AsyncCheckpointer), AsyncCheckpointer)


@pytest.mark.parametrize("keep_last", [1])
def test_no_checkpoint_old_enough_stops_with_76_and_keeps_checkpoints(tmp_path, keep_last):
    cfg, trainer, data, _ = build(
        tmp_path,
        ["step_scheduler.ckpt_every_steps=1", f"checkpoint.keep_last={keep_last}", "nan.max_consecutive=2"],
        steps=24,
    )

    @trainer.on(Events.STEP_END(once=12), priority=5)
    def bad_update(engine):
        engine.model.poisoned_at.fill_(12)

    from hookloop.engine import TrainingAborted

    with pytest.raises(TrainingAborted) as info:
        trainer.run(data)
    assert info.value.exit_code == ExitCode.NAN_ABORT
    assert "cannot roll back" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000013"]


@pytest.mark.parametrize("mode", ["sync", "async", "async_copy"])
def test_a_checkpoint_of_nan_weights_with_a_finite_loss_is_never_a_rollback_target(tmp_path, mode):
    """Step 8's update leaves NaN weights, but its own loss (taken before the update) is finite, so
    step 8 counts as good and its checkpoint is written. The marker records that the saved weights
    are not finite (checked where the state is copied, no extra sync per step): pruning keeps the
    newest finite checkpoint beside it, and the one rollback allowed goes straight to step 7."""
    cfg, trainer, data, _ = build(
        tmp_path,
        [f"checkpoint.mode={mode}", "step_scheduler.ckpt_every_steps=1", "checkpoint.keep_last=1",
         "nan.max_consecutive=2", "nan.max_rollbacks=1"],
        steps=14,
    )  # fmt: skip
    trainer.model.register_buffer("mask", torch.full((2,), float("-inf")))  # -inf on purpose: fine
    restored = []
    trainer.add_event_handler(Events.ROLLBACK, lambda e: restored.append(e.state.step), priority=-10)

    done = []

    @trainer.on(Events.STEP_END(once=8), priority=Places.CHECKPOINT + 1)  # before step 8's save
    def nan_update(engine):
        if not done:  # once: step 8 comes again after the rollback
            done.append(True)
            engine.model.gpt.head.weight.data[0, 0] = float("nan")

    state = trainer.run(data)
    assert state.control.exit_code == ExitCode.SUCCESS and state.step == 14, state.control.stop_reason
    assert restored == [7]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    markers = {
        parse_step(p.name): json.loads((p / MARKER).read_text())
        for p in (tmp_path / "checkpoints").glob("step_*")
    }
    assert all(m["finite"] is True for m in markers.values()), markers.keys()


@pytest.mark.parametrize("mode", ["sync", "async", "async_copy"])
def test_the_marker_records_whether_the_saved_state_is_finite(tmp_path, mode):
    """Parameters and floating optimizer state are checked (here an Adam moment), buffers are not."""
    model = tiny_gpt(0)
    model.register_buffer("mask", torch.full((2,), float("-inf")))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cross_entropy_loss)
    checkpointer = AsyncCheckpointer(tmp_path, mode=mode, keep_last=5).attach(trainer)
    save_every(trainer, 1)

    @trainer.on(Events.STEP_END(once=2), priority=Places.CHECKPOINT + 1)
    def inf_moment(engine):
        next(iter(engine.optimizer.state.values()))["exp_avg"].view(-1)[0] = float("inf")

    trainer.run(token_batches(4), max_steps=2)
    checkpointer.close()
    finite = {s: read_marker(p)["finite"] for s, p in complete_checkpoints(tmp_path)[0]}
    assert finite == {1: True, 2: False}
