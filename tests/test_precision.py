"""Mixed precision: bf16/fp16 autocast, the fp16 GradScaler (overflow veto, checkpointing), the
FSDP2 bf16 policy, and an fp32 path identical to a trainer built without the argument."""

from __future__ import annotations

import pytest
import torch

from hookloop.engine import ConfigError, Events, Trainer
from hookloop.engine.config import TrainConfig
from hookloop.handlers.nan_detector import NaNDetector
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every, validate_every
from tests.conftest import tiny_gpt, token_batches
from tests.dist_utils import run_distributed


def build(precision: str | None = None, *, seed: int = 0, lr: float = 3e-3, loss_fn=cross_entropy_loss, **kw):
    model = tiny_gpt(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if precision is not None:
        kw["precision"] = precision
    return Trainer(model, opt, loss_fn, grad_clip_norm=1.0, hang_timeout_s=None, **kw)


def record_losses(trainer: Trainer) -> list[float]:
    losses: list[float] = []
    trainer.add_event_handler(Events.STEP_END, lambda: losses.append(trainer.state.loss))
    return losses


def overflow_at(steps: set[int], ref: dict):
    """A loss whose gradients overflow fp16 on the given steps; the loss itself stays finite."""

    def loss_fn(output, targets):
        loss = cross_entropy_loss(output, targets)
        return loss * 1e30 if ref["trainer"].state.step in steps else loss

    return loss_fn


def repeated(n_steps: int) -> list:
    """A few batches cycled, so the tiny model can fit them and the loss falls."""
    return token_batches(4) * (n_steps // 4 + 1)


# ---------------------------------------------------------------- arguments
def test_precision_is_validated_in_trainer_and_config():
    with pytest.raises(ConfigError) as info:
        build("bf16")
    assert info.value.field == "precision" and "bf16-mixed" in str(info.value)
    with pytest.raises(ConfigError) as info:
        TrainConfig(precision="fp8").validate()
    assert info.value.field == "train.precision" and "fp16-mixed" in str(info.value)
    TrainConfig(precision="bf16-mixed").validate()


# ---------------------------------------------------------------- bf16
def test_fp32_is_bitwise_identical_to_a_trainer_without_the_argument():
    default, explicit = build(), build("fp32")
    assert default.grad_scaler is None and explicit.grad_scaler is None
    a, b = record_losses(default), record_losses(explicit)
    default.run(token_batches(6), max_steps=6)
    explicit.run(token_batches(6), max_steps=6)
    assert a == b
    for p, q in zip(default.model.parameters(), explicit.model.parameters()):
        assert torch.equal(p, q)
    # Both equal a plain fp32 loop (so neither took a mixed-precision path).
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    params = list(model.parameters())
    plain = []
    for x, y in token_batches(6):
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        plain.append(float(loss.detach()))
    assert a == plain
    assert all(torch.equal(p, q) for p, q in zip(params, explicit.model.parameters()))


def test_bf16_forward_runs_in_bf16_in_training_and_validation():
    trainer = build("bf16-mixed")
    seen: list[tuple[bool, torch.dtype]] = []
    linear = trainer.model.blocks["0"].qkv_heads
    linear.register_forward_hook(lambda mod, inp, out: seen.append((trainer.model.training, out.dtype)))
    trainer.set_validation(token_batches(1, seed=9))
    validate_every(trainer, 2)
    trainer.run(token_batches(2), max_steps=2)
    assert seen and all(dtype == torch.bfloat16 for _, dtype in seen)
    assert {training for training, _ in seen} == {True, False}  # both training and validation
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_bf16_matches_fp32_early_and_trains():
    fp32, bf16 = build(), build("bf16-mixed")
    a, b = record_losses(fp32), record_losses(bf16)
    fp32.run(repeated(30), max_steps=30)
    bf16.run(repeated(30), max_steps=30)
    assert a != b  # really a different computation
    assert b[:5] == pytest.approx(a[:5], rel=2e-2)
    assert sum(b[-4:]) / 4 < 0.8 * (sum(b[:4]) / 4)


# ---------------------------------------------------------------- fp16 and the GradScaler
def test_fp16_overflow_is_a_skipped_step_not_a_nan():
    ref: dict = {}
    trainer = build("fp16-mixed", loss_fn=overflow_at({3}, ref))
    ref["trainer"] = trainer
    NaNDetector(action="raise").attach(trainer)
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    trainer.lr_scheduler = sched
    seen: list[tuple] = []
    state = trainer.state
    trainer.add_event_handler(
        Events.STEP_END,
        lambda: seen.append((state.step, state.control.decided.skip, state.grad_scaler_overflow)),
    )
    params_before: dict = {}
    trainer.add_event_handler(
        Events.STEP_START,
        lambda: params_before.update(
            {trainer.state.step: [p.detach().clone() for p in trainer.model.parameters()]}
        ),
    )
    state = trainer.run(token_batches(6), max_steps=6)
    assert state.step == 6 and state.skipped_steps == 1
    assert [s for s, skip, overflow in seen if skip] == [3]
    assert [s for s, skip, overflow in seen if overflow] == [3]
    assert sched.last_epoch == 5  # the LR scheduler stepped on the 5 good steps only
    assert trainer.grad_scaler.get_scale() == 2.0**15  # backed off once from 2**16
    # The overflow step changed no weight.
    after_3 = params_before[4]
    assert all(torch.equal(p, q) for p, q in zip(params_before[3], after_3))


def test_fp16_trains():
    trainer = build("fp16-mixed")
    losses = record_losses(trainer)
    trainer.run(repeated(30), max_steps=30)
    assert trainer.state.skipped_steps == 0
    assert sum(losses[-4:]) / 4 < 0.8 * (sum(losses[:4]) / 4)


def _fp16_resume_trainer(ref: dict) -> Trainer:
    trainer = build("fp16-mixed", loss_fn=overflow_at({2}, ref), grad_accum_steps=2)
    ref["trainer"] = trainer
    return trainer


def test_grad_scaler_state_resumes_exactly(tmp_path, deterministic):
    from hookloop.handlers.checkpoint import AsyncCheckpointer

    data = token_batches(16)
    ref_ctx: dict = {}
    reference = _fp16_resume_trainer(ref_ctx)
    reference.run(data, max_steps=8)
    expected = reference.grad_scaler.state_dict()
    assert expected["scale"] == 2.0**15 and expected["_growth_tracker"] == 6  # overflow at step 2

    first_ctx: dict = {}
    first = _fp16_resume_trainer(first_ctx)
    AsyncCheckpointer(tmp_path, mode="sync").attach(first)
    save_every(first, 4)
    first.run(data, max_steps=5)  # the checkpoint at step 4 holds the backed-off scale

    second_ctx: dict = {}
    second = _fp16_resume_trainer(second_ctx)
    AsyncCheckpointer(tmp_path, mode="sync").attach(second)
    save_every(second, 4)
    second.run(data, max_steps=8)
    assert second.state.step == 8
    assert second.grad_scaler.state_dict() == expected
    for p, q in zip(second.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)


def test_fp16_is_refused_with_a_pipeline():
    from hookloop.engine.pipeline import PipelineRuntime

    class FakeRuntime(PipelineRuntime):
        n_microbatches = 1
        loss_fn = None

        def __init__(self) -> None:  # no stages: refused before it would need them
            pass

        def run_step(self, *a):
            raise AssertionError

    runtime = FakeRuntime()
    runtime.module = tiny_gpt()
    with pytest.raises(ConfigError) as info:
        Trainer(
            runtime.module,
            torch.optim.SGD(runtime.module.parameters(), lr=0.1),
            cross_entropy_loss,
            step_body=runtime,
            precision="fp16-mixed",
        )
    assert info.value.field == "precision"


# ---------------------------------------------------------------- two ranks
def _overflow_on_one_rank(rank: int, world: int) -> dict:
    from hookloop.engine import init_distributed

    init_distributed()
    ref: dict = {}
    # No DDP: each rank's gradients stay its own, so only rank 1 overflows and the ranks must agree.
    trainer = build("fp16-mixed", loss_fn=overflow_at({2} if rank == 1 else set(), ref))
    ref["trainer"] = trainer
    NaNDetector(action="raise").attach(trainer)
    skipped: list[int] = []
    trainer.add_event_handler(
        Events.STEP_END, lambda: skipped.append(trainer.state.step) if trainer.control.decided.skip else None
    )
    state = trainer.run(token_batches(4), max_steps=4)  # the same data on both ranks
    return {
        "skipped": skipped,
        "skipped_steps": state.skipped_steps,
        "scaler": trainer.grad_scaler.state_dict(),
        "params": [p.detach().numpy().tobytes() for p in trainer.model.parameters()],
    }


@pytest.mark.distributed
def test_fp16_overflow_on_one_rank_is_skipped_on_both():
    a, b = run_distributed(_overflow_on_one_rank, 2)
    assert a["skipped"] == b["skipped"] == [2]
    assert a["skipped_steps"] == b["skipped_steps"] == 1
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] == 2.0**15
    assert a["params"] == b["params"]  # no rank stepped alone


def _fsdp_bf16(rank: int, world: int) -> dict:
    from hookloop.engine import init_distributed, wrap_data_parallel

    info = init_distributed()
    model = wrap_data_parallel(tiny_gpt(0), "fsdp", mesh=info.mesh, mixed_precision="bf16-mixed")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # fp32 trainer: any bf16 seen in the forward comes from the FSDP2 policy, not from autocast.
    trainer = Trainer(model, opt, cross_entropy_loss, grad_clip_norm=1.0, hang_timeout_s=None)
    dtypes: set = set()
    model.blocks["0"].qkv_heads.register_forward_hook(lambda mod, inp, out: dtypes.add(out.dtype))
    losses = record_losses(trainer)
    trainer.run(repeated(24), max_steps=24)
    return {
        "losses": losses,
        "dtypes": sorted(map(str, dtypes)),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


@pytest.mark.distributed
def test_fsdp2_bf16_policy_trains_on_two_ranks():
    a, b = run_distributed(_fsdp_bf16, 2)
    assert a["dtypes"] == b["dtypes"] == ["torch.bfloat16"]
    assert a["param_dtypes"] == ["torch.float32"]  # the sharded master weights stay fp32
    assert a["losses"] == b["losses"]  # the loss is the mean over ranks
    losses = a["losses"]
    assert sum(losses[-4:]) / 4 < 0.8 * (sum(losses[:4]) / 4)
