"""PhaseCurriculum, MixtureLoader and PerDatasetMetrics on real trainers over real token files.

Two sources whose tokens cannot be confused (docs in [0, 32), code in [32, 64)) make every batch's
origin checkable both by the source index it carries and by its content.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from hookloop.engine.data import MixtureDataset, MixtureSampler, TokenDataset
from hookloop.engine.data.config import DataConfig, PhaseConfig
from hookloop.engine.data.loader import MixtureLoader
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority
from hookloop.engine.lr import build_lr_scheduler, lr_at
from hookloop.engine.trainer import Trainer
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.handlers.curriculum import Phase, PhaseCurriculum
from hookloop.handlers.dataset_metrics import PerDatasetMetrics
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import tiny_gpt

SEQ = 16
BATCH = 2
ACCUM = 2
DOCS, CODE = 0, 1
# steps 1-3 mixed, 4-6 docs only, from 7 on code only (docs 0, code keeps its original weight 1)
PHASES = [Phase(4, {"docs": 1.0, "code": 0.0}), Phase(7, {"docs": 0.0}, lr_scale=0.5)]


def write_tokens(path: Path, low: int, n_windows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    rng.integers(low, low + 32, n_windows * SEQ + 1, dtype=np.uint8).tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint8"}))
    return path


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> MixtureDataset:
    root = tmp_path_factory.mktemp("tokens")
    docs = TokenDataset(write_tokens(root / "docs.u8", 0, 400, 1), SEQ)
    code = TokenDataset(write_tokens(root / "code.u8", 32, 300, 2), SEQ)
    return MixtureDataset({"docs": docs, "code": code})


class Run:
    """A tiny GPT trainer over the mixture with a curriculum; records every step's microbatches."""

    def __init__(
        self,
        mixture: MixtureDataset,
        phases=PHASES,
        *,
        workers: int = 0,
        loader: str = "mixture",
        rank: int = 0,
        world_size: int = 1,
        batch: int = BATCH,
        scheduler: str | None = "lambda",
    ) -> None:
        self.sampler = MixtureSampler(
            mixture, {"docs": 1.0, "code": 1.0}, seed=3, rank=rank, world_size=world_size
        )
        kwargs = {"num_workers": workers}
        if workers:
            kwargs["prefetch_factor"] = 2
        if loader == "mixture":
            self.loader = MixtureLoader(self.sampler, batch, **kwargs)
        else:
            self.loader = DataLoader(mixture, batch_size=batch, sampler=self.sampler, **kwargs)
        model = tiny_gpt(seed=0)
        head = model.head.weight  # a second parameter group at half the rate
        rest = [p for p in model.parameters() if p is not head]
        self.optimizer = torch.optim.AdamW([{"params": rest}, {"params": [head], "lr": 5e-3}], lr=1e-2)
        sched = None
        if scheduler == "lambda":
            sched = build_lr_scheduler(self.optimizer, warmup_steps=2, decay_steps=12, min_lr=1e-3)
        elif scheduler == "exponential":
            sched = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=0.9)
        self.trainer = Trainer(
            model, self.optimizer, cross_entropy_loss, lr_scheduler=sched, grad_accum_steps=ACCUM
        )
        self.curriculum = PhaseCurriculum(self.sampler, phases).attach(self.trainer)
        self.steps: dict[int, list[tuple[list[int], torch.Tensor]]] = {}
        self.losses: dict[int, float] = {}

        @self.trainer.on(Events.STEP_START)
        def record(engine: Trainer) -> None:
            self.steps[engine.state.step] = [(mb[2].tolist(), mb[0].clone()) for mb in engine.state.batch]

        @self.trainer.on(Events.STEP_END)
        def record_loss(engine: Trainer) -> None:
            self.losses[engine.state.step] = engine.state.loss

    def run(self, max_steps: int) -> Run:
        self.trainer.run(self.loader, max_steps=max_steps)
        return self


def same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(sa == sb and torch.equal(xa, xb) for (sa, xa), (sb, xb) in zip(a, b))


# ------------------------------------------------------------------------------ phase transitions


