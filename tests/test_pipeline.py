"""Pipeline parallelism on real gloo process groups: every schedule torch offers (and a CSV one)
against a single-process non-PP reference, PP x DP, and the configuration checks."""

from __future__ import annotations

import copy
import hashlib
import math
import os
import warnings

import pytest
import torch

from hookloop.engine.errors import ConfigError
from hookloop.engine.pipeline import (
    PipelineConfig,
    available_schedules,
    default_module_fqns,
    split_stage_module,
)
from tests.cadence import save_every, validate_every
from tests.dist_utils import run_distributed

MB_SIZE = 2  # samples per microbatch
N_MB = 4  # microbatches per step
CLIP = 0.5  # small enough that every step clips: the norm must span all stages
TOL = 1e-5

# rank 0 runs stages 0 and 2, rank 1 runs 1 and 3; breadth-first, four microbatches.
CSV_ROWS = [
    [f"{s}F{m}" for s in (0, 2) for m in range(N_MB)] + [f"{s}B{m}" for s in (2, 0) for m in range(N_MB)],
    [f"{s}F{m}" for s in (1, 3) for m in range(N_MB)] + [f"{s}B{m}" for s in (3, 1) for m in range(N_MB)],
]


def _model(n_layers: int = 4):
    from tests.conftest import tiny_gpt

    return tiny_gpt(seed=0, n_layers=n_layers)


def _data(dp_rank: int = 0, dp_size: int = 1) -> tuple[list, list]:
    """Seven training microbatches (a full step, then a short one) and five validation ones, the
    last of them one sample short (as a loader without drop_last yields)."""
    from tests.conftest import token_batches

    train = token_batches(7 * dp_size, batch=MB_SIZE, seed=1)[dp_rank::dp_size]
    val = token_batches(5 * dp_size, batch=MB_SIZE, seed=2)[dp_rank::dp_size]
    x, y = val[-1]
    val[-1] = (x[:-1], y[:-1])
    return train, val


