"""Host syncs and small collectives per step: the counters of ``benchmarks/step_budget.py`` count
what they claim, and the step stays within its budget (2 gloo ranks, DDP, steps with no logging,
validation or checkpoint). Counts are deterministic, so they are asserted; times are not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed import all_reduce as all_reduce_by_name  # bound before any counter exists

from benchmarks.step_budget import (
    BUDGETS,
    CollectiveCounter,
    HostReadCounter,
    SyncCounter,
    counting,
    measure_rank,
    merge_ranks,
)
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

WARMUP, STEPS = 2, 4
CONFIGS = ["hand", "bare", "handlers"]


def test_sync_counter_counts_scalar_reads_and_nothing_else():
    t = torch.tensor([1.5, -2.0])
    with SyncCounter() as syncs:
        t.tolist()  # reads host memory: no dispatch, no sync
        t.double().cpu().clone().to(torch.float32)  # host-to-host work
        torch.nn.utils.clip_grads_with_norm_([torch.nn.Parameter(t.clone())], 1.0, t.norm())
    assert syncs.total == 0, syncs.counts
    with SyncCounter() as syncs:
        t[0].item()
        float(t[1])
        bool(t[0] > 0)
        int(t.sum())
    assert syncs.counts == {"scalar read (_local_scalar_dense)": 4}
    assert sum(syncs.sites.values()) == 4
    assert all(site.startswith("tests/test_step_budget.py:") for site in syncs.sites), syncs.sites


def test_sync_counter_counts_device_to_host_copies():
    # No accelerator here: meta tensors stand in for device memory. Each op below reaches the
    # dispatch mode (and is counted) before meta refuses to produce data.
    dev, host = torch.ones(3, device="meta"), torch.zeros(3)
    attempts = [
        lambda: dev.cpu(),
        lambda: dev.to("cpu", non_blocking=True),
        lambda: host.copy_(dev),
        lambda: torch.nonzero(dev),
    ]
    with SyncCounter() as syncs:
        for attempt in attempts:
            with pytest.raises(NotImplementedError):
                attempt()
        host.to("meta")  # host-to-device: the host does not wait
        dev.add(1)
    assert syncs.counts == {
        "device-to-host copy (_to_copy)": 2,
        "device-to-host copy (copy_)": 1,
        "data-dependent size (nonzero)": 1,
    }


def test_host_read_counter_counts_reads_of_step_tensors_not_of_host_numbers():
    step = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()  # a step tensor: on a GPU it lives there
    with HostReadCounter() as reads:
        votes = torch.tensor([1.0, 0.0], dtype=torch.float64)  # host numbers in a tensor
        (votes * 2).tolist()
        bool(votes[0] > 0)
        step.detach().cpu()
        step.to("cpu")
        float(step.detach())
        [step.detach() * 2][0].tolist()
        votes[1] = step.detach()  # a step tensor written into it: reading it now waits
        votes.tolist()
        torch.ones(1).add_(1).item()  # made from host numbers
    assert reads.counts == {"cpu()": 1, "to()": 1, "__float__()": 1, "tolist()": 2}, reads.counts
    assert all(site.startswith("tests/test_step_budget.py:") for site in reads.sites), reads.sites
    with HostReadCounter() as reads:
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1).step()  # reads inside torch
    assert reads.total == 0, reads.counts


def _collective_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from hookloop.engine import init_distributed, wrap_data_parallel

    init_distributed("gloo")
    torch.manual_seed(0)
    model = wrap_data_parallel(torch.nn.Linear(3, 2), "ddp")
    out: dict = {}
    originals = (dist.all_reduce, c10d.all_reduce, c10d.all_gather, all_reduce_by_name)
    with CollectiveCounter() as collectives:
        t = torch.ones(1)
        dist.all_reduce(t)
        all_reduce_by_name(t)
        gathered = [None] * world
        dist.all_gather_object(gathered, rank)  # calls all_gather inside: counts once
        dist.barrier()
    out["collectives"] = dict(collectives.counts)
    out["reduced"] = float(t)
    out["gathered"] = gathered
    now = (dist.all_reduce, c10d.all_reduce, c10d.all_gather, globals()["all_reduce_by_name"])
    out["restored"] = all(a is b for a, b in zip(now, originals))
    with counting() as (syncs, collectives):
        # Every rank's input differs; DDP's C++ reducer averages the gradients in its bucket.
        model(torch.full((4, 3), float(rank + 1))).sum().backward()
    out["ddp_collectives"] = dict(collectives.counts)
    out["ddp_syncs"] = dict(syncs.counts)
    out["grad"] = model.module.weight.grad.numpy().copy()
    return out


def _rank(rank: int, world: int, base: str) -> dict:
    """Both halves in one pair of processes (starting ranks is the slow part): the counters'
    own checks, then one counted run of every contender."""
    checks = _collective_checks(rank, world)
    return {"checks": checks, "budget": measure_rank(rank, world, CONFIGS, WARMUP, STEPS, 0, base)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("step_budget")
    return run_distributed(_rank, 2, str(base))


@pytest.fixture(scope="module")
def budget(ranks) -> dict:
    """Syncs and collectives per step of each contender, counted once on 2 gloo ranks."""
    per_rank = [r["budget"] for r in ranks]
    return {"per_rank": per_rank, "merged": merge_ranks(per_rank)}


def test_collective_counter_sees_python_collectives_but_not_ddp_buckets(ranks):
    for r in (rank["checks"] for rank in ranks):
        # dist.all_reduce and a name imported earlier both count; all_gather_object counts as itself.
        assert r["collectives"] == {"all_reduce": 2, "all_gather_object": 1, "barrier": 1}
        assert r["reduced"] == 4.0  # both all-reduces really ran: 1 -> 2 -> 4
        assert r["gathered"] == [0, 1]
        assert r["restored"]  # leaving the counter puts every original function back
        # DDP's bucket all-reduce ran (gradients are the average of the ranks' 4 and 8) uncounted.
        assert r["ddp_collectives"] == {}
        np.testing.assert_allclose(r["grad"], np.full((2, 3), 6.0))


def test_counts_are_consistent_across_ranks_and_the_baseline_is_the_optimizer(budget):
    hand = budget["merged"]["hand"]
    # The hand-written loop issues no Python-level collective (DDP's buckets are not counted) and,
    # with fused AdamW (its per-parameter step counters stay tensors), no host sync at all.
    assert hand["collectives_per_step"] == 0
    assert hand["syncs"] == {}, hand["sync_sites"]
    for config in ("bare", "handlers"):
        per_rank = [r[config] for r in budget["per_rank"]]
        # Collectives pair up across ranks: every rank counts the same ones.
        assert per_rank[0]["collectives"] == per_rank[1]["collectives"], config
        # The Trainer runs the same optimizer, so it syncs at least as often as the loop.
        assert budget["merged"][config]["extra_syncs_per_step"] >= 0, config


def test_bare_trainer_adds_no_host_sync(budget):
    extra = budget["merged"]["bare"]["extra_syncs_per_step"]
    assert extra <= BUDGETS["bare"][0], budget["merged"]["bare"]["sync_sites"]


def test_bare_trainer_issues_at_most_one_small_collective(budget):
    entry = budget["merged"]["bare"]
    assert entry["collectives_per_step"] <= BUDGETS["bare"][1], entry["collective_sites"]


def test_trainer_with_four_handlers_adds_at_most_one_host_sync(budget):
    entry = budget["merged"]["handlers"]
    assert entry["extra_syncs_per_step"] <= BUDGETS["handlers"][0], entry["sync_sites"]


def test_trainer_with_four_handlers_issues_at_most_two_small_collectives(budget):
    entry = budget["merged"]["handlers"]
    assert entry["collectives_per_step"] <= BUDGETS["handlers"][1], entry["collective_sites"]


def test_the_default_handlers_keep_the_one_all_reduce_of_the_step(budget):
    # Every request (skip, save, validate, stop) and the handlers' slots travel in the step's one
    # packed all-reduce: with nothing due, a step with the shipped handlers issues exactly that one.
    for config in ("bare", "handlers"):
        entry = budget["merged"][config]
        assert entry["collectives_per_step"] == 1, (config, entry["collective_sites"])


def test_bare_trainer_reads_no_step_tensor_on_a_step_that_neither_logs_nor_decides(budget, tmp_path):
    # 2 ranks: the loss, norm and token sums stay on the device; the requests travel as host numbers.
    entry = budget["merged"]["bare"]
    assert entry["reads_per_step"] == 0, entry["read_sites"]
    one = measure_rank(0, 1, ["bare"], WARMUP, STEPS, 0, str(tmp_path))["bare"]
    assert one["reads"] == {}, one["read_sites"]


def test_trainer_with_four_handlers_reads_nothing_on_a_step_that_neither_logs_nor_decides(budget, tmp_path):
    # The NaN detector's verdict stays on the device: fused AdamW skips a bad step through its
    # found_inf, and the verdict is read at the next step that reads anyway (a log step, a save).
    # With an optimizer that cannot skip on the device the verdict is read every step (1 read):
    # tests/test_nan_detector.py runs both paths.
    entry = budget["merged"]["handlers"]
    assert entry["reads_per_step"] == 0, entry["read_sites"]
    one = measure_rank(0, 1, ["handlers"], WARMUP, STEPS, 0, str(tmp_path))["handlers"]
    assert one["reads"] == {}, one["read_sites"]