@pytest.mark.parametrize("loader", ["mixture", "plain"])
def test_phase_applies_to_its_first_step_with_prefetching_workers(mixture, loader):
    run = Run(mixture, workers=2, loader=loader).run(9)
    for step, microbatches in run.steps.items():
        sources = [s for srcs, _ in microbatches for s in srcs]
        assert len(microbatches) == ACCUM and len(sources) == ACCUM * BATCH
        for srcs, x in microbatches:  # the carried source index agrees with the content
            assert all((row.min() >= 32) == (s == CODE) for s, row in zip(srcs, x))
        if step >= 7:
            assert set(sources) == {CODE}, step
        elif step >= 4:
            assert set(sources) == {DOCS}, step
    assert {s for step in (1, 2, 3) for srcs, _ in run.steps[step] for s in srcs} == {DOCS, CODE}
    # the data does not depend on the loader or its workers: the same stream as a plain loop
    ref = Run(mixture, workers=0, loader="mixture").run(9)
    assert all(same_batches(run.steps[s], ref.steps[s]) for s in range(1, 10))


def test_phase_weights_merge_with_the_originals_and_phases_are_reported(mixture):
    sampler = MixtureSampler(mixture, {"docs": 3.0, "code": 1.0})
    curriculum = PhaseCurriculum(sampler, [Phase(0, {"code": 2.0}), Phase(5, {"docs": 0.0}, 0.25)])
    assert curriculum.weights_at(1) == {"docs": 3.0, "code": 2.0}
    assert curriculum.weights_at(5) == {"docs": 0.0, "code": 1.0}  # code: original, not phase 0's
    assert [curriculum.phase_index(s) for s in (1, 4, 5, 9)] == [0, 0, 1, 1]
    assert curriculum.lr_scale_at(4) == 1.0 and curriculum.lr_scale_at(5) == 0.25
    run = Run(mixture, workers=0).run(7)
    assert run.trainer.state.metrics["phase"] == 1 and run.trainer.state.metrics["lr_scale"] == 0.5


# ------------------------------------------------------------------------------ learning rate


def test_lr_scale_multiplies_the_scheduler_lr_without_compounding(mixture):
    phases = [Phase(4, {}, lr_scale=0.5), Phase(8, {}, lr_scale=2.0)]
    run = Run(mixture, phases, workers=0)
    used: dict[int, list[float]] = {}
    reported: dict[int, float] = {}

    @run.trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def veto_and_record(engine: Trainer) -> None:
        if engine.state.step == 5:  # the scheduler does not step at step 5
            engine.control.request_skip()
        used[engine.state.step] = [g["lr"] for g in engine.optimizer.param_groups]

    @run.trainer.on(Events.STEP_END)
    def record_state_lr(engine: Trainer) -> None:
        reported[engine.state.step] = engine.state.lr

    run.run(11)
    scale = {s: 0.5 if 4 <= s < 8 else 2.0 if s >= 8 else 1.0 for s in range(1, 12)}
    for step in range(1, 12):
        scheduler_steps = (step - 1) - (step > 5)  # steps before this one that were not vetoed
        expected = lr_at(scheduler_steps, peak_lr=1e-2, warmup_steps=2, decay_steps=12, min_lr=1e-3)
        # every parameter group is scaled from its own scheduled rate (group 1 peaks at half)
        assert used[step][0] == pytest.approx(expected * scale[step], rel=1e-12), step
        assert used[step][1] == pytest.approx(0.5 * expected * scale[step], rel=1e-12), step
        if step < 11:  # state.lr at STEP_END is the rate the next step will use
            assert reported[step] == pytest.approx(used[step + 1][0], rel=1e-12), step
    # the scheduler itself never saw a scaled rate
    assert run.trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(
        lr_at(10, peak_lr=1e-2, warmup_steps=2, decay_steps=12, min_lr=1e-3), rel=1e-12
    )