def _reference(dp_size: int = 1) -> dict:
    """Two local steps (grad accumulation over every dp rank's microbatches), AdamW, clipping."""
    from hookloop.models.gpt import cross_entropy_loss

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shards = [_data(r, dp_size) for r in range(dp_size)]
    steps = [
        [mb for train, _ in shards for mb in train[:N_MB]],
        [mb for train, _ in shards for mb in train[N_MB:]],
    ]
    out: dict = {"loss": [], "mb_losses": [], "grads": [], "norm": []}
    for batch in steps:
        losses = []
        for x, y in batch:
            loss = cross_entropy_loss(model(x), y)
            (loss / len(batch)).backward()
            losses.append(float(loss.detach()))
        # BEFORE_OPTIMIZER_STEP sees the gradients before clipping; the optimizer the clipped ones
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        out["loss"].append(sum(losses) / len(losses))
        out["mb_losses"].append(losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        # Every validation sample weighs the same (the short last batch's samples too).
        val = [(float(cross_entropy_loss(model(x), y)) * len(x), len(x)) for _, v in shards for x, y in v]
    out["val_loss"] = sum(total for total, _ in val) / sum(n for _, n in val)
    return out


def _strip(name: str) -> str:
    """``0.module.blocks.1.qkv_heads.weight`` (ModuleList index, DDP prefix) ->
    ``blocks.1.qkv_heads.weight``."""
    parts = name.split(".")[1:]
    return ".".join(parts[1:] if parts[0] == "module" else parts)


def _run_pipelined(info, pipeline_cfg: PipelineConfig, dp_mode: str = "ddp") -> dict:
    from hookloop.engine import Events, Trainer
    from hookloop.engine.pipeline import build_pipeline
    from hookloop.models.gpt import cross_entropy_loss

    runtime = build_pipeline(_model(), pipeline_cfg, info, cross_entropy_loss, dp_mode=dp_mode)
    opt = torch.optim.AdamW(runtime.parameters(), lr=1e-2)
    trainer = Trainer(runtime.module, opt, cross_entropy_loss, grad_clip_norm=CLIP, step_body=runtime)
    train, val = _data(runtime.dp_rank, runtime.dp_size)
    trainer.set_validation(val)
    validate_every(trainer, 2)
    seen: dict = {"loss": [], "mb_losses": [[], []], "grads": [], "norm": [], "mb_index": [[], []]}

    @trainer.on(Events.MICROBATCH)
    def on_microbatch(engine):
        seen["mb_losses"][engine.state.step - 1].append(engine.state.microbatch_loss)
        seen["mb_index"][engine.state.step - 1].append(engine.state.microbatch)

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def on_before_step(engine):
        grads = {}
        for name, p in runtime.module.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[_strip(name)] = g.clone()
        seen["grads"].append(grads)
        seen["norm"].append(engine.state.grad_norm)

    @trainer.on(Events.STEP_END)
    def on_step_end(engine):
        seen["loss"].append(engine.state.loss)

    state = trainer.run(train, max_epochs=1)
    seen["val_loss"] = state.metrics["val_loss"]
    seen["steps"] = state.step
    seen["samples"] = state.samples_seen
    seen["stage_ids"] = runtime.stage_ids
    seen["dp"] = (runtime.dp_rank, runtime.dp_size)
    return seen


def _compare(got: dict, ref: dict, dp_rank: int = 0, dp_size: int = 1) -> list[str]:
    """What differs between a pipelined run and the reference (empty = equal within TOL). Step
    losses are means over every dp rank; microbatch losses are this dp rank's own."""
    problems = []
    if got["steps"] != 2:
        problems.append(f"ran {got['steps']} steps, expected 2")
    for step in range(2):
        if abs(got["loss"][step] - ref["loss"][step]) > TOL:
            problems.append(f"step {step + 1} loss {got['loss'][step]} vs {ref['loss'][step]}")
        if abs(got["norm"][step] - ref["norm"][step]) > TOL:
            problems.append(f"step {step + 1} grad norm {got['norm'][step]} vs {ref['norm'][step]}")
        per_rank = len(ref["mb_losses"][step]) // dp_size
        ref_mb = ref["mb_losses"][step][dp_rank * per_rank : (dp_rank + 1) * per_rank]
        got_mb = got["mb_losses"][step]
        if len(got_mb) != len(ref_mb) or max(abs(a - b) for a, b in zip(got_mb, ref_mb)) > TOL:
            problems.append(f"step {step + 1} microbatch losses {got_mb} vs {ref_mb}")
        if got["mb_index"][step] != list(range(len(ref_mb))):
            problems.append(f"step {step + 1} microbatch indices {got['mb_index'][step]}")
        for name, g in got["grads"][step].items():
            diff = (g - ref["grads"][step][name]).abs().max().item()
            if diff > TOL:
                problems.append(f"step {step + 1} grad {name} differs by {diff:.2e}")
    if abs(got["val_loss"] - ref["val_loss"]) > TOL:
        problems.append(f"val_loss {got['val_loss']} vs {ref['val_loss']}")
    return problems


def _all_schedules_worker(rank: int, world: int, csv_path: str) -> dict:
    from hookloop.engine import init_distributed

    torch.use_deterministic_algorithms(True)
    info = init_distributed(mesh_shape=(1, world), mesh_dim_names=("dp", "pp"))
    ref = _reference()
    results: dict = {}
    cases = [(name, None) for name in available_schedules()] + [("csv", csv_path)]
    for i, (name, csv) in enumerate(cases):
        cfg = PipelineConfig(
            pp_schedule=None if csv else name,
            pp_schedule_csv=csv,
            pp_microbatch_size=MB_SIZE,
            pp_batch_size=MB_SIZE * N_MB,
            scale_grads_in_schedule=bool(i % 2),  # both loss-scaling modes, across single and multi
        )
        got = _run_pipelined(info, cfg)
        covered = sorted(n for grads in got["grads"][:1] for n in grads)
        results[name] = {
            "problems": _compare(got, ref),
            "covered": covered,
            "stage_ids": got["stage_ids"],
            "samples": got["samples"],
        }
    results["veto"] = _veto_run(info, rank)
    return results


def _veto_run(info, rank: int) -> dict:
    """Rank 1 alone vetoes step 1: no rank steps, every rank counts the skip."""
    from hookloop.engine import Events, Trainer
    from hookloop.engine.pipeline import build_pipeline
    from hookloop.models.gpt import cross_entropy_loss

    cfg = PipelineConfig(pp_schedule="gpipe", pp_microbatch_size=MB_SIZE, pp_batch_size=MB_SIZE * N_MB)
    runtime = build_pipeline(_model(), cfg, info, cross_entropy_loss)
    before = [p.detach().clone() for p in runtime.parameters()]
    try:  # the whole model instead of this rank's stages is refused
        Trainer(
            _model(), torch.optim.SGD(runtime.parameters(), lr=0.1), cross_entropy_loss, step_body=runtime
        )
        refused = False
    except ValueError:
        refused = True
    trainer = Trainer(
        runtime.module, torch.optim.SGD(runtime.parameters(), lr=0.1), cross_entropy_loss, step_body=runtime
    )
    trainer.add_event_handler(
        Events.BEFORE_OPTIMIZER_STEP, lambda e: e.control.request_skip() if rank == 1 else None
    )
    state = trainer.run(_data()[0][:N_MB], max_steps=1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, runtime.parameters()))
    return {"unchanged": unchanged, "skipped": state.skipped_steps, "refused_whole_model": refused}


