"""Rerun attribution, sample quarantine and the fault injector, in real runs.

Two gloo ranks under DDP (and FSDP2), four in a ring: a transient NaN on one rank is named
transient and nothing is quarantined; a bad sample is found bad on its rank and on the peer it is
sent to, quarantined (``quarantine.jsonl``, the checkpoint) and never drawn again, also by a run
resumed on the same ranks (bitwise) or on another number of ranks (the same samples per step); a
flipped exponent bit in one replica's weights names that rank as faulty (and stops the run when
asked; the detector's rollback heals it), a flipped low bit leaves the steps finite. Under dp 2 x
tp 2 a tensor-parallel group reruns together and its peer is the other replica's group; under pp 2
(and dp 2 x pp 2, DDP and FSDP2 stages) a pipeline reruns together, its peer the next replica's
pipeline, and a run with a rerun trains as one without attribution, bitwise; with two
replica groups (torchft) every group records the verdicts and quarantines the sample, the peer
rerun crossing the groups; with the examples' handlers (async saves, the detector's rollback,
loggers) a quarantine survives a rollback and a kill, written once. In one process:
a rerun draws the step's random numbers and leaves the run as it is without one, ``action=raise``
attributes before it stops, ``data.quarantine`` starts a run without the listed samples.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket

import pytest
import torch

from hookloop.engine import ConfigError, Events, Trainer, TrainingAborted
from hookloop.engine.data import (
    MixtureDataset,
    MixtureLoader,
    MixtureSampler,
    SampleTrace,
    read_sample_traces,
)
from hookloop.engine.step_body import StepBody
from hookloop.handlers import HANDLER_ORDER, NaNDetector, attach_handlers, load_run_config
from hookloop.handlers.attribution import RerunAttribution
from hookloop.handlers.fault_injection import FaultInjector
from hookloop.handlers.run_config import compose_config
from hookloop.handlers.sections.attribution import AttributionConfig
from hookloop.handlers.sections.fault_injection import FaultInjectionConfig
from tests.dist_utils import run_distributed

Schema = compose_config(attribution=AttributionConfig, fault_injection=FaultInjectionConfig)
ORDER = [*HANDLER_ORDER, RerunAttribution, FaultInjector]
LOCAL_BATCH, GLOBAL_BATCH = 2, 8


def mixture() -> MixtureDataset:
    g = torch.Generator().manual_seed(3)
    parts = {}
    for name, n in (("a", 24), ("b", 16)):
        x = torch.randn(n, 4, generator=g)
        parts[name] = [(x[i], x[i].sum(0, keepdim=True)) for i in range(n)]
    return MixtureDataset(parts)


class Stack(torch.nn.Module):
    """The MLP as two layers a pipeline cuts into two stages (each stage's copy runs the layer it
    holds), with dropout in the first so the step's random numbers count."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        first = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(dropout))
        self.blocks = torch.nn.ModuleDict({"0": first, "1": torch.nn.Linear(8, 1)})

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return x


class Killed(Exception):
    """The run killed at a step (``crash_after``): no save at the end."""