@pytest.mark.parametrize("scheduler", ["exponential", None])
def test_lr_scale_with_a_chainable_scheduler_and_without_one(mixture, scheduler):
    phases = [Phase(3, {}, lr_scale=0.5), Phase(5, {}, lr_scale=0.1)]
    scale = {1: 1.0, 2: 1.0, 3: 0.5, 4: 0.5, 5: 0.1, 6: 0.1}
    run = Run(mixture, phases, scheduler=scheduler)
    used: dict[int, float] = {}

    @run.trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def record(engine: Trainer) -> None:
        used[engine.state.step] = engine.optimizer.param_groups[0]["lr"]

    run.run(6)
    if scheduler:  # the curriculum sets the schedule's multiplier; the scheduler is never replaced
        assert type(run.trainer.lr_scheduler) is torch.optim.lr_scheduler.ExponentialLR
    # ExponentialLR computes each rate from the current one: a scaled current rate would compound
    gamma = 0.9 if scheduler else 1.0
    for step in range(1, 7):
        assert used[step] == pytest.approx(1e-2 * gamma ** (step - 1) * scale[step], rel=1e-12), step


# ------------------------------------------------------------------------------ resume


def _resume(mixture, first: Run, k: int, n: int, workers: int) -> Run:
    """A fresh trainer/sampler/loader continuing ``first`` (stopped after step k) up to step n."""
    counters = first.trainer.state.counters()
    states = {key: obj.state_dict() for key, obj in first.trainer.stateful.items()}
    json.dumps(states)  # what a checkpoint stores must be plain data
    second = Run(mixture, workers=workers)
    second.trainer.model.load_state_dict(first.trainer.model.state_dict())
    second.optimizer.load_state_dict(first.optimizer.state_dict())
    second.trainer.lr_scheduler.load_state_dict(first.trainer.lr_scheduler.state_dict())

    @second.trainer.on(Events.TRAIN_START, priority=Priority.RESTORE)
    def restore(engine: Trainer) -> None:
        engine.state.load_counters(counters)
        for key, obj in engine.stateful.items():
            obj.load_state_dict(states[key])

    return second.run(n)


@pytest.mark.parametrize("k", [3, 5])  # right before phase 2, and inside it (phase 3 starts at 7)
def test_resume_across_a_phase_boundary_gives_the_same_batches(mixture, k):
    n = 9
    full = Run(mixture, workers=2).run(n)
    first = Run(mixture, workers=2).run(k)
    assert all(same_batches(first.steps[s], full.steps[s]) for s in range(1, k + 1))
    # the saved position is after step k's data, not where the prefetching workers got to
    state = first.curriculum.state_dict()
    assert state["step"] == k and state["draws"] == k * ACCUM * BATCH
    assert first.sampler.draws > state["draws"]
    second = _resume(mixture, first, k, n, workers=2)
    assert sorted(second.steps) == list(range(k + 1, n + 1))
    for step in range(k + 1, n + 1):
        assert same_batches(second.steps[step], full.steps[step]), step
        assert second.losses[step] == full.losses[step], step  # model, optimizer and LR follow too
    assert second.trainer.state.metrics["phase"] == full.trainer.state.metrics["phase"] == 1


def test_a_continued_run_gets_back_the_prefetched_batches(mixture):
    full = Run(mixture, workers=2).run(8)
    run = Run(mixture, workers=2, loader="plain").run(5)
    run.run(8)  # ignite continues at step 6 with a new loader iterator
    assert all(same_batches(run.steps[s], full.steps[s]) for s in range(1, 9))


def test_mixture_loader_state_is_exact_under_prefetch(mixture):
    sampler = MixtureSampler(mixture, {"docs": 1.0, "code": 2.0}, seed=5)
    loader = MixtureLoader(sampler, 3, num_workers=2, prefetch_factor=2)
    ref = [
        b[0] for b in _take(MixtureLoader(MixtureSampler(mixture, {"docs": 1.0, "code": 2.0}, seed=5), 3), 12)
    ]
    got = [b[0] for b in _take(loader, 5)]
    state = loader.state_dict()
    assert state["draws"] == 15 and sampler.draws > 15
    clone = MixtureLoader(MixtureSampler(mixture, {"docs": 1.0, "code": 1.0}, seed=0), 3, num_workers=2)
    clone.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip([b[0] for b in _take(clone, 7)], ref[5:]))
    got += [b[0] for b in _take(loader, 7)]  # a new iterator gives back what the last one read ahead
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == 12


def _take(loader, n: int) -> list:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


