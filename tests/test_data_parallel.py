"""Data parallel on real gloo process groups: DDP and FSDP2 accumulation, the agreed veto."""

import copy

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

ACCUM = 3


def _worker(rank: int, world: int, mode: str) -> dict:
    from hookloop.engine import Events, Trainer, init_distributed, wrap_data_parallel
    from hookloop.models.gpt import cross_entropy_loss
    from tests.conftest import tiny_gpt, token_batches

    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    assert info.world_size == world and info.rank == rank
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    full = token_batches(ACCUM * 2, batch=2 * world)  # two steps of global microbatches
    local = [(x[rank * 2 : (rank + 1) * 2], y[rank * 2 : (rank + 1) * 2]) for x, y in full]
    wrapped = wrap_data_parallel(model, mode, mesh=info.mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    trainer = Trainer(wrapped, opt, cross_entropy_loss, grad_accum_steps=ACCUM)
    seen: dict = {"losses": [], "skipped_on": []}

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def capture(e):
        if e.state.step == 1:
            grads = {}
            for name, p in wrapped.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name.removeprefix("module.")] = g.clone()
            seen["grads"] = grads
        if e.state.step == 2 and rank == 1:
            e.control.request_skip()  # only rank 1 asks

    @trainer.on(Events.STEP_END)
    def record(e):
        seen["losses"].append(e.state.loss)
        if e.control.decided.skip:
            seen["skipped_on"].append(e.state.step)

    before_step2 = {}
    trainer.add_event_handler(
        Events.STEP_START(once=2),
        lambda: before_step2.update({n: _full(p).clone() for n, p in wrapped.named_parameters()}),
    )
    state = trainer.run(local, max_epochs=1)

    # Single-process reference for step 1: full global microbatches, accumulated.
    for x, y in full[:ACCUM]:
        (cross_entropy_loss(reference(x), y) / ACCUM).backward()
    ref_loss = sum(float(cross_entropy_loss(reference(x), y).detach()) for x, y in full[:ACCUM]) / ACCUM
    max_diff = max((seen["grads"][n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    unchanged = all(torch.equal(before_step2[n], _full(p)) for n, p in wrapped.named_parameters())
    return {
        "max_grad_diff": max_diff,
        "loss_diff": abs(seen["losses"][0] - ref_loss),
        "skipped_on": seen["skipped_on"],
        "skipped_steps": state.skipped_steps,
        "unchanged_by_vetoed_step": unchanged,
        "param_sum": float(sum(_full(p).double().sum() for p in wrapped.parameters())),
        "tokens_seen": state.tokens_seen,
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_process_accumulation_and_agreed_veto(mode):
    results = run_distributed(_worker, 2, mode)
    for r in results:
        assert r["max_grad_diff"] < 1e-6, r
        assert r["loss_diff"] < 1e-6, r
        assert r["skipped_on"] == [2], r  # rank 0 skipped too: the veto was agreed
        assert r["skipped_steps"] == 1
        assert r["unchanged_by_vetoed_step"]
        assert r["tokens_seen"] == 2 * ACCUM * (2 * 2) * 16  # global count: 2 ranks x 2 samples x 16
    assert results[0]["param_sum"] == results[1]["param_sum"]