def run(run_dir, overrides, *, rank=0, world=1, steps=8, dp_mode="ddp", attribution=True, info=None,
        crash_after=None, replica_group=None, dropout=0.0, rerun_at=None):  # fmt: skip
    """One run of a tiny MLP on the mixture; what it decided. ``info``: a ``dp x tp`` layout
    (:func:`engine.init_distributed`), the MLP split column- then row-wise over ``tp``;
    ``crash_after``: the run raises after that many steps ended (a step redone after a rollback
    counts again), without a save; ``replica_group``: ``(group, lighthouse)``, this process is a
    replica group of one of two (the data sharded over the groups). A ``dp x pp`` layout runs
    :class:`Stack` (``dropout``) as a pipeline of two stages, its stages replicated over ``dp``;
    ``rerun_at``: step ``rerun_at``'s loss is compared with a rerun of it (``compared``)."""
    from hookloop.engine.parallel import wrap_data_parallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    tp = info.dim_size("tp") if info is not None else 1
    runtime = None
    if info is not None and info.dim_size("pp") > 1:
        from hookloop.engine.pipeline import PipelineConfig, build_pipeline

        per_replica = GLOBAL_BATCH // info.dim_size("dp")
        cfg = PipelineConfig(pp_schedule="gpipe", pp_microbatch_size=LOCAL_BATCH, pp_batch_size=per_replica)
        runtime = build_pipeline(Stack(dropout), cfg, info, torch.nn.functional.mse_loss, dp_mode=dp_mode)
        model = runtime.module
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from hookloop.engine.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, info.mesh_dim("tp"), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    rank, world, tp_rank = rank // tp, world // tp, rank % tp  # the data-parallel rank and size
    if runtime is not None:
        rank, world, tp_rank = runtime.dp_rank, runtime.dp_size, runtime.pp_rank  # a trace per pipeline
    elif world > 1:
        model = wrap_data_parallel(model, dp_mode, mesh=info.mesh_dim("dp") if info is not None else None)
    if replica_group is not None:
        rank, world = replica_group[0], 2
    cfg = load_run_config(
        None,
        [
            f"train.run_dir={run_dir}",
            f"train.local_batch_size={LOCAL_BATCH}",
            f"step_scheduler.global_batch_size={GLOBAL_BATCH}",
            f"step_scheduler.max_steps={steps}",
            "step_scheduler.ckpt_every_steps=2",
            f"checkpoint.directory={run_dir}/ckpt",
            "checkpoint.mode=sync",
            "nan.action=warn",
            "logging.console=false",
            "logging.jsonl=false",
            "dataset_metrics.enabled=false",
            f"attribution.enabled={str(attribution).lower()}",
            *overrides,
        ],
        schema=Schema,
        world_size=world,
    )
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        torch.nn.functional.mse_loss,
        prepare_batch=lambda mb, device: (mb[0], mb[1]),
        hang_timeout_s=None,
        step_body=runtime,
    )
    groups = None
    if replica_group is not None:  # before the handlers, as hookloop train attaches it
        from hookloop.engine.fault_tolerance import FaultToleranceConfig
        from hookloop.handlers.replica_groups import ReplicaGroups

        ft = FaultToleranceConfig(
            enabled=True, replica_group_id=rank, num_replica_groups=2, min_replicas=2,
            lighthouse=replica_group[1], timeout_s=20, quorum_timeout_s=60,
        )  # fmt: skip
        groups = ReplicaGroups(ft).attach(trainer)
    loader = MixtureLoader(
        MixtureSampler(mixture(), {"a": 1.0, "b": 1.0}, seed=0, rank=rank, world_size=world),
        LOCAL_BATCH,
        full_batches=runtime is not None,  # a pipeline's microbatches keep their size
    )
    if cfg.data.quarantine is not None:
        from hookloop.engine.data.loader import read_quarantine

        loader.quarantine(read_quarantine(cfg.data.quarantine))
    handlers = attach_handlers(
        trainer, cfg, order=ORDER, dataloader=loader, sampler=loader.mixture_sampler, dp_size=world,
        run_dir=run_dir,
    )  # fmt: skip
    SampleTrace(run_dir, loader, rank=rank, world_size=world, write=tp_rank == 0).attach(trainer)
    losses = []
    trainer.add_event_handler(Events.STEP_END, lambda e: losses.append(float(e.state.loss)))

    @trainer.on(Events.STEP_END)
    def kill(engine):
        if len(losses) == crash_after:
            raise Killed(f"killed after step {engine.state.step}")

    compared = []

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP, priority=-900)
    def rerun(engine):
        if engine.state.step == rerun_at:  # the step's own loss, then a rerun of it (test only)
            handler = trainer.get_handler("attribution")
            compared.append(
                (float(engine.state.loss), handler._rerun(list(engine.state.batch), handler._rng).loss)
            )

    aborted = None
    try:
        trainer.run(loader)
    except TrainingAborted as e:
        aborted = (str(e), int(e.exit_code))
    except Killed as e:
        aborted = (str(e), None)
    finally:
        if groups is not None:
            groups.shutdown()
    state = trainer.state
    attribution = next((h for h in handlers if isinstance(h, RerunAttribution)), None)
    return {
        "aborted": aborted,
        "step": state.step,
        "skipped": state.skipped_steps,
        "losses": losses,
        "state": attribution.state_dict() if attribution else None,
        "quarantined": sorted(loader.quarantined),
        "flipped": next((h.flipped for h in handlers if isinstance(h, FaultInjector)), None),
        "weights": [getattr(p, "_local_tensor", p).double().sum().item() for p in model.parameters()],
        "compared": compared,
    }


def _two_ranks(rank: int, world: int, tmp: str, cases: list) -> list:
    from hookloop.engine import init_distributed

    init_distributed()
    return [run(f"{tmp}/{name}", overrides, rank=rank, world=world, **kw) for name, overrides, kw in cases]


def _dp2_tp2(rank: int, world: int, tmp: str, cases: list) -> list:
    from hookloop.engine import init_distributed

    info = init_distributed("gloo", tp_size=2)
    return [run(f"{tmp}/{name}", o, rank=rank, world=world, info=info, **kw) for name, o, kw in cases]


def replica_verdicts(result) -> list[tuple]:
    return [(v["step"], v["rank"], v["ranks"], v["cause"]) for v in result["state"]["verdicts"]]


def verdicts(result) -> list[tuple]:
    return [(v["step"], v["rank"], v["cause"]) for v in result["state"]["verdicts"]]


def union(traces, step) -> set:
    return {i for per_rank in traces.values() for i in per_rank.get(step, [])}


def sample_at(step: int, rank: int, world: int = 2) -> str:
    """The first sample rank ``rank`` of ``world`` trains at ``step``."""
    sampler = MixtureSampler(mixture(), {"a": 1.0, "b": 1.0}, seed=0, rank=rank, world_size=world)
    stream = iter(sampler)
    per_step = GLOBAL_BATCH // world
    index = [next(stream) for _ in range(per_step * step)][per_step * (step - 1)]
    source, local = sampler.mixture.locate(index)
    return f"{sampler.mixture.names[source]}:{local}"


