"""The NaN detector's skip decided on the device: a fused optimizer skips a bad step through its
``found_inf`` with nothing read to the host, and the detector reads its verdicts at the next step
that reads anyway (a log step, a save, the run's end). Real training, real faults (the
FaultInjector's NaN losses), real gloo ranks and checkpoints."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hookloop.engine import Events, Priority, Trainer
from hookloop.handlers import FaultInjector, MetricsTracker, NaNDetector
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import run_distributed


def _snapshots(trainer: Trainer, model: torch.nn.Module, opt: torch.optim.Optimizer) -> list:
    """Per step run, in order, ``(step, same)``: whether the weights and every optimizer state
    tensor (exp_avg, exp_avg_sq, step) are bitwise what they were at the step's start; taken early
    at STEP_END, before a rollback."""
    before: dict = {}
    unchanged: list = []

    @trainer.on(Events.STEP_START)
    def snapshot(e):
        before[e.state.step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"]))

    @trainer.on(Events.STEP_END, priority=Priority.CLOCK)
    def compare(e):
        params, opt_state = before[e.state.step]
        now = opt.state_dict()["state"]
        same_params = all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
        same_opt = bool(opt_state) and all(
            torch.equal(now[i][k], v) for i, st in opt_state.items() for k, v in st.items()
        )
        unchanged.append((e.state.step, same_params and same_opt))

    compare.asks_after_agreement = False  # an observer: the step's end needs no late agreement
    return unchanged


def observer(fn):
    """``fn`` as a handler that asks the loop for nothing after the step's agreement."""
    fn.asks_after_agreement = False
    return fn


def test_a_bad_step_is_skipped_on_the_device_and_counted_at_the_next_log_step():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    trainer = Trainer(model, opt, cross_entropy_loss, lr_scheduler=schedule)
    FaultInjector(kind="nan", microbatches=[2, 5]).attach(trainer)  # steps 3 and 6
    detector = NaNDetector(action="warn").attach(trainer)
    MetricsTracker(log_interval=4).attach(trainer)
    unchanged = _snapshots(trainer, model, opt)
    known: dict = {}

    @trainer.on(Events.STEP_END, priority=Priority.CLEANUP)
    @observer
    def what_the_host_knows(e):
        known[e.state.step] = (detector.total, e.state.skipped_steps, schedule.last_epoch)

    state = trainer.run(token_batches(10), max_epochs=1)
    assert trainer.skips_on_device and detector.skips_on_device
    assert [s for s, same in unchanged if same] == [3, 6]  # weights, exp_avg(_sq), step
    assert all(int(st["step"]) == 8 for st in opt.state.values())  # 10 steps, 2 skipped
    # Step 3 is not read at its own step: the host learns of it at log step 4 (and of step 6 at 8),
    # when the LR schedule moves back to the applied steps' count.
    assert known[3] == (0, 0, 3) and known[4] == (1, 1, 3)
    assert known[6] == (1, 1, 5) and known[7] == (1, 1, 6) and known[8] == (2, 2, 6)
    assert state.skipped_steps == 2 and detector.total == 2 and list(detector.bad_steps) == [3, 6]
    assert schedule.last_epoch == 8 and opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 9)
    assert detector.last_good_step == 10 and state.metrics["nan/bad_steps"] == 2


def test_a_save_step_reads_the_verdict_and_never_saves_a_bad_streak(tmp_path):
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(model, opt, cross_entropy_loss)
    AsyncCheckpointer(tmp_path / "ckpt", mode="sync", resume=None, keep_last=10).attach(trainer)
    save_every(trainer, 4)
    FaultInjector(kind="nan", microbatches=[6, 7, 8, 9]).attach(trainer)  # steps 7-10
    detector = NaNDetector(max_consecutive=10).attach(trainer)  # "rollback": holds saves while bad
    MetricsTracker(log_interval=100).attach(trainer)
    trainer.run(token_batches(12), max_epochs=1)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    # step 8 is in the streak: its save is held (the save step read steps 7 and 8); the end saves 12
    assert saved == ["step_00000000", "step_00000004", "step_00000012"]  # 0: the initial state
    assert list(detector.bad_steps) == [7, 8, 9, 10]


def _rank_run(rank: int, world: int, base: str) -> dict:
    from hookloop.engine import init_distributed, wrap_data_parallel
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    init_distributed("gloo")
    torch.manual_seed(0)
    model = wrap_data_parallel(tiny_gpt(), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(model, opt, cross_entropy_loss)
    AsyncCheckpointer(f"{base}/ckpt", mode="sync", resume=None, keep_last=10).attach(trainer)
    save_every(trainer, 5)
    FaultInjector(kind="nan", microbatches=[5, 6, 7]).attach(trainer)  # steps 6, 7, 8 on every rank
    detector = NaNDetector(max_consecutive=2).attach(trainer)
    MetricsTracker(log_interval=4).attach(trainer)
    unchanged = _snapshots(trainer, model, opt)
    rolled: list = []
    trainer.add_event_handler(Events.ROLLBACK, observer(lambda e: rolled.append(e.state.step)), priority=-1)
    state = trainer.run(token_batches(20, seed=rank), max_steps=12)
    return {
        "on_device": detector.skips_on_device,
        "unchanged": [s for s, same in unchanged if same],
        "steps_run": [s for s, _ in unchanged],
        "rolled_to": rolled,
        "rollbacks": detector.rollbacks,
        "restored": detector.restored_step,
        "step": state.step,
        "params": [p.detach().numpy().copy() for p in model.parameters()],  # (tensors do not travel)
        "exp_avg": [st["exp_avg"].numpy().copy() for st in opt.state.values()],
    }


@pytest.mark.distributed
def test_two_ranks_skip_on_the_device_and_roll_back_after_max_consecutive(tmp_path):
    a, b = run_distributed(_rank_run, 2, str(tmp_path), timeout=240)
    for r in (a, b):
        assert r["on_device"]
        # Steps 6-8 are NaN on both ranks: weights and optimizer state stay exactly as they were.
        assert r["unchanged"] == [6, 7, 8], r["unchanged"]
        # Read at log step 8 (3 bad in a row, max_consecutive=2): back to the step-5 checkpoint,
        # the last good step; then on to step 12 past the bad microbatches.
        assert r["rolled_to"] == [5] and r["rollbacks"] == 1 and r["restored"] == 5
        assert r["steps_run"] == [*range(1, 9), *range(6, 13)]
        assert r["step"] == 12
    for x, y in zip(a["params"] + a["exp_avg"], b["params"] + b["exp_avg"]):
        assert np.array_equal(x, y)


def test_the_weight_average_skips_a_step_skipped_on_the_device():
    from hookloop.handlers import WeightEMA

    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(model, opt, cross_entropy_loss)
    FaultInjector(kind="nan", microbatches=[3]).attach(trainer)  # step 4
    NaNDetector(action="warn").attach(trainer)
    MetricsTracker(log_interval=100).attach(trainer)
    ema = WeightEMA(decay=0.5).attach(trainer)
    moved: list = []
    before: dict = {}

    @trainer.on(Events.STEP_START)
    def snapshot(e):
        before["avg"] = {k: v.clone() for k, v in ema.average.items()}

    @trainer.on(Events.STEP_END, priority=Priority.DEFAULT)
    @observer
    def compare(e):
        same = all(torch.equal(v, before["avg"][k]) for k, v in ema.average.items())
        moved.append((e.state.step, not same))

    trainer.run(token_batches(6), max_epochs=1)
    assert [s for s, m in moved if not m] == [4]  # the average moved on every applied step only
    assert ema.updates == 5