@pytest.mark.distributed
def test_every_schedule_matches_the_reference(tmp_path):
    """Each schedule torch offers, plus a CSV schedule, on 2 ranks (4 stages where multi-stage):
    losses (per step and per microbatch), grad norms, gradients and validation loss equal
    a single-process run over two steps, the second a short (padded) one, with both loss-scaling
    modes; every parameter of the model is trained on exactly one rank."""
    csv_path = tmp_path / "looped.csv"
    csv_path.write_text("\n".join(",".join(row) for row in CSV_ROWS) + "\n")
    per_rank = run_distributed(_all_schedules_worker, 2, str(csv_path))
    all_params = sorted(n for n, _ in _model().named_parameters())
    names = available_schedules() + ["csv"]
    assert set(per_rank[0]) == set(names) | {"veto"}
    for name in names:
        for rank in (0, 1):
            assert per_rank[rank][name]["problems"] == [], (name, rank, per_rank[rank][name]["problems"])
        covered = per_rank[0][name]["covered"] + per_rank[1][name]["covered"]
        assert sorted(covered) == all_params, name
        # samples are counted once per pipeline, on every rank
        assert per_rank[0][name]["samples"] == per_rank[1][name]["samples"] == 7 * MB_SIZE
    layouts = {name: (per_rank[0][name]["stage_ids"], per_rank[1][name]["stage_ids"]) for name in names}
    assert layouts["GPipe"] == ([0], [1])
    assert layouts["Interleaved1F1B"] == ([0, 2], [1, 3])
    assert layouts["ZBVZeroBubble"] == ([0, 3], [1, 2])
    assert layouts["csv"] == ([0, 2], [1, 3])
    # a veto from one rank skips the step on every stage
    assert (
        per_rank[0]["veto"]
        == per_rank[1]["veto"]
        == {"unchanged": True, "skipped": 1, "refused_whole_model": True}
    )


def _pp_dp_worker(rank: int, world: int) -> dict:
    from hookloop.engine import init_distributed

    torch.use_deterministic_algorithms(True)
    info = init_distributed(mesh_shape=(2, 2), mesh_dim_names=("dp", "pp"))
    ref = _reference(dp_size=2)
    out = {}
    for mode in ("ddp", "fsdp"):
        cfg = PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=MB_SIZE, pp_batch_size=MB_SIZE * N_MB)
        got = _run_pipelined(info, cfg, dp_mode=mode)
        out[mode] = {
            "problems": _compare(got, ref, *got["dp"]),
            "covered": sorted(got["grads"][0]),
            "samples": got["samples"],
        }
    return out