def test_transient_and_data_faults_on_two_ddp_ranks_are_told_apart_and_the_bad_sample_never_trains_again(
    tmp_path,
):
    bad = sample_at(step=2, rank=1)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.rank=1",
                 "fault_injection.step=3"]  # fmt: skip
    cases = [
        ("transient", transient, {}),
        ("data", data, {"steps": 12}),
        ("resumed", data, {"steps": 4}),  # then resumed on the same two ranks
        ("resumed", data, {"steps": 12}),
        ("elastic", data, {"steps": 4}),  # then resumed on one rank, below
    ]
    t, d, _, resumed, _ = run_distributed(_two_ranks, 2, str(tmp_path), cases)[0]

    # transient: rank 1's NaN at step 3 does not come back when rank 1 reruns the step
    assert verdicts(t) == [(3, 1, "transient")]
    assert list(t["state"]["transients"].values()) == [1] and t["state"]["quarantined"] == []
    assert t["skipped"] == 1 and t["step"] == 8 and not (tmp_path / "transient" / "quarantine.jsonl").exists()

    # data: the sample is bad on rank 1 and on rank 0, which reran rank 1's microbatches: quarantined
    assert verdicts(d) == [(2, 1, "data")] and d["skipped"] == 1
    rows = [json.loads(line) for line in (tmp_path / "data" / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dataset"], r["ids"]) for r in rows] == [(2, bad.split(":")[0], [bad])]
    traces = read_sample_traces(tmp_path / "data")
    # 12 steps of 8 draw every sample of "a" (24) and "b" (16) more than once: the bad one only at step 2
    assert sorted(s for per_rank in traces.values() for s, ids in per_rank.items() if bad in ids) == [2]
    assert all(len(union(traces, s)) <= GLOBAL_BATCH for s in range(1, 13))

    # resumed from the step-4 checkpoint on the same two ranks: the same steps, bitwise
    assert resumed["quarantined"] == d["quarantined"] and resumed["step"] == 12
    assert resumed["losses"] == d["losses"][4:]
    again = read_sample_traces(tmp_path / "resumed")
    assert all(again[r] == traces[r] for r in (0, 1))

    # resumed on ONE rank (the same global batch): the quarantine comes back from the checkpoint and
    # each step trains exactly the samples of the uninterrupted two-rank run
    out = run(tmp_path / "elastic", data, steps=12)
    assert out["quarantined"] == d["quarantined"] and out["step"] == 12
    elastic = read_sample_traces(tmp_path / "elastic")
    for s in range(5, 13):
        assert set(elastic[0][s]) == union(traces, s)
        assert bad not in elastic[0][s]


def test_a_flipped_bit_in_one_replica_names_that_rank_and_fsdp2_reruns_tell_data_from_transient(tmp_path):
    flip = [
        "fault_injection.enabled=true",
        "fault_injection.kind=corruption",
        "fault_injection.rank=1",
        "fault_injection.step=3",
        "fault_injection.parameter=0.weight",
        "attribution.max_reruns=2",
    ]
    bad = sample_at(step=2, rank=1)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = [
        "fault_injection.enabled=true",
        "fault_injection.kind=transient",
        "fault_injection.rank=0",
        "fault_injection.step=2",
    ]
    cases = [
        ("flip", flip, {"steps": 6}),
        ("flip_stop", [*flip, "attribution.on_faulty_rank=stop"], {"steps": 6}),
        ("flip_low", [*flip, "fault_injection.bit=0"], {"steps": 6}),
        ("flip_heal", [*flip, "nan.action=rollback", "nan.max_consecutive=2"], {"steps": 8}),
        ("fsdp_data", data, {"steps": 4, "dp_mode": "fsdp"}),
        ("fsdp_transient", transient, {"steps": 4, "dp_mode": "fsdp"}),
    ]  # fmt: skip
    r0, r1 = run_distributed(_two_ranks, 2, str(tmp_path), cases)
    flipped, stopped, low, healed, fsdp_data, fsdp_transient = r0

    # rank 1's weights went bad at step 3: bad again on its rerun, good on rank 0's: a faulty rank,
    # named with its host; two reruns in the run, the later bad steps only vetoed
    assert verdicts(flipped) == [(3, 1, "faulty_rank"), (4, 1, "faulty_rank")]
    assert [f["host"] for f in flipped["state"]["faulty"]] == [socket.gethostname()] * 2
    assert flipped["skipped"] == 4 and flipped["state"]["quarantined"] == []
    assert flipped["flipped"] is None  # rank 0's injector flipped nothing
    assert r1[0]["flipped"] == {"step": 3, "rank": 1, "parameter": "module.0.weight", "bit": 30}
    message, code = stopped["aborted"]
    assert code == 76 and f"rank 1 on {socket.gethostname()}" in message and "step 3" in message

    # the lowest bit: every step finite, nothing to rerun, and the replicas' weights silently differ
    assert low["skipped"] == 0 and low["state"]["verdicts"] == [] and low["step"] == 6
    assert low["weights"][0] != r1[2]["weights"][0] and low["weights"][1:] == r1[2]["weights"][1:]

    # with the detector's rollback (the default action): two bad steps, the replica named, then the
    # step-2 checkpoint restores every rank's weights and the run ends with the replicas equal again
    assert verdicts(healed) == [(3, 1, "faulty_rank"), (4, 1, "faulty_rank")] and healed["step"] == 8
    assert healed["weights"] == r1[3]["weights"] and healed["losses"][-1] == healed["losses"][-1]

    # FSDP2: the same causes, and the same one bad sample (every rank runs the one-sample forwards)
    assert verdicts(fsdp_data) == [(2, 1, "data")]
    assert fsdp_data["state"]["quarantined"][0]["ids"] == [bad]
    assert verdicts(fsdp_transient) == [(2, 0, "transient")] and fsdp_transient["state"]["quarantined"] == []


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="fault_injection.sample"):
        FaultInjectionConfig(kind="data", sample="a5").validate()
    with pytest.raises(ConfigError, match="fault_injection.bit"):
        FaultInjectionConfig(bit=32).validate()
    with pytest.raises(ConfigError, match="attribution.on_faulty_rank"):
        AttributionConfig(on_faulty_rank="exclude").validate()
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="attribution: judges steps by the NaN detector"):
        RerunAttribution().attach(trainer)
    with pytest.raises(ConfigError, match="fault_injection.parameter"):
        FaultInjector(kind="corruption", parameter="nope").attach(trainer)

    class Staged(StepBody):  # a step body of another class: its step cannot be run again
        def run_step(self, microbatches, ctx):
            raise NotImplementedError

    staged = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                     step_body=Staged())  # fmt: skip
    NaNDetector(action="warn").attach(staged)
    with pytest.raises(ConfigError, match=r"attribution: .*not a step body of another class \(Staged\)"):
        RerunAttribution().attach(staged)
    NaNDetector(action="warn").attach(trainer)
    RerunAttribution().attach(trainer)  # quarantine on, no sample trace: refused before the first step
    with pytest.raises(ConfigError, match="attribution.quarantine: .* data.trace_samples=true"):
        trainer.run([(torch.randn(2, 4), torch.randn(2, 1))], max_steps=1)
    assert trainer.state.step == 0


