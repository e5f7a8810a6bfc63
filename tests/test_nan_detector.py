"""NaNDetector on real training with injected faults: skip, raise, agree across ranks, spikes."""

import copy
import math

import pytest
import torch

from hookloop.engine import ConfigError, Events, ExitCode, Trainer, TrainingAborted
from hookloop.handlers.nan_detector import NaNDetector
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import run_distributed


def poisoned_loss(trainer_ref: dict, bad_steps: set, factor: float = float("nan")):
    """cross-entropy, multiplied by ``factor`` on ``bad_steps`` (NaN poisons the gradients too)."""

    def loss_fn(out, y):
        loss = cross_entropy_loss(out, y)
        return loss * factor if trainer_ref["t"].state.step in bad_steps else loss

    return loss_fn


def build(bad_steps: set, factor: float = float("nan"), fused: bool = False, **kwargs):
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    ref: dict = {}
    trainer = Trainer(model, opt, poisoned_loss(ref, bad_steps, factor), grad_accum_steps=2)
    ref["t"] = trainer
    detector = NaNDetector(**kwargs)
    detector.attach(trainer)
    return trainer, model, opt, detector


@pytest.mark.parametrize("fused", [False, True], ids=["host skip", "device skip"])
def test_isolated_bad_steps_are_skipped_and_leave_state_bitwise_unchanged(fused):
    # fused AdamW: the skip is decided on the device (found_inf), the verdict read at STEP_END
    trainer, model, opt, detector = build({3, 6}, action="warn", fused=fused)
    assert detector.skips_on_device is fused
    before: dict = {}

    @trainer.on(Events.STEP_START)
    def snapshot(e):
        before[e.state.step] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"]))

    changed = {}

    @trainer.on(Events.STEP_END)
    def compare(e):
        params, opt_state = before[e.state.step]
        same_params = all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
        now = opt.state_dict()["state"]
        same_opt = all(torch.equal(now[i][k], v) for i, st in opt_state.items() for k, v in st.items())
        changed[e.state.step] = not (same_params and same_opt)

    state = trainer.run(token_batches(16), max_epochs=1)
    assert state.step == 8 and state.skipped_steps == 2
    assert [s for s, c in changed.items() if not c] == [3, 6]
    assert detector.total == 2 and list(detector.bad_steps) == [3, 6]
    assert detector.last_good_step == 8 and detector.consecutive == 0
    assert state.metrics["nan/bad_steps"] == 2


def test_raise_stops_with_the_documented_code_naming_the_step():
    trainer, *_ = build({2}, action="raise")
    with pytest.raises(TrainingAborted, match="step 2") as info:
        trainer.run(token_batches(8))
    assert info.value.exit_code == ExitCode.NAN_ABORT == 76


def test_grad_norm_check_and_spikes():
    # A finite loss 1000x the median counts as bad with spike_factor; without it, it is a good step.
    trainer, _, _, detector = build({12}, factor=1000.0, action="warn", spike_factor=5.0)
    state = trainer.run(token_batches(28), max_epochs=1)
    assert list(detector.bad_steps) == [12] and state.skipped_steps == 1
    trainer, _, _, detector = build({12}, factor=1000.0, action="warn")
    assert trainer.run(token_batches(28), max_epochs=1).skipped_steps == 0