# ------------------------------------------------------------------------------ ranks


def test_two_ranks_with_a_curriculum_are_disjoint_and_cover_the_global_stream(mixture):
    n = 8
    ranks = [Run(mixture, rank=r, world_size=2).run(n) for r in (0, 1)]
    single = Run(mixture, batch=2 * BATCH).run(n)  # one rank drawing both ranks' share

    def items(run: Run, step: int) -> list[tuple[int, tuple[int, ...]]]:
        return [(s, tuple(row.tolist())) for srcs, x in run.steps[step] for s, row in zip(srcs, x)]

    seen: list[set] = [set(), set()]
    for step in range(1, n + 1):
        per_rank = [items(run, step) for run in ranks]
        assert sorted(per_rank[0] + per_rank[1]) == sorted(items(single, step)), step
        for r in (0, 1):
            seen[r].update(per_rank[r])
        if step >= 7:
            assert {s for part in per_rank for s, _ in part} == {CODE}
        elif step >= 4:
            assert {s for part in per_rank for s, _ in part} == {DOCS}
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == n * ACCUM * BATCH


# ------------------------------------------------------------------------------ per-dataset metrics


def test_per_dataset_metrics_equal_a_direct_computation(mixture):
    phases = [Phase(4, {"code": 0.0})]  # code has no tokens from step 4 on
    run = Run(mixture, phases)
    PerDatasetMetrics(run.sampler, log_interval=3).attach(run.trainer)
    direct = {"loss": [0.0, 0.0], "tokens": [0, 0]}
    published: dict[int, dict[str, float]] = {}

    @run.trainer.on(Events.MICROBATCH)
    def accumulate(engine: Trainer) -> None:
        logits, targets = engine.state.microbatch_output, engine.state.microbatch_targets
        sources = engine.state.batch[engine.state.microbatch][2]
        for b, source in enumerate(sources.tolist()):
            direct["loss"][source] += float(
                F.cross_entropy(logits[b].detach().double(), targets[b], reduction="sum")
            )
            direct["tokens"][source] += targets[b].numel()

    @run.trainer.on(Events.STEP_END(every=3))
    def compare(engine: Trainer) -> None:
        m = engine.state.metrics
        published[engine.state.step] = {k: v for k, v in m.items() if "/" in k}
        for i, name in enumerate(("docs", "code")):
            assert m[f"tokens/{name}"] == direct["tokens"][i]
            if direct["tokens"][i]:
                assert m[f"loss/{name}"] == pytest.approx(direct["loss"][i] / direct["tokens"][i], rel=1e-6)
            else:
                assert f"loss/{name}" not in m
        direct["loss"], direct["tokens"] = [0.0, 0.0], [0, 0]

    run.run(6)
    assert set(published) == {3, 6}
    assert published[3]["tokens/docs"] + published[3]["tokens/code"] == 3 * ACCUM * BATCH * SEQ
    assert published[6]["tokens/code"] == 0 and "loss/code" not in published[6]
    # steps 4-6 are all docs: their docs loss is the mean of the trainer's step losses
    assert published[6]["loss/docs"] == pytest.approx(np.mean([run.losses[s] for s in (4, 5, 6)]), rel=1e-6)


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("phases", "field"),
    [
        ([Phase(5, {}), Phase(5, {})], "phases[1].start_step"),
        ([Phase(5, {}), Phase(2, {})], "phases[1].start_step"),
        ([Phase(-1, {})], "phases[0].start_step"),
        ([Phase(1.5, {})], "phases[0].start_step"),
        ([Phase(1, {"prose": 1.0})], "phases[0].dataset_weights.prose"),
        ([Phase(1, {"docs": -1.0})], "phases[0].dataset_weights.docs"),
        ([Phase(1, {"docs": math.nan})], "phases[0].dataset_weights.docs"),
        ([Phase(1, {"docs": 0.0, "code": 0.0})], "phases[0].dataset_weights"),
        ([Phase(1, {}, lr_scale=0.0)], "phases[0].lr_scale"),
        ([Phase(1, {}, lr_scale=-2.0)], "phases[0].lr_scale"),
        ([Phase(1, {}, lr_scale=math.inf)], "phases[0].lr_scale"),
        ([{"start_step": 1, "weights": {}}], "phases[0]"),
    ],
)
def test_bad_phases_raise_naming_the_field(mixture, phases, field):
    sampler = MixtureSampler(mixture, {"docs": 1.0, "code": 1.0})
    with pytest.raises(ConfigError) as info:
        PhaseCurriculum(sampler, phases)
    assert info.value.field == field