def test_with_action_raise_the_step_is_attributed_first_and_a_new_run_skips_the_quarantine_file(tmp_path):
    bad = sample_at(step=2, rank=0, world=1)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    first = run(tmp_path / "first", [*data, "nan.action=raise"], steps=6)
    assert first["aborted"][1] == 76 and "step 2" in first["aborted"][0]
    assert verdicts(first) == [(2, 0, "data")]  # one process: bad on its rerun, no peer to ask
    quarantine = tmp_path / "first" / "quarantine.jsonl"
    assert [json.loads(line)["ids"] for line in quarantine.read_text().splitlines()] == [[bad]]

    # a new run with data.quarantine, under a phase curriculum that moves the mixture's weights
    phases = [
        "data.datasets={a: a.bin, b: b.bin}",  # the names the phases use (the data is built above)
        "data.phases=[{start_step: 1, dataset_weights: {a: 3}}, {start_step: 7, dataset_weights: {b: 3}}]",
    ]
    plain = run(tmp_path / "plain", phases, steps=16, attribution=False)
    skip = [*phases, f"data.quarantine={quarantine}"]
    skipped = run(tmp_path / "skipped", skip, steps=16, attribution=False)
    drawn = read_sample_traces(tmp_path / "plain")[0]
    trained = read_sample_traces(tmp_path / "skipped")[0]
    assert sum(bad in ids for ids in drawn.values()) >= 2  # drawn in several epochs of its dataset
    assert all(bad not in ids for ids in trained.values()) and skipped["step"] == 16
    for step, ids in drawn.items():  # the same stream, without the quarantined sample
        assert trained[step] == [i for i in ids if i != bad]
    assert plain["skipped"] == skipped["skipped"] == 0
    with pytest.raises(ConfigError, match="data.quarantine: .* is not a file"):
        run(tmp_path / "missing", [f"data.quarantine={tmp_path}/nope.jsonl"], steps=2)