@pytest.mark.distributed
def test_pp2_dp2_matches_the_reference():
    """PP=2 x DP=2 (4 processes, 1F1B, stages replicated with DDP, then sharded with FSDP2):
    gradients and losses equal one process accumulating both data-parallel shards."""
    per_rank = run_distributed(_pp_dp_worker, 4)
    all_params = sorted(n for n, _ in _model().named_parameters())
    for mode in ("ddp", "fsdp"):
        for rank, result in enumerate(per_rank):
            assert result[mode]["problems"] == [], (mode, rank, result[mode]["problems"])
        # mesh (dp, pp): ranks 0 and 1 form one pipeline
        assert sorted(per_rank[0][mode]["covered"] + per_rank[1][mode]["covered"]) == all_params
        assert all(r[mode]["samples"] == 2 * 7 * MB_SIZE for r in per_rank)


def _resume_worker(rank: int, world: int, directory: str) -> dict:
    from hookloop.engine import Trainer, init_distributed
    from hookloop.engine.checkpoint_format.directory import step_dir_name
    from hookloop.engine.pipeline import build_pipeline
    from hookloop.handlers.checkpoint import AsyncCheckpointer
    from hookloop.models.gpt import cross_entropy_loss
    from tests.conftest import token_batches

    torch.use_deterministic_algorithms(True)
    info = init_distributed(mesh_shape=(1, world), mesh_dim_names=("dp", "pp"))
    data = token_batches(4 * N_MB, batch=MB_SIZE, seed=3)  # four steps in one epoch
    cfg = PipelineConfig(
        pp_schedule="interleaved1f1b", pp_microbatch_size=MB_SIZE, pp_batch_size=MB_SIZE * N_MB
    )

    def run(checkpoint: str | None, resume: str = "auto") -> tuple[dict, int]:
        runtime = build_pipeline(_model(), cfg, info, cross_entropy_loss)
        opt = torch.optim.AdamW(runtime.parameters(), lr=1e-2)
        trainer = Trainer(runtime.module, opt, cross_entropy_loss, grad_clip_norm=CLIP, step_body=runtime)
        if checkpoint is not None:
            AsyncCheckpointer(checkpoint, mode="async", resume=resume).attach(trainer)
            save_every(trainer, 2)
        state = trainer.run(data, max_steps=4)
        if checkpoint is not None:
            trainer.get_handler(AsyncCheckpointer).close()
        params = {n: p.detach().clone() for n, p in runtime.module.named_parameters()}
        return params, state.step

    def same(a: dict, b: dict) -> bool:
        return all(torch.equal(a[n], b[n]) for n in a)

    straight, _ = run(None)
    saving, _ = run(directory)  # saves step 2 while step 3 runs (its optimizer waits for it), and step 4
    resumed, last_step = run(directory + "_resumed", resume=os.path.join(directory, step_dir_name(2)))
    return {"unchanged": same(straight, saving), "bitwise": same(straight, resumed), "last_step": last_step}


@pytest.mark.distributed
def test_resume_through_the_checkpointer_is_bitwise(tmp_path):
    """A pipelined run (interleaved 1F1B, two stages per rank) checkpointed at step 2 by the
    AsyncCheckpointer (in the background, while step 3 runs) and resumed from there to step 4 ends
    with the same parameters, bit for bit, as a run that never stopped; so does the run that saved."""
    per_rank = run_distributed(_resume_worker, 2, str(tmp_path / "ckpt"))
    for result in per_rank:
        assert result == {"unchanged": True, "bitwise": True, "last_step": 4}


