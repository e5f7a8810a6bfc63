"""The sample trace (``data.trace_samples``) in one process: exact ids with prefetching workers, the
resume rule that cuts lines of steps not kept, and a replayed loader resumed on another number of
data-parallel ranks (its steps, not its microbatches, count)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from hookloop.engine import Events, Trainer
from hookloop.engine.data import (
    MixtureDataset,
    MixtureLoader,
    MixtureSampler,
    SampleTrace,
    read_sample_traces,
)
from hookloop.engine.errors import ConfigError
from hookloop.engine.step_batches import StepBatches
from hookloop.handlers import Places
from hookloop.models.gpt import cross_entropy_loss


def pairs(n: int, seed: int) -> list:
    x = torch.randint(0, 16, (n, 5), generator=torch.Generator().manual_seed(seed))
    return [(row[:-1], row[1:]) for row in x]


def mixture() -> MixtureDataset:
    return MixtureDataset({"a": pairs(50, 1), "b": pairs(30, 2)})


def test_a_loader_with_workers_logs_exactly_the_batches_it_returned():
    stream = list(itertools.islice(iter(MixtureSampler(mixture(), {"a": 1.0, "b": 2.0}, seed=4)), 40))
    loader = MixtureLoader(MixtureSampler(mixture(), {"a": 1.0, "b": 2.0}, seed=4), 4, num_workers=2)
    loader.log_batches()
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert loader.take_returned() == [stream[0:4], stream[4:8], stream[8:12]]
    del it  # the workers had read further ahead; a new iterator continues after batch 3
    it = iter(loader)
    next(it)
    next(it)
    assert loader.take_returned() == [stream[12:16], stream[16:20]]
    del it


def test_a_sampler_logs_what_it_yielded_across_chunks_and_forgets_it_on_a_jump():
    stream = list(itertools.islice(iter(MixtureSampler(mixture(), {"a": 1.0, "b": 2.0}, seed=4)), 3000))
    sampler = MixtureSampler(mixture(), {"a": 1.0, "b": 2.0}, seed=4)
    sampler.log_indices()
    it = iter(sampler)
    got = [next(it) for _ in range(2500)]  # past the first chunk of 1024 draws
    assert got == stream[:2500]
    assert sampler.take_logged(1000) == stream[:1000]
    assert sampler.take_logged() == stream[1000:2500]
    with pytest.raises(RuntimeError, match="1 logged indices asked for, 0 were yielded"):
        sampler.take_logged(1)
    next(it)
    sampler.load_state_dict(sampler.state_dict_at(100))
    assert sampler.take_logged() == []
    assert list(itertools.islice(iter(sampler), 3)) == stream[100:103] == sampler.take_logged()


def make_trainer(run_dir, stop_at=None, start_step=0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        cross_entropy_loss,
        grad_accum_steps=2,
        prepare_batch=lambda mb, device: (mb[0], mb[1]),
    )
    sampler = MixtureSampler(mixture(), {"a": 1.0, "b": 1.0}, seed=0)
    loader = MixtureLoader(sampler, 2)
    SampleTrace(run_dir, loader, rank=0, world_size=1).attach(trainer)
    if start_step:  # what a checkpointer does at TRAIN_START: counters and data position back

        @trainer.on(Events.TRAIN_START, priority=Places.RESUME)
        def _resume(engine):
            engine.state.load_counters({"step": start_step})
            sampler.load_state_dict(sampler.state_dict_at(start_step * 4))

    return trainer, loader


def test_the_trace_is_cut_back_to_the_resumed_step_for_every_rank_file(tmp_path):
    trainer, loader = make_trainer(tmp_path)
    trainer.run(loader, max_steps=6)
    whole = read_sample_traces(tmp_path)[0]
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and all(len(ids) == 4 for ids in whole.values())
    assert all(i.split(":")[0] in ("a", "b") and i.split(":")[1].isdigit() for i in whole[1])
    # A killed two-rank run left steps 1..6 in both files; its last checkpoint was step 3.
    stale = tmp_path / "samples-rank1.jsonl"
    stale.write_text("".join(json.dumps({"step": s, "ids": ["b:0"]}) + "\n" for s in range(1, 7)))
    (tmp_path / "samples-rank0.jsonl").write_text(
        "".join(json.dumps({"step": s, "ids": whole[s] if s <= 3 else ["a:0"]}) + "\n" for s in range(1, 7))
    )
    trainer, loader = make_trainer(tmp_path, start_step=3)
    trainer.run(loader, max_steps=6)
    traces = read_sample_traces(tmp_path)
    assert traces[0] == whole  # steps 4..6 trained again, each line once, on the same samples
    assert sorted(traces[1]) == [1, 2, 3]  # a rank the resumed run no longer has: cut by rank 0


def test_the_trace_needs_a_loader_it_can_read_exactly():
    loader = DataLoader(mixture(), batch_size=2, shuffle=True)
    with pytest.raises(ConfigError, match="data.trace_samples: needs a MixtureLoader"):
        SampleTrace("unused", loader)


def groups(step_batches: StepBatches, count: int) -> list[list]:
    """The sample indices of the next ``count`` steps."""
    out = []
    for group in itertools.islice(iter(step_batches), count):
        out.append(sorted(int(i) for microbatch in group for i in microbatch))
    return out


def distributed(rank: int, ranks: int, accum: int) -> StepBatches:
    data = list(range(64))  # each sample is its own index
    sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True, seed=5)
    return StepBatches(DataLoader(data, batch_size=2, sampler=sampler), accum)


def test_a_replayed_loader_resumed_on_fewer_ranks_continues_after_the_steps_done():
    # dp=2 x batch 2 x accum 2 = dp=1 x batch 2 x accum 4: a global batch of 8 either way
    ranks = [distributed(r, 2, 2) for r in range(2)]
    done = [groups(sb, 3) for sb in ranks]
    state = ranks[0].state_dict()  # what rank 0 saves after step 3
    whole = groups(distributed(0, 1, 4), 8)
    assert [sorted(a + b) for a, b in zip(*done)] == whole[:3]  # the same global batch per step
    single = distributed(0, 1, 4)
    single.load_state_dict(state)
    assert groups(single, 5) == whole[3:]  # not 1.5 steps in: the saved microbatches were dp=2's


def test_a_resume_with_another_global_batch_is_refused():
    saved = distributed(0, 2, 2)
    groups(saved, 2)
    bigger = distributed(0, 1, 8)  # 2 x 1 x 8 = 16 samples per step
    bigger.load_state_dict(saved.state_dict())
    with pytest.raises(
        ConfigError, match=r"grad_accum_steps: .* with 8 samples per optimizer step .* takes 16"
    ):
        next(iter(bigger))