def _dropout_run(attribution: bool, rerun_at: int | None = None) -> tuple[list, list, dict]:
    """A model with dropout and batch statistics, a transient NaN at step 3; optionally a rerun of
    step ``rerun_at`` compared with the step itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.functional.mse_loss,
                      grad_accum_steps=2, hang_timeout_s=None)  # fmt: skip
    NaNDetector(action="warn").attach(trainer)
    handler = RerunAttribution(quarantine=False).attach(trainer) if attribution else None
    FaultInjector(kind="transient", step=3).attach(trainer)
    losses, compared = [], []
    trainer.add_event_handler(Events.STEP_END, lambda e: losses.append(float(e.state.loss)))

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP, priority=-900)
    def rerun(engine):
        if engine.state.step == rerun_at:  # the step's own loss, then a rerun of it (test only)
            compared.append(
                (float(engine.state.loss), handler._rerun(list(engine.state.batch), handler._rng).loss)
            )

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(16)]
    trainer.run(data, max_steps=8)
    return losses, compared, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_rerun_draws_the_steps_random_numbers_and_leaves_the_run_as_without_it():
    with_losses, _, with_params = _dropout_run(True)
    without_losses, _, without_params = _dropout_run(False)
    assert with_losses[2] != with_losses[2]  # step 3: the transient NaN, vetoed
    assert with_losses[3:] == without_losses[3:]  # dropout draws after the rerun as without it
    assert all(torch.equal(with_params[k], without_params[k]) for k in with_params)
    _, compared, _ = _dropout_run(True, rerun_at=5)
    ((step_loss, rerun_loss),) = compared
    assert rerun_loss == pytest.approx(step_loss, rel=1e-6)  # the same dropout masks: the step's RNG


def test_four_ranks_pass_a_bad_ranks_microbatches_around_the_ring(tmp_path):
    bad = sample_at(step=2, rank=3, world=4)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.rank=2",
                 "fault_injection.step=3"]  # fmt: skip
    cases = [("data", data, {"steps": 4}), ("transient", transient, {"steps": 4})]
    results = run_distributed(_two_ranks, 4, str(tmp_path), cases)
    assert all(verdicts(r[0]) == [(2, 3, "data")] for r in results)  # rank 0 reran rank 3's data
    assert all(r[0]["state"]["quarantined"][0]["ids"] == [bad] for r in results)
    assert all(verdicts(r[1]) == [(3, 2, "transient")] for r in results)


def test_hookloop_trains_a_new_run_without_the_samples_of_data_quarantine(tmp_path):
    from hookloop.run_data import build_data
    from hookloop.train import load_training_config

    quarantine = tmp_path / "quarantine.jsonl"
    quarantine.write_text(json.dumps({"step": 3, "dataset": "docs", "ids": ["docs:3", "docs:10"]}) + "\n")
    overrides = [
        f"train.run_dir={tmp_path}/run",
        f"data.cache_dir={tmp_path}/data",
        "train.local_batch_size=4",
        "step_scheduler.max_steps=10",
        "step_scheduler.global_batch_size=4",
    ]
    cfg = load_training_config(None, [*overrides, f"data.quarantine={quarantine}"])
    loader = build_data(cfg, 0, 1).train
    mixture = loader.mixture_sampler.mixture
    assert loader.quarantined == {mixture.global_index(0, 3), mixture.global_index(0, 10)}
    loader.log_batches()
    it = iter(loader)
    batches = [next(it) for _ in range(len(mixture) // 4 + 1)]  # more than an epoch of the data
    fetched = [i for batch in loader.take_returned() for i in batch]
    assert len(set(fetched)) == len(mixture) - 2 and not loader.quarantined & set(fetched)
    assert sum(len(b[0]) for b in batches) == len(fetched)  # each batch one sample shorter per id
    del it
    quarantine.write_text(json.dumps({"ids": ["docs:999999"]}) + "\n")
    with pytest.raises(ConfigError, match="data.quarantine: names sample 'docs:999999'"):
        build_data(load_training_config(None, [*overrides, f"data.quarantine={quarantine}"]), 0, 1)


def test_a_loader_of_full_batches_fills_a_quarantined_sample_with_a_copy_of_its_batchs_other_samples():
    def loader(full: bool, quarantine: list[str]) -> tuple[list[list[int]], dict]:
        sampler = MixtureSampler(mixture(), {"a": 1.0, "b": 1.0}, seed=0, rank=1, world_size=2)
        out = MixtureLoader(sampler, 4, full_batches=full)
        out.quarantine(quarantine)
        out.log_batches()
        it = iter(out)
        for _ in range(12):  # more than an epoch of each dataset
            next(it)
        return out.take_returned(), out.state_dict()

    plain, position = loader(False, [])
    bad = [plain[1][2], plain[1][3]]  # two samples of one batch
    ids = [f"{mixture().names[s]}:{i}" for s, i in map(mixture().locate, bad)]
    full, full_position = loader(True, ids)
    assert full_position == position  # the same stream, the same place in it
    assert all(len(batch) == 4 and not set(bad) & set(batch) for batch in full)
    assert full[1] == [plain[1][0], plain[1][1], plain[1][0], plain[1][1]]  # copies, in order
    for kept, drawn in zip(full, plain):  # every other batch as drawn
        assert kept == drawn or set(drawn) & set(bad)
    assert loader(False, ids)[0][1] == plain[1][:2]  # without full batches: two samples short


def test_under_dp2_x_tp2_a_tensor_parallel_group_reruns_together_and_its_peer_is_the_other_replica(tmp_path):
    bad = sample_at(step=2, rank=1)  # data-parallel rank 1: global ranks 2 and 3
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.rank=3",
                 "fault_injection.step=3"]  # fmt: skip
    flip = ["fault_injection.enabled=true", "fault_injection.kind=corruption", "fault_injection.rank=1",
            "fault_injection.step=3", "fault_injection.parameter=0.weight", "attribution.max_reruns=1",
            "attribution.on_faulty_rank=stop"]  # fmt: skip
    cases = [
        ("transient", transient, {"steps": 5}),
        ("data", data, {"steps": 12}),
        ("resumed", data, {"steps": 4}),  # then resumed on the same layout
        ("resumed", data, {"steps": 12}),
        ("flip", flip, {"steps": 5}),
        ("fsdp_data", data, {"steps": 4, "dp_mode": "fsdp"}),  # FSDP2 over dp, TP inside
        ("fsdp_transient", [*transient[:2], "fault_injection.rank=1", "fault_injection.step=3"],
         {"steps": 4, "dp_mode": "fsdp"}),
    ]  # fmt: skip
    results = run_distributed(_dp2_tp2, 4, str(tmp_path), cases, timeout=400)
    host = socket.gethostname()
    for t, d, _, resumed, flipped, fsdp_data, fsdp_transient in results:  # every rank decided the same
        # rank 3's NaN output (its own loss only): its replica reruns the step good, rank 3 named
        assert replica_verdicts(t) == [(3, 3, [2, 3], "transient")]
        assert t["state"]["transients"] == {f"rank 3 ({host}) of the tensor-parallel group of ranks 2, 3": 1}
        assert t["state"]["quarantined"] == [] and t["skipped"] == 1 and t["step"] == 5

        # the bad sample: bad on replica 1 (ranks 2, 3) and on replica 0, which reran its microbatches
        assert replica_verdicts(d) == [(2, None, [2, 3], "data")]
        assert [row["ids"] for row in d["state"]["quarantined"]] == [[bad]] and d["skipped"] == 1
        assert resumed["quarantined"] == d["quarantined"] and resumed["losses"] == d["losses"][4:]

        # one tensor-parallel rank's shard flipped: its replica is bad again on its rerun, good on the
        # other replica's; both its ranks named (which one cannot be told), and the run stops with 76
        assert replica_verdicts(flipped) == [(3, None, [0, 1], "faulty_rank")]
        message, code = flipped["aborted"]
        assert code == 76 and f"ranks 0, 1 on {host}" in message

        # FSDP2 over the replicas: the same causes, the same one sample
        assert replica_verdicts(fsdp_data) == [(2, None, [2, 3], "data")]
        assert [row["ids"] for row in fsdp_data["state"]["quarantined"]] == [[bad]]
        assert replica_verdicts(fsdp_transient) == [(3, 1, [0, 1], "transient")]
    traces = read_sample_traces(tmp_path / "data")
    assert sorted(traces) == [0, 1]  # one file per replica
    assert sorted(s for per_rank in traces.values() for s, ids in per_rank.items() if bad in ids) == [2]
    assert read_sample_traces(tmp_path / "resumed") == traces


#: The handlers ``hookloop train`` attaches by default, as the examples run: async saves, the
#: detector's rollback (here at the first bad step), metrics and the console and JSONL loggers.
EXAMPLE_HANDLERS = [
    "checkpoint.mode=async",
    "nan.action=rollback",
    "nan.max_consecutive=1",
    "logging.console=true",
    "logging.jsonl=true",
    "logging.log_interval=1",
]


def test_with_the_examples_handlers_a_quarantined_step_rolled_back_and_resumed_is_quarantined_once(tmp_path):
    bad = sample_at(step=3, rank=1)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}",
            *EXAMPLE_HANDLERS]  # fmt: skip
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.rank=1",
                 "fault_injection.step=3", "step_scheduler.ckpt_every_steps=1",
                 *EXAMPLE_HANDLERS]  # fmt: skip
    cases = [
        ("data", data, {"steps": 8}),
        # killed after step 3 was redone past the rollback (before the step-4 save): resumed from step 2
        ("killed", data, {"steps": 8, "crash_after": 4}),
        ("killed", data, {"steps": 8}),
        ("transient", transient, {"steps": 6}),  # an async save at every step, staged around the rerun
        ("transient_resumed", transient, {"steps": 4}),
        ("transient_resumed", transient, {"steps": 6}),
        ("rewind", [*data, "nan.skip_data_on_rollback=false"], {"steps": 6}),  # the rollback rewinds the data
    ]
    results = run_distributed(_two_ranks, 2, str(tmp_path), cases)
    d, killed, resumed, t, _, t_resumed, rewind = results[0]

    # step 3 is bad: attributed to the sample, quarantined, then rolled back to step 2 and trained
    # past the bad data; the quarantine outlives the rollback
    assert verdicts(d) == [(3, 1, "data")] and d["step"] == 8 and d["quarantined"] == killed["quarantined"]
    assert len(d["losses"]) == 9 and d["losses"][2] != d["losses"][2]  # step 3 twice: vetoed, redone
    traces = read_sample_traces(tmp_path / "data")
    assert all(bad not in ids for per_rank in traces.values() for ids in per_rank.values())

    # killed before any checkpoint held the quarantine: the resumed run finds step 3 bad again and
    # goes on exactly as the uninterrupted run, and the file names the sample once
    assert killed["aborted"] == ("killed after step 3", None) and resumed["step"] == 8
    assert resumed["losses"][1:] == d["losses"][3:] and resumed["quarantined"] == d["quarantined"]
    assert verdicts(resumed) == verdicts(d) and read_sample_traces(tmp_path / "killed") == traces
    for run_dir in ("data", "killed"):
        rows = (tmp_path / run_dir / "quarantine.jsonl").read_text().splitlines()
        assert [json.loads(row)["ids"] for row in rows] == [[bad]], run_dir

    # a transient fault with a save in flight at every step: counted, rolled back, resumed exactly
    assert verdicts(t) == [(3, 1, "transient")] and t["step"] == 6 and t["state"]["quarantined"] == []
    assert t_resumed["losses"] == t["losses"][-2:] and t_resumed["weights"] == t["weights"]
    # the attribution's counts are logged at every step, by the resumed run too
    for run_dir in ("transient", "transient_resumed"):
        rows = [json.loads(line) for line in (tmp_path / run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["attribution/transients"] for row in rows if row["step"] >= 3] == [1] * len(rows[2:])

    # the rollback rewinds the data: step 3 is drawn again, without the quarantined sample
    assert verdicts(rewind) == [(3, 1, "data")] and rewind["step"] == 6 and rewind["skipped"] == 1
    again = read_sample_traces(tmp_path / "rewind")
    assert bad not in again[1][3] and len(again[0][3]) + len(again[1][3]) == GLOBAL_BATCH - 1


def group_main(group: int, address: str, run_dir: str, overrides: list, steps: int, out: str) -> None:
    """One replica group of one process: a run, its result written to ``out`` (then ``os._exit``:
    torchft's threads never join)."""
    import os

    result = run(run_dir, overrides, steps=steps, replica_group=(group, address))
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)