@pytest.mark.distributed
def test_torchrun_trains_from_the_run_config():
    """Under torchrun, a run config with ``distributed.pp_size=2 pipeline.pp_schedule=1f1b`` trains
    the GPT in two stages: both ranks report the same (broadcast) loss, and it goes down."""
    import json
    import re

    from tests.dist_utils import REPO, run_torchrun

    args = ["distributed.pp_size=2", "pipeline.pp_schedule=1f1b"]
    proc = run_torchrun(REPO / "tests" / "scripts" / "pp_train.py", 2, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)), key=lambda r: r["rank"])
    assert [r["stages"] for r in rows] == [[0], [1]]
    assert rows[0]["first"] == rows[1]["first"] and rows[0]["last"] == rows[1]["last"]
    assert rows[0]["last"] < rows[0]["first"] - 0.1


# ---------------------------------------------------------------------- configuration checks


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        PipelineConfig(pp_schedule="zero_bubble_v2").validate("pipeline", pp_size=2)
    assert err.value.field == "pipeline.pp_schedule"
    for name in available_schedules():
        assert name in str(err.value)
    # torch's own lookup is case-insensitive; '_' is accepted as in interleaved_1f1b
    assert PipelineConfig(pp_schedule="interleaved_1f1b", pp_batch_size=4).stage_plan(2)["num_stages"] == 4


def test_available_schedules_come_from_torch():
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    names = available_schedules()
    assert {"GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"} <= set(names)
    for name in names:
        assert get_schedule_class(name) is not PipelineScheduleMulti  # bases are left out


def test_batch_must_divide_into_microbatches():
    with pytest.raises(ConfigError, match="pp_batch_size.*multiple of pipeline.pp_microbatch_size"):
        PipelineConfig(pp_batch_size=6, pp_microbatch_size=4).validate()


def test_layers_per_stage_needs_a_pp_multiple_unless_rounding():
    kw = dict(pp_schedule="interleaved1f1b", layers_per_stage=2, pp_batch_size=4)
    cfg = PipelineConfig(**kw)
    with pytest.raises(ConfigError) as err:
        cfg.stage_plan(2, n_layers=5)  # ceil(5 / 2) = 3 stages
    assert err.value.field == "pipeline.layers_per_stage" and "round_virtual_stages_to_pp_multiple" in str(
        err.value
    )
    up = PipelineConfig(**kw, round_virtual_stages_to_pp_multiple="up")
    down = PipelineConfig(**kw, round_virtual_stages_to_pp_multiple="down")
    assert up.stage_plan(2, n_layers=5, prefix="p")["num_stages"] == 4
    assert down.stage_plan(2, n_layers=5)["num_stages"] == 2
    with pytest.raises(ConfigError, match="one stage per rank"):
        PipelineConfig(pp_schedule="1f1b", layers_per_stage=1).stage_plan(2, n_layers=4)
    with pytest.raises(ConfigError, match="only applies with"):
        PipelineConfig(round_virtual_stages_to_pp_multiple="up").validate()


def test_schedule_csv_must_exist_and_parse(tmp_path):
    with pytest.raises(ConfigError) as err:
        PipelineConfig(pp_schedule_csv=str(tmp_path / "nope.csv")).validate("pipeline", pp_size=2)
    assert err.value.field == "pipeline.pp_schedule_csv" and "does not exist" in str(err.value)
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X1\n1F0,1B0\n")
    with pytest.raises(ConfigError, match="does not parse"):
        PipelineConfig(pp_schedule_csv=str(bad)).validate("pipeline", pp_size=2)
    unordered = tmp_path / "unordered.csv"
    unordered.write_text("0B0,0F0\n1F0,1B0\n")
    with pytest.raises(ConfigError, match="not a valid schedule"):
        PipelineConfig(pp_schedule_csv=str(unordered)).validate("pipeline", pp_size=2)
    good = tmp_path / "good.csv"
    good.write_text("\n".join(",".join(row) for row in CSV_ROWS))
    with pytest.raises(ConfigError, match="3 rows|2 rows"):
        PipelineConfig(pp_schedule_csv=str(good), pp_batch_size=N_MB).validate("pipeline", pp_size=3)
    with pytest.raises(ConfigError, match="schedules 4 microbatches"):
        PipelineConfig(pp_schedule_csv=str(good), pp_batch_size=2).validate("pipeline", pp_size=2)
    plan = PipelineConfig(pp_schedule_csv=str(good), pp_batch_size=N_MB).stage_plan(2)
    assert plan["num_stages"] == 4 and plan["rank_stages"] == {0: [0, 2], 1: [1, 3]}