def test_rollback_without_checkpointer_is_an_attach_time_error():
    model = tiny_gpt()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy_loss)
    with pytest.raises(ConfigError, match="checkpointer") as info:
        NaNDetector(action="rollback").attach(trainer)
    assert info.value.field == "nan.action"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(action="ignore"), "nan.action"),
        (dict(max_consecutive=0), "nan.max_consecutive"),
        (dict(max_rollbacks=-1), "nan.max_rollbacks"),
        (dict(spike_factor=0.5), "nan.spike_factor"),
        (dict(spike_window=0), "nan.spike_window"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        NaNDetector(**kwargs)
    assert info.value.field == field


def test_state_dict_round_trip():
    trainer, _, _, detector = build({2, 3}, action="warn", spike_factor=3.0)
    trainer.run(token_batches(10), max_epochs=1)
    other = NaNDetector(action="warn", spike_factor=3.0)
    other.load_state_dict(detector.state_dict())
    assert other.state_dict() == detector.state_dict()
    assert other.state_dict()["bad_steps"] == [2, 3]


def _one_rank_nan(rank: int, world: int) -> dict:
    from hookloop.engine import init_distributed, wrap_data_parallel

    init_distributed()
    model = wrap_data_parallel(tiny_gpt(), "ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref: dict = {}
    bad = {2} if rank == 1 else set()
    trainer = Trainer(model, opt, poisoned_loss(ref, bad))
    ref["t"] = trainer
    detector = NaNDetector(action="warn", check_grad_norm=False)
    detector.attach(trainer)
    skipped = []
    trainer.add_event_handler(
        Events.STEP_END, lambda e: skipped.append(e.state.step) if e.control.decided.skip else None
    )
    state = trainer.run(token_batches(4, seed=rank), max_epochs=1)
    return {
        "skipped": skipped,
        "step": state.step,
        "psum": float(sum(p.double().sum() for p in model.parameters())),
    }


@pytest.mark.distributed
def test_nan_on_one_rank_only_skips_the_step_on_both():
    # check_grad_norm=False: rank 0's loss is finite and DDP's all-reduce spreads rank 1's NaN
    # gradients, so only the loss vote (rank 1 alone) decides: both ranks must still skip.
    a, b = run_distributed(_one_rank_nan, 2)
    assert a["skipped"] == b["skipped"] == [2]
    assert a["step"] == b["step"] == 4
    assert a["psum"] == b["psum"]


# ---------------------------------------------------------------- rollback with a real checkpointer
def _rollback_run(tmp_path, poisoned: set, max_rollbacks: int = 3, fused: bool = False):
    """Microbatch i is poisoned (its loss is NaN) when i is in ``poisoned``; poison is tied to the
    data, so a rollback that re-fed the same batches would fail again."""
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    data = [(x, y, i) for i, (x, y) in enumerate(token_batches(40))]
    current: dict = {}

    def prepare(mb, device):
        current["index"] = mb[2]
        return mb[0], mb[1]

    def loss_fn(out, y):
        loss = cross_entropy_loss(out, y)
        return loss * float("nan") if current["index"] in poisoned else loss

    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    trainer = Trainer(model, opt, loss_fn, prepare_batch=prepare)
    ckpt = AsyncCheckpointer(tmp_path / "ckpt", mode="sync", resume=None)
    ckpt.attach(trainer)
    save_every(trainer, 4)
    detector = NaNDetector(max_consecutive=2, max_rollbacks=max_rollbacks)
    detector.attach(trainer)
    log: dict = {"indices": [], "at_rollback": None, "saved": {}}
    trainer.add_event_handler(
        Events.STEP_END, lambda e: log["indices"].append((e.state.step, current["index"]))
    )

    @trainer.on(Events.STEP_END, priority=-5)  # after the checkpointer's save at priority 10
    def remember(e):
        log["saved"][e.state.step] = copy.deepcopy(model.state_dict())

    @trainer.on(Events.ROLLBACK, priority=-1)  # after the checkpointer restored
    def after(e):
        log["at_rollback"] = (e.state.step, copy.deepcopy(model.state_dict()))

    return trainer, detector, log, data


@pytest.mark.parametrize("fused", [False, True], ids=["host skip", "device skip"])
def test_rollback_restores_the_checkpoint_and_moves_past_the_bad_window(tmp_path, fused):
    trainer, detector, log, data = _rollback_run(tmp_path, poisoned={9, 10}, fused=fused)
    state = trainer.run(data, max_steps=20)
    # Steps 10 and 11 (microbatches 9, 10) are bad: rollback to the step-8 checkpoint.
    step, params = log["at_rollback"]
    assert step == 8
    for k, v in log["saved"][8].items():
        assert torch.equal(params[k], v), k
    assert detector.rollbacks == 1 and state.rollbacks == 1
    # After the rollback, step 9 trains on microbatch 11: past the bad window, not re-fed.
    after = [i for s, i in log["indices"][11:]]
    assert log["indices"][11] == (9, 11)
    assert 9 not in after and 10 not in after
    assert state.step == 20 and math.isfinite(state.loss)
    assert state.control.exit_code == 0


def test_the_whole_step_end_firing_sees_the_step_that_triggered_the_rollback(tmp_path):
    """Step 11 triggers the rollback to step 8 during its STEP_END. Every STEP_END handler of that
    firing, also those below the detector's priority down to the lowest a handler may take, sees
    step 11 with its NaN loss; ROLLBACK handlers see the restored step 8; the next step is 9 and no
    handler ever sees step 8 (or 9) with a NaN loss."""
    from hookloop.handlers import Places, Priority

    trainer, detector, log, data = _rollback_run(tmp_path, poisoned={9, 10})
    seen: list = []
    for name, priority in [("early", Priority.DEFAULT), ("late", Places.ROLLBACK_REQUEST - 1),
                           ("last", Places.PROFILE_END - 1)]:  # fmt: skip
        trainer.add_event_handler(
            Events.STEP_END,
            lambda e, name=name: seen.append(("STEP_END", name, e.state.step, e.state.loss)),
            priority=priority,
        )
    trainer.add_event_handler(
        Events.ROLLBACK, lambda e: seen.append(("ROLLBACK", "", e.state.step, None)), priority=-1
    )
    trainer.add_event_handler(
        Events.STEP_START, lambda e: seen.append(("STEP_START", "", e.state.step, None))
    )
    state = trainer.run(data, max_steps=12)
    assert state.rollbacks == 1 and state.step == 12
    at = seen.index(("ROLLBACK", "", 8, None))
    firing = seen[at - 3 : at]
    assert [(event, name, step) for event, name, step, _ in firing] == [
        ("STEP_END", "early", 11), ("STEP_END", "late", 11), ("STEP_END", "last", 11)
    ]  # fmt: skip
    assert all(math.isnan(loss) for *_, loss in firing)
    assert seen[at + 1] == ("STEP_START", "", 9, None)
    step_ends = [(step, loss) for event, _, step, loss in seen if event == "STEP_END"]
    assert all(math.isfinite(loss) for step, loss in step_ends if step not in (10, 11))


@pytest.mark.parametrize("fused", [False, True], ids=["host skip", "device skip"])
def test_rollbacks_exhausted_raise_and_leave_the_last_good_checkpoint(tmp_path, fused):
    from hookloop.engine.checkpoint_format.directory import read_latest

    poisoned = set(range(9, 40))
    trainer, detector, log, data = _rollback_run(tmp_path, poisoned=poisoned, max_rollbacks=1, fused=fused)
    ckpt_dir = tmp_path / "ckpt" / "step_00000008"
    with pytest.raises(TrainingAborted, match="rollbacks") as info:
        trainer.run(data, max_steps=30)
    assert info.value.exit_code == ExitCode.NAN_ABORT
    assert detector.rollbacks == 1
    assert ckpt_dir.is_dir()
    assert read_latest(tmp_path / "ckpt") == "step_00000008"
    # step 0: the initial state the detector asks for, so even an early NaN can roll back
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_00000000",
        "step_00000004",
        "step_00000008",
    ]
