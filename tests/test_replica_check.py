"""The replica check finds silent data corruption, in real runs.

Two gloo ranks under DDP: a low bit flipped in one replica's weights (every step stays finite, the
NaN detector sees nothing) is found at the next compared step, inside the step's one agreement; the
run rolls back to the newest checkpoint whose weights were seen equal and ends bitwise where a run
without the flip ends; with ``max_rollbacks=0`` it exits 79 and ``exit_status.json`` names the node.
Three ranks name the one replica that differs. Under tensor and pipeline parallelism (dp 2 x tp 2,
dp 2 x pp 2, and ``hookloop train`` under torchrun with dp 2 x tp 2) the replicas of each shard are
compared; FSDP2 is refused by name. Two torchft replica groups both find a flip in one of them and
name it (group, rank, host). A rollback that finds no checkpoint exits 79 naming the node. In one
process: the fingerprint sees every single flipped bit, equal and unequal sums are told apart
exactly, bad settings are refused by name.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import sys

import pytest
import torch

from hookloop.engine import ConfigError, Events, Trainer, TrainingAborted
from hookloop.engine.data import MixtureDataset, MixtureLoader, MixtureSampler
from hookloop.engine.events import Priority
from hookloop.handlers import HANDLER_ORDER, attach_handlers, load_run_config
from hookloop.handlers.fault_injection import FaultInjector
from hookloop.handlers.replica_check import PIECES, ReplicaCheck, _equal, fingerprint
from hookloop.handlers.run_config import compose_config
from hookloop.handlers.sections.fault_injection import FaultInjectionConfig
from hookloop.handlers.sections.replica_check import ReplicaCheckConfig
from tests.dist_utils import run_distributed

Schema = compose_config(replica_check=ReplicaCheckConfig, fault_injection=FaultInjectionConfig)
ORDER = [*HANDLER_ORDER, ReplicaCheck, FaultInjector]
FLIP = [
    "fault_injection.enabled=true",
    "fault_injection.kind=corruption",
    "fault_injection.rank=1",
    "fault_injection.step=4",
    "fault_injection.parameter=0.weight",
    "fault_injection.bit=16",  # a mantissa bit (the value changes by <1%): every loss stays finite
]
CHECK = ["replica_check.enabled=true", "replica_check.every_steps=2"]


def mixture() -> MixtureDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=g)
    return MixtureDataset({"a": [(x[i], x[i].sum(0, keepdim=True)) for i in range(32)]})


def run(run_dir, overrides, *, rank=0, world=1, steps=8, dp_group=None, lose_checkpoints=False) -> dict:
    """One DDP run of a tiny MLP; what it ended with. ``lose_checkpoints``: the checkpoints are
    gone when a rollback starts (nothing old enough to restore)."""
    from hookloop.engine.parallel import wrap_data_parallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    if world > 1:
        model = wrap_data_parallel(model, "ddp")
    cfg = load_run_config(
        None,
        [
            f"train.run_dir={run_dir}",
            "train.local_batch_size=2",
            f"step_scheduler.global_batch_size={2 * world}",
            f"step_scheduler.max_steps={steps}",
            "step_scheduler.ckpt_every_steps=2",
            f"checkpoint.directory={run_dir}/ckpt",
            "checkpoint.mode=sync",
            "checkpoint.keep_last=10",
            "logging.console=false",
            "logging.jsonl=false",
            "dataset_metrics.enabled=false",
            *overrides,
        ],
        schema=Schema,
        world_size=world,
    )
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        torch.nn.functional.mse_loss,
        prepare_batch=lambda mb, device: (mb[0], mb[1]),
        hang_timeout_s=None,
        run_dir=run_dir,
    )
    loader = MixtureLoader(MixtureSampler(mixture(), {"a": 1.0}, seed=0, rank=rank, world_size=world), 2)
    handlers = attach_handlers(
        trainer, cfg, order=ORDER, dataloader=loader, sampler=loader.mixture_sampler, dp_size=world,
        run_dir=run_dir, dp_group=dp_group,
    )  # fmt: skip
    losses, checked = [], []
    trainer.add_event_handler(Events.STEP_END, lambda e: losses.append((e.state.step, float(e.state.loss))))
    trainer.add_event_handler(Events.ROLLBACK, lambda e: checked.append(("rollback", e.state.step)))
    if lose_checkpoints:

        @trainer.on(Events.ROLLBACK, priority=Priority.CLOCK)
        def lose(_):
            if rank == 0:
                shutil.rmtree(f"{run_dir}/ckpt")
            if world > 1:
                torch.distributed.barrier()

    try:
        trainer.run(loader)
    except TrainingAborted:
        pass  # the code and reason are in trainer.control and exit_status.json
    check = next((h for h in handlers if isinstance(h, ReplicaCheck)), None)
    return {
        "code": int(trainer.control.exit_code),
        "reason": trainer.control.stop_reason,
        "step": trainer.state.step,
        "losses": losses,
        "rollbacks": checked,
        "check": check.state_dict() if check else None,
        "weights": [p.detach().clone().numpy() for p in model.parameters()],
    }


def _ranks(rank: int, world: int, tmp: str, cases: list) -> list:
    from hookloop.engine import init_distributed

    init_distributed()
    return [run(f"{tmp}/{name}", overrides, rank=rank, world=world, **kw) for name, overrides, kw in cases]


def same(a: list, b: list) -> bool:
    return all((x == y).all() for x, y in zip(a, b, strict=True))


def test_a_flipped_bit_in_one_ddp_replica_is_found_at_the_next_check_and_rolled_back_or_requeued(tmp_path):
    cases = [
        ("clean", CHECK, {}),
        ("healed", [*CHECK, *FLIP], {}),
        ("requeue", [*CHECK, *FLIP, "replica_check.max_rollbacks=0"], {}),
        ("unchecked", FLIP, {}),
    ]
    (clean, healed, requeue, unchecked), (clean1, healed1, requeue1, unchecked1) = run_distributed(
        _ranks, 2, str(tmp_path), cases
    )
    host = socket.gethostname()

    # no flip: the weights steps 2, 4, 6 left are compared at steps 3, 5, 7, and are equal
    assert clean["check"] == {"verified_step": 6, "rollbacks": 0, "mismatches": []}
    assert clean["code"] == 0 and same(clean["weights"], clean1["weights"])

    # without the check the flip at step 4 goes unseen: finite losses, the replicas differ at the end
    assert unchecked["step"] == 8 and all(loss == loss for _, loss in unchecked["losses"])
    assert not same(unchecked["weights"], unchecked1["weights"])

    # with it: found at step 5 (the next compared step), both replicas named (two: a tie); the run
    # rolls back to the step-2 checkpoint (the last step seen equal; the step-4 one holds rank 0's
    # copy of the differing weights) and replays steps 3..8 without the flip (it fires once): it
    # ends bitwise as the clean run
    assert healed["check"]["mismatches"] == [
        {"step": 5, "checked_step": 4, "ranks": [0, 1], "hosts": [host], "tie": True}
    ]
    assert healed["rollbacks"] == [("rollback", 2)] and healed["check"]["rollbacks"] == 1
    assert healed["code"] == 0 and healed["step"] == 8 and healed["check"]["verified_step"] == 6
    assert [s for s, _ in healed["losses"]] == [1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]
    assert healed["losses"][5:] == clean["losses"][2:]
    assert same(healed["weights"], clean["weights"]) and same(healed1["weights"], clean["weights"])

    # max_rollbacks=0: stop at step 5 with 79, exit_status.json names the node
    assert requeue["code"] == 79 and requeue["step"] == 5 and requeue1["code"] == 79
    status = json.loads((tmp_path / "requeue" / "exit_status.json").read_text())
    assert status["code"] == 79 and status["meaning"] == "REQUEUE_WITHOUT_NODE"
    assert status["nodes"] == [host] and "rank 1 on" in status["reason"] and status["step"] == 5
    # the checkpoint of step 4 holds differing weights: the last step seen equal is in the reason,
    # and each checkpoint records the last step seen equal when it was saved
    assert "the last step seen equal is 2" in status["reason"]

    def recorded(run: str, step: int) -> int:
        state = json.loads((tmp_path / run / "ckpt" / f"step_{step:08d}" / "rank_00000.json").read_text())
        return state["handlers"]["replica_check"]["verified_step"]

    assert recorded("requeue", 4) == 2 and recorded("clean", 6) == 4 and recorded("clean", 2) == 0


def test_a_rollback_that_finds_no_checkpoint_exits_79_naming_the_node(tmp_path):
    cases = [("lost", [*CHECK, *FLIP], {"steps": 6, "lose_checkpoints": True})]
    results = run_distributed(_ranks, 2, str(tmp_path), cases)
    assert [r[0]["step"] for r in results] == [5, 5]
    status = json.loads((tmp_path / "lost" / "exit_status.json").read_text())
    assert status["code"] == 79 and status["step"] == 5
    assert "cannot roll back to a checkpoint at or before step 2" in status["reason"]
    assert status["nodes"] == [socket.gethostname()]


def test_three_ddp_replicas_name_the_one_that_differs(tmp_path):
    cases = [("flip", [*CHECK, *FLIP, "replica_check.max_rollbacks=0"], {"steps": 6})]
    results = run_distributed(_ranks, 3, str(tmp_path), cases)
    host = socket.gethostname()
    for (flip,) in results:
        assert flip["check"]["mismatches"] == [
            {"step": 5, "checked_step": 4, "ranks": [1], "hosts": [host], "tie": False}
        ]
        assert flip["code"] == 79
    assert "rank 1 on" in results[0][0]["reason"] and "rank 0 on" not in results[0][0]["reason"]


def test_the_fingerprint_sees_every_single_flipped_bit_and_the_sums_compare_exactly():
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(2, dtype=torch.bfloat16)]
    base = int(fingerprint(params))
    assert base == int(fingerprint([p.clone() for p in params]))
    for t in range(len(params)):
        for bit in range(8 * params[t].element_size()):
            flipped = [p.clone() for p in params]
            ints = flipped[t].view(-1).view({2: torch.int16, 4: torch.int32}[params[t].element_size()])
            ints[1] ^= 1 << bit if bit < 8 * params[t].element_size() - 1 else -(1 << bit)
            assert int(fingerprint(flipped)) != base, (t, bit)
    # two parameters swapped: another fingerprint
    assert int(fingerprint([params[1], params[0], params[2]])) != base

    def sums(fps: list[int]) -> list[float]:
        pieces = [[(fp >> (16 * j)) & 0xFFFF for j in range(PIECES)] for fp in fps]
        return [
            float(len(fps)),
            *(float(sum(p[j] for p in pieces)) for j in range(PIECES)),
            *(float(sum(p[j] ** 2 for p in pieces)) for j in range(PIECES)),
        ]

    assert _equal(sums([base] * 5)) and _equal(sums([base]))
    assert not _equal(sums([base, base, base ^ 1]))
    assert not _equal(sums([3, 5, 4, 4])) and _equal(sums([4, 4, 4, 4]))  # equal sums, unequal values


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="replica_check.every_steps"):
        ReplicaCheckConfig(every_steps=0).validate()
    with pytest.raises(ConfigError, match="replica_check.max_rollbacks"):
        ReplicaCheck(max_rollbacks=-1)
    with pytest.raises(ConfigError, match="replica_check.every_steps"):
        load_run_config(None, ["replica_check.every_steps=zero"], schema=Schema)
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="replica_check.max_rollbacks.*checkpointer"):
        ReplicaCheck().attach(trainer)  # nothing to roll back with
    ReplicaCheck(max_rollbacks=0).attach(trainer)
    # FSDP2 leaves nothing to compare: refused with the config, before any process or model
    with pytest.raises(ConfigError, match="replica_check.enabled.*dp_mode=fsdp") as info:
        load_run_config(
            None, ["replica_check.enabled=true", "distributed.dp_mode=fsdp", "lr.decay_style=constant"]
        )
    assert "\n" not in str(info.value)


def _layout_worker(rank: int, world: int, layout: str, flip: bool) -> dict:
    from hookloop.engine import build_pipeline, init_distributed
    from hookloop.engine.parallel import parallel_mesh, wrap_data_parallel
    from hookloop.engine.pipeline import PipelineConfig
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.models.gpt import cross_entropy_loss, tp_plan
    from tests.conftest import tiny_gpt, token_batches

    tp, pp = (2, 1) if layout == "tp" else (1, 2)
    info = init_distributed("gloo", **parallel_mesh(world, tp, pp))
    dp_rank = info.dim_rank("dp")
    model, runtime = tiny_gpt(n_heads=4), None
    if layout == "tp":
        apply_tensor_parallel(model, info.mesh_dim("tp"), tp_plan)
        model = wrap_data_parallel(model, "ddp", mesh=info.mesh_dim("dp"))
    else:
        cfg = PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=2, pp_batch_size=4)
        runtime = build_pipeline(model, cfg, info, cross_entropy_loss, dp_mode="ddp")
        model = runtime.module
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        cross_entropy_loss,
        grad_accum_steps=pp,
        step_body=runtime,
        hang_timeout_s=60,
        graceful_sigint=False,
    )
    check = ReplicaCheck(every_steps=2, max_rollbacks=0, optimizer_state=True, dp_group=info.mesh_dim("dp"))
    check.attach(trainer)
    if flip:  # rank 1: dp 0 and tp (pp) 1; its replica is rank 3 (dp 1, tp (pp) 1)
        name = "blocks.0.mlp.0.weight" if layout == "tp" else None  # pp: the stage's first parameter
        FaultInjector(kind="corruption", rank=1, step=4, bit=16, parameter=name).attach(trainer)
    batches = token_batches(8 * pp, 4)
    data = [(x[dp_rank * 2 : dp_rank * 2 + 2], y[dp_rank * 2 : dp_rank * 2 + 2]) for x, y in batches]
    trainer.run(data, max_steps=6)
    return {"code": int(trainer.control.exit_code), "step": trainer.state.step, "check": check.state_dict()}


@pytest.mark.parametrize("layout", ["tp", "pp"])
@pytest.mark.parametrize("flip", [False, True], ids=["equal", "flipped"])
def test_under_tensor_and_pipeline_parallelism_the_replicas_of_each_shard_are_compared(layout, flip):
    results = run_distributed(_layout_worker, 4, layout, flip)
    if not flip:  # the shards (stages) differ from each other; each one's two replicas are equal
        assert all(r["check"] == {"verified_step": 4, "rollbacks": 0, "mismatches": []} for r in results)
        assert all(r["code"] == 0 and r["step"] == 6 for r in results)
        return
    host = socket.gethostname()
    for r in results:  # found at step 5 in shard 1's dp group (ranks 1 and 3), every rank stops
        assert r["check"]["mismatches"] == [
            {"step": 5, "checked_step": 4, "ranks": [1, 3], "hosts": [host], "tie": True}
        ]
        assert r["code"] == 79 and r["step"] == 5


def _fsdp_worker(rank: int, world: int) -> str:
    from hookloop.engine import init_distributed
    from hookloop.engine.parallel import wrap_data_parallel

    init_distributed("gloo")
    model = wrap_data_parallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)), "fsdp")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    try:
        ReplicaCheck(every_steps=2).attach(trainer)
    except ConfigError as e:
        return str(e)
    return "attached"


def test_fsdp2_weights_sharded_over_the_data_parallel_ranks_are_refused_by_name():
    for message in run_distributed(_fsdp_worker, 2):
        assert "replica_check.enabled" in message and "distributed.dp_mode=ddp" in message


CHECK_ENTRY = """
handlers:
  - target: hookloop.handlers.replica_check:ReplicaCheck
    enabled: true
    every_steps: 2
    max_rollbacks: 0