def test_config_section_builds_the_curriculum_and_names_config_fields(mixture):
    sampler = MixtureSampler(mixture, {"docs": 1.0, "code": 1.0})
    cfg = DataConfig(
        datasets={"docs": "stdlib_docs", "code": "stdlib_source"},
        mix_temperature=2.0,
        phases=[PhaseConfig(0, {"code": 3.0}), PhaseConfig(10, {"docs": 3.0}, lr_scale=0.5)],
    )
    curriculum = PhaseCurriculum.from_config(cfg, sampler=sampler)
    assert curriculum.phases[1] == Phase(10, {"docs": 3.0}, 0.5) and curriculum.mix_temperature == 2.0
    cfg.phases[1].lr_scale = 0.0
    with pytest.raises(ConfigError) as info:
        PhaseCurriculum.from_config(cfg, sampler=sampler)
    assert info.value.field == "data.phases[1].lr_scale"
    with pytest.raises(ConfigError) as info:
        PhaseCurriculum(sampler, [], mix_temperature=0)
    assert info.value.field == "mix_temperature"


def test_samples_per_step_must_be_inferable_or_given(mixture):
    run = Run(mixture)
    batches = [(torch.zeros(BATCH, SEQ, dtype=torch.long),) * 2 + (torch.zeros(BATCH, dtype=torch.long),)] * 4
    with pytest.raises(ConfigError) as info:
        run.trainer.run(batches, max_steps=1)
    assert info.value.field == "samples_per_step"


# ------------------------------------------------------------------------------ sampler schedule


def test_sampler_schedule_and_state_at_any_nearby_draw(mixture):
    def fresh() -> MixtureSampler:
        return MixtureSampler(mixture, {"docs": 1.0, "code": 1.0}, seed=9, rank=1, world_size=2)

    sampler = fresh()
    sampler.set_schedule([(40, {"docs": 1.0, "code": 0.0}), (80, {"docs": 0.0, "code": 1.0}, 2.0)])
    it = iter(sampler)
    stream = [next(it) for _ in range(60)]  # this rank's draws 1, 3, ..., 119
    sources = [mixture.locate(i)[0] for i in stream]
    assert set(sources[20:40]) == {DOCS} and set(sources[40:]) == {CODE}
    assert sampler.temperature == 2.0
    for at in (0, 30, 40, 118):  # rewinding gives exactly the state the stream had there
        snapshot = sampler.state_dict_at(at)
        other = fresh()
        other.load_state_dict(snapshot)
        other_it = iter(other)
        assert [next(other_it) for _ in range(60 - at // 2)] == stream[at // 2 :], at
    with pytest.raises(ConfigError, match="already taken"):
        sampler.set_schedule([(100, {"docs": 1.0, "code": 1.0})])
    with pytest.raises(ConfigError, match="rounds"):
        sampler.state_dict_at(41)
    sampler.update_weights({"docs": 1.0, "code": 1.0})  # a manual change drops what was scheduled
    assert sampler.schedule == [(120, {"docs": 1.0, "code": 1.0}, 2.0)]


# ------------------------------------------------------------------------------ with the checkpointer


def test_resume_through_the_checkpointer_with_workers(mixture, tmp_path):
    full = Run(mixture, workers=2).run(9)
    first = Run(mixture, workers=2)
    AsyncCheckpointer(tmp_path, mode="sync").attach(first.trainer)
    save_every(first.trainer, 5)
    first.run(5)
    second = Run(mixture, workers=2)
    AsyncCheckpointer(tmp_path, mode="sync").attach(second.trainer)
    second.run(9)
    assert sorted(second.steps) == [6, 7, 8, 9]
    for step in range(6, 10):
        assert same_batches(second.steps[step], full.steps[step]), step
        assert second.losses[step] == full.losses[step], step