def test_fewer_microbatches_than_stages_warns_with_the_bubble():
    with pytest.warns(UserWarning, match=r"2 microbatches per step for 4 pipeline stages.*about 20%"):
        PipelineConfig(pp_schedule="interleaved1f1b", pp_batch_size=2).validate("pipeline", pp_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PipelineConfig(pp_schedule="1f1b", pp_batch_size=2).validate("pipeline", pp_size=2)


def test_fewer_microbatches_than_stages_is_refused_where_the_schedule_cannot_run():
    """torch's 1F1B refuses fewer microbatches than stages only when the step runs: the config
    check says so first, naming the field and the two settings that fix it."""
    with pytest.raises(ConfigError, match="needs at least one per stage") as err:
        PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=8, pp_batch_size=8).validate(
            "pipeline", pp_size=2
        )
    assert err.value.field == "pipeline.pp_batch_size"
    assert "step_scheduler.global_batch_size" in str(err.value) and "train.local_batch_size" in str(err.value)
    with pytest.warns(UserWarning, match="1 microbatches per step for 2"):  # GPipe runs it, with a bubble
        PipelineConfig(pp_schedule="gpipe", pp_microbatch_size=8, pp_batch_size=8).validate(
            "pipeline", pp_size=2
        )


def test_other_field_errors():
    with pytest.raises(ConfigError, match="set only one"):
        PipelineConfig(layers_per_stage=1, module_fqns_per_model_part=[["a"], ["b"]]).validate()
    with pytest.raises(ConfigError, match="already in stage 0"):
        PipelineConfig(module_fqns_per_model_part=[["a"], ["a"]]).validate()
    with pytest.raises(ConfigError, match="pipeline.dtype"):
        PipelineConfig(dtype="float8").validate()
    with pytest.raises(ConfigError, match="pipeline.pp_microbatch_size"):
        PipelineConfig(pp_microbatch_size=0).validate()


@pytest.mark.filterwarnings("ignore:pipeline. 1 microbatches:UserWarning")
def test_config_file_section_is_checked_with_the_degree():
    from hookloop.handlers import load_run_config as load_config

    pp = ["distributed.pp_size=2", "step_scheduler.max_steps=10"]
    with pytest.raises(ConfigError) as err:
        load_config(overrides=pp + ["pipeline.pp_schedule=bogus"], world_size=2)
    assert err.value.field == "pipeline.pp_schedule"
    # batch sizes left unset follow the run's: 8 per microbatch, 16 // 2 data-parallel ranks per step
    batch = ["train.local_batch_size=8", "step_scheduler.global_batch_size=32"]
    cfg = load_config(overrides=pp + batch + ["pipeline.pp_schedule=gpipe"], world_size=4)
    pcfg = PipelineConfig.from_section(cfg.pipeline)
    assert (pcfg.pp_schedule, pcfg.pp_microbatch_size, pcfg.pp_batch_size, pcfg.n_microbatches) == (
        "gpipe",
        8,
        16,
        2,
    )
    assert pcfg.to_dict()["pp_batch_size"] == 16
    with pytest.raises(ConfigError) as err:
        load_config(overrides=pp + batch + ["pipeline.pp_microbatch_size=4"], world_size=4)
    assert err.value.field == "train.local_batch_size"
    with pytest.raises(ConfigError) as err:
        load_config(overrides=pp + batch + ["pipeline.pp_batch_size=24"], world_size=4)
    assert err.value.field == "step_scheduler.global_batch_size"


