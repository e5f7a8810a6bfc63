"""Tensor (and sequence) parallelism on real gloo process groups: the bundled GPT under tp=2,
dp=2 x tp=2 and pp=2 x tp=2 against one process on the same global batch (losses, gradient norms
with clipping, token counts, 20 steps), and the checks that refuse bad layouts before any work."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

STEPS = 20
N_MB = 2  # microbatches per step
MB = 2  # samples per microbatch on one data-parallel rank
CLIP = 0.2  # small enough that every step clips: the norm must be the global one
REL = 1e-5
GPT_ARGS = dict(n_heads=4)  # 2 layers, d_model 32, vocab 64, seq 16 (tests.conftest.tiny_gpt)


def _record(trainer) -> dict:
    from hookloop.engine import Events

    seen: dict = {"loss": [], "grad_norm": [], "tokens": []}

    @trainer.on(Events.STEP_END)
    def record(engine):
        seen["loss"].append(float(engine.state.loss))
        seen["grad_norm"].append(float(engine.state.grad_norm))
        seen["tokens"].append(int(engine.state.tokens_seen))

    return seen


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(dp: int) -> dict:
    """One process, the global batch: microbatches of ``MB * dp`` samples, ``N_MB`` per step."""
    from hookloop.engine import Trainer
    from hookloop.models.gpt import cross_entropy_loss
    from tests.conftest import tiny_gpt, token_batches

    model = tiny_gpt(**GPT_ARGS)
    trainer = Trainer(
        model,
        _optimizer(model.parameters()),
        cross_entropy_loss,
        grad_accum_steps=N_MB,
        grad_clip_norm=CLIP,
        hang_timeout_s=None,
        graceful_sigint=False,
    )
    seen = _record(trainer)
    trainer.run(token_batches(STEPS * N_MB, batch=MB * dp), max_steps=STEPS)
    seen["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return seen


def _tp_worker(rank: int, world: int, tp: int, pp: int, dp_mode: str, sp: bool) -> dict:
    from hookloop.engine import Trainer, build_pipeline, init_distributed, wrap_data_parallel
    from hookloop.engine.parallel import parallel_mesh
    from hookloop.engine.pipeline import PipelineConfig
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.models.gpt import cross_entropy_loss, tp_plan
    from tests.conftest import tiny_gpt, token_batches

    info = init_distributed("gloo", **parallel_mesh(world, tp, pp))
    dp = world // (tp * pp)
    dp_rank = info.dim_rank("dp")
    assert dp_rank == rank // (tp * pp) and info.dim_size("tp") == tp
    full = token_batches(STEPS * N_MB, batch=MB * dp)
    local = [(x[dp_rank * MB : (dp_rank + 1) * MB], y[dp_rank * MB : (dp_rank + 1) * MB]) for x, y in full]
    model = tiny_gpt(**GPT_ARGS)
    runtime = None
    if pp > 1:
        cfg = PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=MB, pp_batch_size=MB * N_MB)
        runtime = build_pipeline(
            model, cfg, info, cross_entropy_loss, dp_mode=dp_mode, tp_plan=tp_plan, sequence_parallel=sp
        )
        model = runtime.module
    else:
        apply_tensor_parallel(model, info.mesh_dim("tp"), tp_plan, sequence_parallel=sp)
        model = wrap_data_parallel(model, dp_mode, mesh=info.mesh_dim("dp"))
    trainer = Trainer(
        model,
        _optimizer(model.parameters()),
        cross_entropy_loss,
        grad_accum_steps=N_MB,
        grad_clip_norm=CLIP,
        pipeline=runtime,
        hang_timeout_s=60,
        graceful_sigint=False,
    )
    seen = _record(trainer)
    trainer.run(local, max_steps=STEPS)
    params = {}
    for name, p in model.named_parameters():
        full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[_strip(name)] = full_p.detach().numpy().copy()  # tensors do not cross processes
    seen["params"] = params
    seen["param_kinds"] = sorted({type(p).__name__ for p in model.parameters()})
    return seen


def _strip(name: str) -> str:
    """A wrapped / staged parameter name as the plain model's: ``0.blocks.1.qkv.weight`` (stage
    index first) or ``module.blocks...`` -> ``blocks.1.qkv.weight``."""
    parts = [p for p in name.split(".") if p not in ("module", "_checkpoint_wrapped_module")]
    if parts and parts[0].isdigit() and len(parts) > 1 and not parts[1].isdigit():
        parts = parts[1:]
    return ".".join(parts)


def _check(per_rank: list[dict], ref: dict) -> None:
    for rank, got in enumerate(per_rank):
        assert "DTensor" in got["param_kinds"], (rank, got["param_kinds"])
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL), rank
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), rank
        assert got["tokens"] == ref["tokens"], rank  # every token once: tokens/s and MFU are right
        assert min(got["grad_norm"]) > CLIP  # every step clipped
    covered: dict[str, torch.Tensor] = {}
    for got in per_rank:
        covered.update(got["params"])
    assert sorted(covered) == sorted(ref["params"])
    for name, value in covered.items():
        torch.testing.assert_close(
            torch.from_numpy(value),
            ref["params"][name],
            rtol=1e-3,
            atol=1e-3,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp2_matches_one_process(sp):
    per_rank = run_distributed(_tp_worker, 2, 2, 1, "ddp", sp, timeout=180)
    _check(per_rank, _reference(dp=1))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("dp_mode", ["fsdp", "ddp"])
def test_dp2_tp2_matches_one_process(dp_mode):
    per_rank = run_distributed(_tp_worker, 4, 2, 1, dp_mode, False, timeout=240)
    _check(per_rank, _reference(dp=2))


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_tp2_matches_one_process():
    per_rank = run_distributed(_tp_worker, 4, 2, 2, "ddp", True, timeout=240)
    _check(per_rank, _reference(dp=1))