"""
FLIP_ENTRY = """
  - target: hookloop.handlers.fault_injection:FaultInjector
    enabled: true
    kind: corruption
    rank: 0
    step: 4
    bit: 16
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft")
def test_across_two_replica_groups_a_flip_in_one_is_found_by_both(tmp_path):
    """torchft replica groups of one process each (real ``hookloop train`` processes, a lighthouse):
    the check's sums span the groups, so both find group 1's flip at step 5 and stop with 79. Each
    group's own ranks agree; the fingerprints of every group's ranks name the replica that differs:
    with two groups a tie, so both (group, rank and host in the log, the host in ``"nodes"``)."""
    from hookloop.engine.data import prepare_tokens, stdlib_docs_text
    from tests.test_live_recovery import CONFIG, Proc, exit_status, lighthouse_here, processes
    from tests.user_models import tiny_lm_source

    (tmp_path / "my_models.py").write_text(tiny_lm_source(seq_len=8))
    (tmp_path / "run.yaml").write_text(CONFIG + CHECK_ENTRY)
    (tmp_path / "flip.yaml").write_text(CONFIG + CHECK_ENTRY + FLIP_ENTRY)
    prepare_tokens([stdlib_docs_text()[:50_000]], tmp_path / "docs.u8")
    with processes() as started, lighthouse_here(2) as address:
        common = ("step_scheduler.max_steps=8", "fault_tolerance.min_replicas=2")
        groups = []
        for g, config in ((0, "run.yaml"), (1, "flip.yaml")):  # the flip is in group 1's config only
            cmd = [sys.executable, "-m", "hookloop", "train", config, "train.run_dir=runs/sdc", *common]
            cmd += [f"fault_tolerance.replica_group_id={g}", f"fault_tolerance.lighthouse={address}"]
            groups.append(Proc(cmd, tmp_path, tmp_path / f"g{g}.log"))
            started.append(groups[-1])
        g0, g1 = groups
        assert g0.exit_code() == 79, g0.text()[-3000:]
        assert g1.exit_code() == 79, g1.text()[-3000:]
    for g in (0, 1):
        status = exit_status(tmp_path / "runs/sdc" / f"replica_group_{g}")
        assert status["code"] == 79 and status["step"] == 5, status
        assert status["nodes"] == [socket.gethostname()], status
        named = f"replica group 0 rank 0 on {socket.gethostname()}, replica group 1 rank 0 on"
        assert named in status["reason"] and "a tie" in status["reason"], status
        assert named in (g0, g1)[g].text()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("flip", "rollbacks"), [(False, 0), (True, 0), (True, 1)], ids=["equal", "flipped", "healed"]
)
def test_hookloop_train_dp2_tp2_under_torchrun_checks_the_replicas_of_each_shard(tmp_path, flip, rollbacks):
    """The front door: ``hookloop train`` under torchrun, 4 gloo ranks as dp 2 x tp 2 (the run
    passes each shard's dp group). Equal replicas pass every check (the last checkpoint records the
    weights of step 4 seen equal); a bit flipped on rank 1 (tp 1) is found in its dp group (ranks 1
    and 3, a tie) at step 5: exit 79, ``exit_status.json`` names the host; with a rollback allowed,
    the run rolls back to step 2 and finishes."""
    import yaml

    from tests.dist_utils import rank_exit_codes, run_torchrun

    run_dir = tmp_path / "run"
    handlers = [{"target": "hookloop.handlers.replica_check:ReplicaCheck", "enabled": True, "every_steps": 2,
                 "max_rollbacks": rollbacks}]  # fmt: skip
    if flip:
        handlers.append({"target": "hookloop.handlers.fault_injection:FaultInjector", "enabled": True,
                         "kind": "corruption", "rank": 1, "step": 4, "bit": 16})  # fmt: skip
    config = {
        "model": {"target": "hookloop.models.gpt:recipe", "n_layers": 1, "d_model": 16, "n_heads": 2},
        "train": {"seq_len": 8, "local_batch_size": 2, "seed": 0, "run_dir": str(run_dir)},
        "step_scheduler": {"global_batch_size": 4, "max_steps": 6, "ckpt_every_steps": 2},
        "checkpoint": {"mode": "sync"},
        "data": {"datasets": {"docs": "stdlib_docs"}, "cache_dir": str(tmp_path / "cache")},
        "distributed": {"backend": "gloo", "dp_mode": "ddp", "tp_size": 2},
        "handlers": handlers,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    proc = run_torchrun("hookloop", 4, ["train", "run.yaml"], module=True, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    status = json.loads((run_dir / "exit_status.json").read_text())
    if not flip:
        assert proc.returncode == 0 and status["code"] == 0, output[-4000:]
        last = json.loads((run_dir / "checkpoints" / "step_00000006" / "rank_00000.json").read_text())
        assert last["handlers"]["replica_check"] == {"verified_step": 4, "rollbacks": 0, "mismatches": []}
        return
    if rollbacks:
        assert proc.returncode == 0 and status["code"] == 0 and status["step"] == 6, output[-4000:]
        assert output.count("replica_check: rolled back to step 2") == 4, output[-4000:]
        return
    host = socket.gethostname()
    # every worker exits 79 (the launcher itself exits 1 when its workers fail)
    assert proc.returncode != 0 and rank_exit_codes(proc.stderr) == [79] * 4, output[-4000:]
    assert status["code"] == 79 and status["step"] == 5, status
    assert status["nodes"] == [host], status
    assert f"rank 1 on {host}, rank 3 on {host} (a tie" in status["reason"], status