def test_to_dict_is_plain():
    from hookloop.models.gpt import cross_entropy_loss

    d = PipelineConfig(
        dtype=torch.bfloat16, loss_fn=cross_entropy_loss, module_fqns_per_model_part=[["a"]]
    ).to_dict()
    assert d["dtype"] == "bfloat16"
    assert d["loss_fn"] == "hookloop.recipe.token_cross_entropy"  # gpt's cross_entropy_loss
    assert d["module_fqns_per_model_part"] == [["a"]]
    assert set(d) == {f for f in PipelineConfig.__dataclass_fields__}


# ---------------------------------------------------------------------- stage splitting


def test_default_split_embedding_first_head_last():
    model = _model(n_layers=5)
    parts = default_module_fqns(model, 4)
    assert parts == [
        ["tok_emb", "pos_emb", "blocks.0", "blocks.1"],
        ["blocks.2"],
        ["blocks.3"],
        ["blocks.4", "norm", "head"],
    ]
    with pytest.raises(ConfigError, match="stage 2 would be empty"):
        default_module_fqns(_model(n_layers=2), 4)


def test_stage_modules_keep_names_and_compose_to_the_whole_model():
    model = _model(n_layers=4)
    parts = default_module_fqns(model, 2)
    first, last = (split_stage_module(model, parts, s) for s in (0, 1))
    assert first.head is None and first.norm is None and list(first.blocks) == ["0", "1"]
    assert last.tok_emb is None and list(last.blocks) == ["2", "3"]
    names = sorted(n for m in (first, last) for n, _ in m.named_parameters())
    assert names == sorted(n for n, _ in model.named_parameters())
    x = torch.randint(0, 64, (2, 16))
    assert torch.equal(last(first(x)), model(x))