def _two_groups(tmp_path, name: str, overrides: dict, steps: int) -> list[dict]:
    """A run as two replica groups of one process each, a lighthouse in this process; each
    group's result."""
    import sys

    from torchft._torchft import LighthouseServer

    from tests.dist_utils import REPO, kill_ranks
    from tests.forked import start_forked

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000, heartbeat_timeout_ms=500
    )
    address = "http://127.0.0.1:" + server.address().rstrip("/").rsplit(":", 1)[1]
    procs = []
    try:
        for g in (0, 1):
            run_dir, out = f"{tmp_path}/{name}/replica_group_{g}", f"{tmp_path}/{name}-{g}.json"
            call = (g, address, run_dir, overrides[g], steps, out)
            code = f"from tests.test_attribution import group_main; group_main(*{call!r})"
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            log = tmp_path / f"{name}-{g}.log"  # stdout and stderr, as subprocess.STDOUT
            cmd = [sys.executable, "-c", code]
            procs.append(start_forked(cmd, cwd=REPO, env=env, stdout=log, stderr=log))
        for g, p in enumerate(procs):
            assert p.wait(timeout=240) == 0, (tmp_path / f"{name}-{g}.log").read_text()[-3000:]
    finally:
        kill_ranks(procs)
        server.shutdown()
    return [json.loads((tmp_path / f"{name}-{g}.json").read_text()) for g in (0, 1)]


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft")
def test_two_replica_groups_agree_on_the_verdict_and_both_quarantine_the_bad_sample(tmp_path):
    bad = sample_at(step=3, rank=1)  # drawn by group 1
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.step=3"]
    flip = ["fault_injection.enabled=true", "fault_injection.kind=corruption", "fault_injection.step=3",
            "fault_injection.parameter=0.weight"]  # fmt: skip
    once = ["attribution.max_reruns=1"]  # every group's settings alike (hookloop train refuses others)

    # group 1's NaN output: its loss went bad and its rerun is good; group 0, whose gradients the
    # average over the groups made bad, names nothing; both record group 1's transient
    results = _two_groups(tmp_path, "transient", {0: [], 1: transient}, steps=5)
    for r in results:
        assert [(v["step"], v["rank"], v["group"], v["cause"]) for v in r["state"]["verdicts"]] == [
            (3, 0, 1, "transient")
        ]
        assert r["state"]["transients"] == {f"replica group 1: rank 0 ({socket.gethostname()})": 1}
        assert r["skipped"] == 1 and r["step"] == 5 and r["state"]["quarantined"] == []

    # the bad sample: bad on group 1's rerun and on group 0's rerun of group 1's microbatches (sent
    # through the agreement's transport): data, quarantined in both groups and their files
    results = _two_groups(tmp_path, "data", {0: data, 1: data}, steps=12)
    for g, r in enumerate(results):
        assert [(v["step"], v["group"], v["cause"]) for v in r["state"]["verdicts"]] == [(3, 1, "data")]
        assert r["quarantined"] == results[0]["quarantined"] != []
        rows = (tmp_path / "data" / f"replica_group_{g}" / "quarantine.jsonl").read_text().splitlines()
        assert [json.loads(row)["ids"] for row in rows] == [[bad]]
        traces = read_sample_traces(tmp_path / "data" / f"replica_group_{g}")
        drawn = sorted(s for per_rank in traces.values() for s, ids in per_rank.items() if bad in ids)
        assert drawn == ([3] if g == 1 else [])
    assert results[0]["weights"] == results[1]["weights"]

    # both groups stopped at step 6 and resumed from their checkpoints: the quarantine comes back in
    # both, and the steps are the uninterrupted run's, bitwise
    _two_groups(tmp_path, "resumed", {0: data, 1: data}, steps=6)
    resumed = _two_groups(tmp_path, "resumed", {0: data, 1: data}, steps=12)
    for g, r in enumerate(resumed):
        assert r["quarantined"] == results[g]["quarantined"] and r["losses"] == results[g]["losses"][6:]
        assert r["weights"] == results[g]["weights"]

    # group 1's weights flipped: bad again on its rerun, good on group 0's: group 1's rank is faulty
    results = _two_groups(tmp_path, "flip", {0: once, 1: [*flip, *once]}, steps=4)
    for r in results:
        assert [(v["step"], v["rank"], v["group"], v["cause"]) for v in r["state"]["verdicts"]] == [
            (3, 0, 1, "faulty_rank")
        ]


def _dp_pp(rank: int, world: int, tmp: str, cases: list) -> list:
    from hookloop.engine import init_distributed

    info = init_distributed("gloo", mesh_shape=(world // 2, 2), mesh_dim_names=("dp", "pp"))
    return [run(f"{tmp}/{name}", o, rank=rank, world=world, info=info, **kw) for name, o, kw in cases]


def test_under_pp2_the_pipeline_reruns_together_tells_data_from_transient_and_leaves_no_trace(tmp_path):
    bad = sample_at(step=2, rank=0, world=1)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.step=3"]
    cases = [
        ("data", data, {"steps": 12}),  # the sample comes round again: its batch is filled back
        ("transient", [*transient, "fault_injection.rank=0"], {"steps": 5}),  # the first stage's output
        ("dropout", [*transient, "fault_injection.rank=1"], {"steps": 6, "dropout": 0.5}),  # the last's
        ("plain", [*transient, "fault_injection.rank=1"], {"steps": 6, "dropout": 0.5, "attribution": False}),
        ("compare", [], {"steps": 2, "dropout": 0.5, "rerun_at": 2}),  # step 2 and a rerun of it
        ("resumed", data, {"steps": 4}),  # then resumed from its step-4 checkpoint
        ("resumed", data, {"steps": 12}),
    ]
    results = run_distributed(_dp_pp, 2, str(tmp_path), cases)
    host = socket.gethostname()
    for d, t, dropout, plain, compare, _, resumed in results:  # both stages decided the same
        # the bad sample: the pipeline's loss is bad again on its rerun; one replica, no peer: data,
        # and the one-sample forwards through both stages find the sample
        assert replica_verdicts(d) == [(2, None, [0, 1], "data")] and d["skipped"] == 1 and d["step"] == 12
        assert [row["ids"] for row in d["state"]["quarantined"]] == [[bad]]
        assert len(d["quarantined"]) == 1  # the loader fetches it no more

        # a NaN out of the first stage once: the pipeline's rerun is good, its ranks named
        assert (
            replica_verdicts(t) == [(3, None, [0, 1], "transient")] and t["step"] == 5 and t["skipped"] == 1
        )
        assert t["state"]["transients"] == {
            f"ranks 0, 1 ({host}), one pipeline: which of its ranks cannot be told": 1
        }
        assert t["state"]["quarantined"] == []

        # with dropout, the last stage's NaN once: transient, and the run after the rerun is the run without
        # attribution, bitwise (the rerun drew the step's random numbers and put the RNG back)
        assert replica_verdicts(dropout) == [(3, None, [0, 1], "transient")] and plain["state"] is None
        assert dropout["skipped"] == plain["skipped"] == 1 and dropout["losses"][2] != dropout["losses"][2]
        assert dropout["losses"][3:] == plain["losses"][3:] and dropout["weights"] == plain["weights"]
        assert dropout["losses"][:2] == plain["losses"][:2]
        ((step_loss, rerun_loss),) = compare["compared"]  # the same dropout masks on each stage
        assert rerun_loss == pytest.approx(step_loss, rel=1e-6)

        # resumed after the quarantine: the checkpoint brings it back, the steps are the same, bitwise
        assert resumed["quarantined"] == d["quarantined"] and resumed["losses"] == d["losses"][4:]
        assert resumed["weights"] == d["weights"] and resumed["state"]["verdicts"] == d["state"]["verdicts"]
    rows = [json.loads(line) for line in (tmp_path / "data" / "quarantine.jsonl").read_text().splitlines()]
    assert [(r["step"], r["dataset"], r["ids"]) for r in rows] == [(2, bad.split(":")[0], [bad])]
    traces = read_sample_traces(tmp_path / "data")
    assert sorted(traces) == [0]  # one file for the pipeline
    assert [s for s, ids in traces[0].items() if bad in ids] == [2]
    # where the sample came round again its microbatch took a copy of its other sample (the pipeline
    # takes whole microbatches only), and every step trained 8 samples
    assert [s for s, ids in traces[0].items() if len(set(ids)) < len(ids)] != []
    assert all(len(ids) == GLOBAL_BATCH for ids in traces[0].values())
    assert read_sample_traces(tmp_path / "resumed") == traces


def test_under_dp2_x_pp2_a_pipeline_reruns_together_and_its_peer_is_the_next_replicas_pipeline(tmp_path):
    bad = sample_at(step=2, rank=1)  # replica 1: ranks 2 (stage 0) and 3 (stage 1)
    data = ["fault_injection.enabled=true", "fault_injection.kind=data", f"fault_injection.sample={bad}"]
    transient = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.rank=3",
                 "fault_injection.step=3"]  # fmt: skip
    flip = ["fault_injection.enabled=true", "fault_injection.kind=corruption", "fault_injection.rank=0",
            "fault_injection.step=3", "attribution.max_reruns=1",
            "attribution.on_faulty_rank=stop"]  # fmt: skip
    cases = [
        ("data", data, {"steps": 4}),
        ("transient", transient, {"steps": 4}),
        ("flip", flip, {"steps": 4}),
        ("fsdp_data", data, {"steps": 3, "dp_mode": "fsdp"}),  # the stages sharded over dp
    ]
    results = run_distributed(_dp_pp, 4, str(tmp_path), cases, timeout=400)
    host = socket.gethostname()
    for d, t, flipped, fsdp_data in results:  # every rank decided the same
        # bad on replica 1's pipeline and on replica 0's, which reran its microbatches stage by stage
        assert [(*v, p["peer"]) for v, p in zip(replica_verdicts(d), d["state"]["verdicts"])] == [
            (2, None, [2, 3], "data", True)
        ]
        assert [row["ids"] for row in d["state"]["quarantined"]] == [[bad]] and d["step"] == 4
        assert replica_verdicts(t) == [(3, None, [2, 3], "transient")] and t["state"]["quarantined"] == []

        # the first stage's weights of replica 0 flipped: bad on its rerun, good on replica 1's: its
        # pipeline is named, and the run stops with 76
        assert replica_verdicts(flipped) == [(3, None, [0, 1], "faulty_rank")]
        message, code = flipped["aborted"]
        assert code == 76 and f"ranks 0, 1 on {host}" in message

        # FSDP2 stages: every pipeline runs the reruns and the one-sample forwards together
        assert replica_verdicts(fsdp_data) == [(2, None, [2, 3], "data")]
        assert [row["ids"] for row in fsdp_data["state"]["quarantined"]] == [[bad]]
    rows = [json.loads(line) for line in (tmp_path / "data" / "quarantine.jsonl").read_text().splitlines()]
    assert [r["ids"] for r in rows] == [[bad]]
    traces = read_sample_traces(tmp_path / "data")
    assert sorted(traces) == [0, 1]  # one file per pipeline
    assert sorted(s for per_rank in traces.values() for s, ids in per_rank.items() if bad in ids) == [2]