def test_split_rejects_bad_module_lists():
    model = _model(n_layers=2)
    with pytest.raises(ConfigError, match="has no module 'blocks.9'"):
        split_stage_module(model, [["tok_emb", "pos_emb", "blocks.9"], ["blocks.1", "norm", "head"]], 0)
    with pytest.raises(ConfigError, match="in no stage would never train"):
        split_stage_module(model, [["tok_emb", "pos_emb", "blocks.0"], ["norm", "head"]], 0)
    listed = copy.deepcopy(model)
    listed.blocks = torch.nn.ModuleList(listed.blocks.values())
    with pytest.raises(ConfigError, match="ModuleDict"):
        split_stage_module(listed, [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1", "norm", "head"]], 0)


def test_trainer_wants_the_built_runtime():
    from hookloop.engine import Trainer
    from hookloop.models.gpt import cross_entropy_loss

    model = _model(n_layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="build_pipeline"):
        Trainer(model, opt, cross_entropy_loss, pipeline=PipelineConfig())


def test_bubble_formula():
    from hookloop.engine.pipeline import bubble_fraction

    assert math.isclose(bubble_fraction(4, 2), 1 / 5)
    assert math.isclose(bubble_fraction(4, 2, 2), 1 / 9)


def _adamw_pipeline(info, cfg: PipelineConfig, **trainer_kwargs):
    """This rank's stages of the test model (DDP across data-parallel replicas) and a Trainer with
    AdamW over them."""
    from hookloop.engine import Trainer
    from hookloop.engine.pipeline import build_pipeline
    from hookloop.models.gpt import cross_entropy_loss

    runtime = build_pipeline(_model(), cfg, info, cross_entropy_loss, dp_mode="ddp")
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-2)
    trainer = Trainer(
        runtime.module,
        optimizer,
        cross_entropy_loss,
        step_body=runtime,
        hang_timeout_s=None,
        **trainer_kwargs,
    )
    return runtime, trainer


def _precision_worker(rank: int, world: int) -> dict:
    """Two stages trained for a few steps three ways: fp32, bf16-mixed (fp32 weights, autocast in
    the schedule), and pipeline.dtype=bfloat16 (the stages' own weights cast)."""
    from hookloop.engine import Events, init_distributed
    from tests.conftest import token_batches

    info = init_distributed(mesh_shape=(1, world), mesh_dim_names=("dp", "pp"))
    data = token_batches(8 * N_MB, batch=MB_SIZE, seed=3)[:N_MB] * 8  # one step's batch, 8 times
    out: dict = {}
    for name, precision, dtype in (
        ("fp32", "fp32", None),
        ("bf16", "bf16-mixed", None),
        ("cast", "fp32", "bfloat16"),
    ):
        cfg = PipelineConfig(
            pp_schedule="1f1b", pp_microbatch_size=MB_SIZE, pp_batch_size=MB_SIZE * N_MB, dtype=dtype
        )
        runtime, trainer = _adamw_pipeline(info, cfg, precision=precision)
        activations: set = set()  # what the stages' linear layers compute in
        linears = [m for stage in runtime.module for m in stage.modules() if isinstance(m, torch.nn.Linear)]
        for linear in linears:
            linear.register_forward_hook(lambda mod, inp, o, seen=activations: seen.add(str(o.dtype)))
        losses: list = []
        trainer.add_event_handler(Events.STEP_END, lambda e, seen=losses: seen.append(e.state.loss))
        trainer.run(data, max_steps=8)
        out[name] = {
            "losses": losses,
            "activations": sorted(activations),
            "params": sorted({str(p.dtype) for p in runtime.parameters()}),
        }
    return out


@pytest.mark.distributed
def test_pipeline_precision_bf16_mixed_and_stage_dtype():
    """bf16-mixed keeps fp32 weights and runs the stages in bf16, close to fp32; pipeline.dtype casts
    the stage weights themselves; all three train (the repeated batch's loss falls)."""
    a, b = run_distributed(_precision_worker, 2)
    for r in (a, b):
        assert r["fp32"]["params"] == r["bf16"]["params"] == ["torch.float32"]
        assert r["cast"]["params"] == ["torch.bfloat16"]
        assert r["fp32"]["activations"] == ["torch.float32"]
        assert r["bf16"]["activations"] == r["cast"]["activations"] == ["torch.bfloat16"]
    for name in ("fp32", "bf16", "cast"):
        losses = a[name]["losses"]
        assert losses == b[name]["losses"], name  # every pp rank reports the broadcast loss
        assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.85 * losses[0], (name, losses)
    assert a["bf16"]["losses"][0] == pytest.approx(a["fp32"]["losses"][0], rel=2e-2)


def _ddp_stages_worker(rank: int, world: int) -> dict:
    """PP=2 x DP=2 with DDP stages and as many microbatches per step as stages (the layout where
    the stage shape inference used to double DDP's first-step bucket rebuild)."""
    from hookloop.engine import Events, init_distributed
    from tests.conftest import token_batches

    info = init_distributed(mesh_shape=(2, 2), mesh_dim_names=("dp", "pp"))
    cfg = PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=MB_SIZE, pp_batch_size=MB_SIZE * 2)
    runtime, trainer = _adamw_pipeline(info, cfg, grad_clip_norm=CLIP)
    losses: list = []
    trainer.add_event_handler(Events.STEP_END, lambda e: losses.append(e.state.loss))
    state = trainer.run(token_batches(8, batch=MB_SIZE, seed=runtime.dp_rank), max_steps=4)
    named = sorted((_strip(n), p.detach()) for n, p in runtime.module.named_parameters())
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for _, p in named)).hexdigest()
    return {"steps": state.step, "losses": losses, "stage": tuple(n for n, _ in named), "digest": digest}


@pytest.mark.distributed
def test_ddp_stages_with_one_microbatch_per_stage_train_past_the_first_step():
    per_rank = run_distributed(_ddp_stages_worker, 4)
    assert [r["steps"] for r in per_rank] == [4, 4, 4, 4]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)  # the mean over dp ranks
    # the two replicas of each stage hold the same weights (DDP averaged their gradients)
    replicas: dict = {}
    for r in per_rank:
        replicas.setdefault(r["stage"], set()).add(r["digest"])
    assert len(replicas) == 2 and all(len(digests) == 1 for digests in replicas.values())
