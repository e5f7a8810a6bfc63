"""Tensor (and sequence) parallelism on real gloo process groups: the bundled GPT under tp=2,
dp=2 x tp=2 and pp=2 x tp=2 against one process on the same global batch (losses, gradient norms
with clipping, token counts, 20 steps), and the checks that refuse bad layouts before any work."""

from __future__ import annotations

import pytest
import torch

from hookloop.engine.errors import ConfigError
from tests.cadence import save_every
from tests.dist_utils import run_distributed

STEPS = 20
N_MB = 2  # microbatches per step
MB = 2  # samples per microbatch on one data-parallel rank
CLIP = 0.2  # small enough that every step clips: the norm must be the global one
REL = 1e-5
# The norm of gradients sharded over dp x tp is summed in another order than one process's; over 20
# AdamW steps that drift reaches 2e-5 at one step (deterministic: the same value every run).
REL_NORM = 5e-5
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


def _tp_worker(rank: int, world: int, tp: int, pp: int, dp_mode: str, sp: bool, lp: bool = False) -> dict:
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
        apply_tensor_parallel(model, info.mesh_dim("tp"), tp_plan, sequence_parallel=sp, loss_parallel=lp)
        model = wrap_data_parallel(model, dp_mode, mesh=info.mesh_dim("dp"))
    trainer = Trainer(
        model,
        _optimizer(model.parameters()),
        cross_entropy_loss,
        grad_accum_steps=N_MB,
        grad_clip_norm=CLIP,
        step_body=runtime,
        hang_timeout_s=60,
        graceful_sigint=False,
        loss_parallel=lp,
    )
    seen = _record(trainer)
    if lp:  # the logits stay sharded over the vocabulary; MICROBATCH handlers see them whole
        from hookloop.engine import Events

        shapes = seen["output_shapes"] = []
        trainer.add_event_handler(
            Events.MICROBATCH, lambda: shapes.append(tuple(trainer.state.microbatch_output.shape))
        )
        trainer.set_validation(local[:2])
    trainer.run(local, max_steps=STEPS)
    if lp:
        seen["val_loss"] = trainer.validate()
        head_out = model.head(torch.zeros(1, 1, model.cfg.d_model))
        seen["head_output"] = (type(head_out).__name__, head_out.to_local().shape[-1])
    params = {}
    for name, p in model.named_parameters():
        full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[_strip(name)] = full_p.detach().numpy().copy()  # tensors do not cross processes
    seen["params"] = params
    seen["param_kinds"] = sorted({type(p).__name__ for p in model.parameters()})
    return seen


def _strip(name: str) -> str:
    """A wrapped / staged parameter name as the plain model's: ``0.blocks.1.qkv_heads.weight`` (stage
    index first) or ``module.blocks...`` -> ``blocks.1.qkv_heads.weight``."""
    parts = [p for p in name.split(".") if p not in ("module", "_checkpoint_wrapped_module")]
    if parts and parts[0].isdigit() and len(parts) > 1 and not parts[1].isdigit():
        parts = parts[1:]
    return ".".join(parts)


def _check(per_rank: list[dict], ref: dict) -> None:
    for rank, got in enumerate(per_rank):
        assert "DTensor" in got["param_kinds"], (rank, got["param_kinds"])
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL), rank
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL_NORM), rank
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
@pytest.mark.parametrize(
    ("sp", "lp"), [(False, False), (True, False), (True, True)], ids=["tp", "tp+sp", "tp+sp+lp"]
)
def test_tp2_matches_one_process(sp, lp):
    per_rank = run_distributed(_tp_worker, 2, 2, 1, "ddp", sp, lp)
    ref = _reference(dp=1)
    _check(per_rank, ref)
    if lp:
        from hookloop.engine import Trainer
        from hookloop.models.gpt import cross_entropy_loss
        from tests.conftest import tiny_gpt, token_batches

        model = tiny_gpt(**GPT_ARGS)
        model.load_state_dict(ref["params"])
        trainer = Trainer(model, _optimizer(model.parameters()), cross_entropy_loss, hang_timeout_s=None)
        trainer.set_validation(token_batches(STEPS * N_MB, batch=MB)[:2])
        for got in per_rank:
            assert got["head_output"] == ("DTensor", 32)  # 64 / 2 vocabulary entries per rank
            assert set(got["output_shapes"]) == {(MB, 16, 64)}
            assert got["val_loss"] == pytest.approx(trainer.validate(), rel=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("dp_mode", ["fsdp", "ddp"])
def test_dp2_tp2_matches_one_process(dp_mode):
    per_rank = run_distributed(_tp_worker, 4, 2, 1, dp_mode, False)
    _check(per_rank, _reference(dp=2))


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_tp2_matches_one_process():
    per_rank = run_distributed(_tp_worker, 4, 2, 2, "ddp", True)
    _check(per_rank, _reference(dp=1))


# ---------------------------------------------------------------------- checkpoints across layouts
SAVE_AT = 3


def _full_state(model, optimizer) -> dict:
    """Model and optimizer state as whole tensors (gathered from every shard), keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    out = {}
    for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
        for key, value in sd.items():
            if isinstance(value, torch.Tensor):
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"{prefix}.{key}"] = value.detach().cpu().numpy().copy()
            elif isinstance(value, (int, float)):
                out[f"{prefix}.{key}"] = value
    return out


def _ckpt_worker(
    rank: int, world: int, tp: int, dp_mode: str, directory: str, max_steps: int, pp: int = 1
) -> dict:
    """Train with the checkpointer in ``directory`` (saving every ``SAVE_AT`` steps, resuming from
    the newest checkpoint there) up to ``max_steps``; return the whole state right after the resume
    (or after the run, when nothing resumed), the step training resumed at and the last step."""
    from hookloop.engine import Events, Trainer, init_distributed, wrap_data_parallel
    from hookloop.engine.parallel import parallel_mesh
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.handlers import Places
    from hookloop.handlers.checkpoint import AsyncCheckpointer
    from hookloop.models.gpt import cross_entropy_loss, tp_plan
    from tests.conftest import tiny_gpt, token_batches

    info = init_distributed("gloo", **parallel_mesh(world, tp, pp))
    dp = world // (tp * pp)
    dp_rank = rank // (tp * pp)
    full = token_batches(8 * N_MB, batch=4)  # 4 samples per global microbatch at every layout
    per = 4 // dp
    local = [
        (x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]) for x, y in full
    ]
    model = tiny_gpt(**GPT_ARGS)
    runtime = None
    if pp > 1:
        from hookloop.engine import build_pipeline
        from hookloop.engine.pipeline import PipelineConfig

        cfg = PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=per, pp_batch_size=per * N_MB)
        runtime = build_pipeline(model, cfg, info, cross_entropy_loss, dp_mode=dp_mode, tp_plan=tp_plan)
        model = runtime.module
    elif tp > 1:
        apply_tensor_parallel(model, info.mesh_dim("tp"), tp_plan)
        model = wrap_data_parallel(model, dp_mode, mesh=info.mesh_dim("dp"))
    else:
        model = wrap_data_parallel(model, dp_mode, mesh=info.mesh)
    optimizer = _optimizer(model.parameters())
    trainer = Trainer(
        model,
        optimizer,
        cross_entropy_loss,
        grad_accum_steps=N_MB,
        grad_clip_norm=CLIP,
        hang_timeout_s=60,
        step_body=runtime,
    )
    checkpointer = AsyncCheckpointer(directory, mode="sync").attach(trainer)
    save_every(trainer, SAVE_AT)
    seen: dict = {}

    @trainer.on(Events.TRAIN_START, priority=Places.RESUME - 1)
    def after_resume(engine):
        seen["start"] = engine.state.iteration
        if engine.state.iteration:
            seen["state"] = _full_state(model, optimizer)

    state = trainer.run(local, max_steps=max_steps)
    checkpointer.close()
    if "state" not in seen:
        seen["state"] = _full_state(model, optimizer)
    seen["step"] = state.step
    seen["loss"] = float(state.loss)
    # a pipeline's stages hold different parameters: every rank's part counts
    return seen if rank == 0 or pp > 1 else {"start": seen["start"], "step": seen["step"]}


def _without_stages(state: dict) -> dict:
    """A pipeline run's state under the whole model's names (``model.0.blocks.1.w`` ->
    ``model.blocks.1.w``, the optimizer's keys likewise)."""
    import re

    stage = re.compile(r"^(model|optim\.state|optim\.param_groups)\.\d+\.")
    return {stage.sub(r"\1.", k): v for k, v in state.items()}


def _merged(per_rank: list[dict]) -> dict:
    """Every rank's part of a pipeline run's state (the stages hold different parameters)."""
    out: dict = {}
    for result in per_rank:
        out.update(result["state"])
    return out


def _same_state(got: dict, saved: dict) -> list[str]:
    import numpy as np

    problems = [f"missing {k}" for k in sorted(set(saved) - set(got))]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(saved))]
    for key in sorted(set(saved) & set(got)):
        a, b = np.asarray(saved[key]), np.asarray(got[key])
        if a.shape != b.shape or not np.array_equal(a, b):
            problems.append(key)
    return problems


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_of_dp2_tp2_resumes_at_other_layouts(tmp_path):
    """Saved at dp=2 x tp=2 (FSDP2 on dp), resumed at one process, at tp=2, at dp=4 and at
    pp=2 x tp=2 (the stages load their parameters by name): model and optimizer state equal to what
    was saved, bit for bit after gathering, and training goes on from the saved step."""
    import shutil

    saved_dir = tmp_path / "saved"
    saved = run_distributed(_ckpt_worker, 4, 2, "fsdp", str(saved_dir), SAVE_AT)
    assert [r["step"] for r in saved] == [SAVE_AT] * 4
    reference = saved[0]["state"]
    assert any(k.endswith("exp_avg") for k in reference) and "model.blocks.0.qkv_heads.weight" in reference
    layouts = {"one process": (1, 1, "ddp"), "tp=2": (2, 2, "ddp"), "dp=4": (4, 1, "fsdp")}
    for name, (world, tp, mode) in layouts.items():
        directory = tmp_path / name.replace(" ", "_").replace("=", "")
        shutil.copytree(saved_dir, directory)
        per_rank = run_distributed(_ckpt_worker, world, tp, mode, str(directory), SAVE_AT + 1)
        assert [(r["start"], r["step"]) for r in per_rank] == [(SAVE_AT, SAVE_AT + 1)] * world, name
        assert _same_state(per_rank[0]["state"], reference) == [], name
    shutil.copytree(saved_dir, tmp_path / "pp2_tp2")
    directory = str(tmp_path / "pp2_tp2")
    staged = run_distributed(_ckpt_worker, 4, 2, "ddp", directory, SAVE_AT + 1, 2)
    assert [(r["start"], r["step"]) for r in staged] == [(SAVE_AT, SAVE_AT + 1)] * 4
    got = _merged(staged)
    assert "model.0.blocks.0.qkv_heads.weight" in got  # loaded under the stages' own names
    assert _same_state(_without_stages(got), reference) == []


# ---------------------------------------------------------------------- Hugging Face Llama
LLAMA = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def _llama_batches(n: int, batch: int) -> list[dict]:
    from tests.conftest import token_batches

    return [{"input_ids": x, "labels": x} for x, _ in token_batches(n, batch=batch, vocab=256)]


def _llama_run(trainer_model, optimizer_params, data, tp_mesh=None) -> dict:
    from hookloop.engine import Trainer

    trainer = Trainer(
        trainer_model,
        _optimizer(optimizer_params),
        None,
        grad_accum_steps=N_MB,
        grad_clip_norm=CLIP,
        hang_timeout_s=60,
        graceful_sigint=False,
        tp_mesh=tp_mesh,
    )
    seen = _record(trainer)
    trainer.run(data, max_steps=LLAMA_STEPS)
    return seen


LLAMA_STEPS = 8


def _llama_worker(rank: int, world: int) -> dict:
    from hookloop.engine import init_distributed
    from hookloop.engine.parallel import parallel_mesh
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.models.hf import build, llama_tp_plan

    info = init_distributed("gloo", **parallel_mesh(world, world))
    torch.manual_seed(0)
    model = build("llama", seq_len=16, **LLAMA)
    apply_tensor_parallel(model, info.mesh_dim("tp"), llama_tp_plan)
    kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
    seen = _llama_run(model, model.parameters(), _llama_batches(LLAMA_STEPS * N_MB, MB), info.mesh_dim("tp"))
    seen["kinds"] = kinds
    return seen


@pytest.mark.distributed
def test_llama_tp2_matches_one_process():
    """A Hugging Face Llama (grouped-query attention: 4 query heads, 2 key/value heads) with the
    shipped plan under tp=2: the same losses and gradient norms as one process."""
    pytest.importorskip("transformers")
    from hookloop.models.hf import build

    per_rank = run_distributed(_llama_worker, 2)
    torch.manual_seed(0)
    model = build("llama", seq_len=16, **LLAMA)
    ref = _llama_run(model, model.parameters(), _llama_batches(LLAMA_STEPS * N_MB, MB))
    for got in per_rank:
        names = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        for name in names:
            assert got["kinds"][f"model.layers.0.{name}.weight"] == "DTensor", name
        assert got["kinds"]["model.embed_tokens.weight"] == got["kinds"]["lm_head.weight"] == "DTensor"
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL)
        assert got["tokens"] == ref["tokens"]


# ---------------------------------------------------------------------- bad input, refused early
def _config(overrides: list[str], world: int = 4):
    from hookloop.train import check, load_training_config

    cfg = load_training_config(
        None,
        [
            "model.target=hookloop.models.gpt:recipe",
            "train.seq_len=16",
            "step_scheduler.max_steps=10",
            *overrides,
        ],
        world_size=world,
    )
    return check(cfg)


@pytest.mark.parametrize(
    ("overrides", "world", "field", "words"),
    [
        (["distributed.tp_size=3"], 4, "distributed.tp_size", "must divide the world size (4)"),
        (["distributed.tp_size=2", "distributed.pp_size=4"], 4, "distributed.tp_size", "must divide"),
        (["distributed.tp_size=0"], 4, "distributed.tp_size", ""),
        (["distributed.sequence_parallel=true"], 4, "distributed.sequence_parallel", "tp_size > 1"),
        (["distributed.tp_size=4", "model.n_heads=2"], 4, "model.n_heads", "multiple of distributed.tp_size"),
        (["distributed.tp_size=2", "model.vocab_size=63"], 2, "model.vocab_size", "multiple"),
        (
            ["distributed.tp_size=2", "distributed.sequence_parallel=true", "train.seq_len=15"],
            2,
            "train.seq_len",
            "sequence_parallel",
        ),
        (["distributed.tp_size=2", "train.compile=true"], 2, "train.compile", "tp_size > 1"),
        (["distributed.tp_size=2", "train.precision=fp16-mixed"], 2, "train.precision", "bf16-mixed"),
        (["distributed.loss_parallel=true"], 4, "distributed.loss_parallel", "tp_size > 1"),
        (
            ["distributed.tp_size=2", "distributed.pp_size=2", "distributed.loss_parallel=true"],
            4,
            "distributed.loss_parallel",
            "pp_size > 1",
        ),
    ],
)
def test_bad_layouts_are_refused_naming_the_field(overrides, world, field, words):
    with pytest.raises(ConfigError) as caught:
        _config(overrides, world)
    assert caught.value.field == field
    assert words in str(caught.value)


def test_a_model_without_a_plan_is_refused_naming_what_to_provide(tmp_path):
    model_file = tmp_path / "mine.py"
    model_file.write_text(
        "import torch\n\n"
        "def build(seq_len: int = 16):\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(64, 8))\n"
    )
    with pytest.raises(ConfigError) as caught:
        _config([f"model.target={model_file}:build", "distributed.tp_size=2"], 2)
    assert caught.value.field == "distributed.tp_size"
    assert "tp_plan" in str(caught.value) and "callable(model, tp_mesh)" in str(caught.value)


def test_hf_models_refuse_what_their_plan_cannot_do():
    pytest.importorskip("transformers")
    llama = ["model.target=hookloop.models.hf:recipe", "model.hidden_size=32", "model.num_attention_heads=4"]
    with pytest.raises(ConfigError) as caught:
        _config([*llama, "model.num_key_value_heads=1", "distributed.tp_size=2"], 2)
    assert caught.value.field == "model.num_key_value_heads"
    with pytest.raises(ConfigError) as caught:
        _config([*llama, "distributed.tp_size=2", "distributed.sequence_parallel=true"], 2)
    assert caught.value.field == "distributed.sequence_parallel"
    with pytest.raises(ConfigError) as caught:
        _config([*llama, "distributed.tp_size=2", "distributed.loss_parallel=true"], 2)
    assert caught.value.field == "distributed.loss_parallel" and "computes its own loss" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        _config(
            ["model.target=hookloop.models.hf:recipe", "model.architecture=gpt2", "distributed.tp_size=2"], 2
        )
    assert caught.value.field == "model.architecture"


def test_apply_tensor_parallel_takes_dicts_and_callables_and_refuses_none():
    from hookloop.engine.tensor_parallel import apply_tensor_parallel

    class OneRank:  # a size-1 mesh: nothing to split, the plan is not run
        def size(self) -> int:
            return 1

    model = torch.nn.Linear(2, 2)
    assert apply_tensor_parallel(model, OneRank(), {"": object()}) is model
    with pytest.raises(ConfigError, match="tp_plan"):
        apply_tensor_parallel(model, OneRank(), None)


# ---------------------------------------------------------------------- the whole run, from a config
@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_trains_tp2_with_every_handler_and_resumes(tmp_path):
    """``torchrun -m hookloop train`` at tp=2 with sequence and loss parallelism: the step scheduler, a NaN
    injected at one step (vetoed, then rolled back to the last checkpoint), validation, health
    checks, metrics with FLOP figures and checkpoints; a second run resumes and has nothing left."""
    import json

    from tests.dist_utils import REPO, run_torchrun

    run_dir = tmp_path / "run"
    args = [
        "train",
        str(REPO / "examples" / "configs" / "gpt_tiny.yaml"),
        f"train.run_dir={run_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.n_layers=2",
        "model.d_model=32",
        "train.seq_len=16",
        "train.local_batch_size=2",
        "step_scheduler.global_batch_size=4",
        "step_scheduler.max_steps=10",
        "step_scheduler.ckpt_every_steps=4",
        "step_scheduler.val_every_steps=5",
        "lr.warmup_steps=2",
        "logging.log_interval=1",
        "nan.max_consecutive=1",
        "fault_injection.enabled=true",
        "fault_injection.kind=nan",
        "fault_injection.microbatches=[12]",  # step 7's first microbatch (two per step)
        "health.enabled=true",
        "health.every_steps=3",
        "metrics.peak_flops_per_device=1e12",
        "distributed.tp_size=2",
        "distributed.sequence_parallel=true",
        "distributed.loss_parallel=true",
    ]
    proc = run_torchrun("hookloop", 2, args, module=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world size 2 (dp 1 x tp 2 x pp 1)" in proc.stderr
    assert proc.stdout.count("done: step 10, loss ") == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    assert steps and all(r["mfu"] > 0 for r in steps)
    # every token counted once: 4 samples x 16 tokens per step, not once per tensor-parallel rank
    last = max(steps, key=lambda r: r["step"])
    assert last["tokens_seen"] == 64 * last["step"]
    assert any("val_loss" in r for r in rows)
    assert "rolled back to" in proc.stderr
    again = run_torchrun("hookloop", 2, args, module=True, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "done: step 10, no step left to train" in again.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_of_pp2_tp2_resumes_at_pp2_without_tp(tmp_path):
    """Pipeline checkpoints name parameters by stage, so they move between pipeline layouts: saved
    at pp=2 x tp=2, resumed at pp=2 alone with each stage's state equal bit for bit, and at tp=2
    without stages (loaded by name) with the whole model's state equal."""
    import shutil

    merged = _merged

    saved = run_distributed(_ckpt_worker, 4, 2, "ddp", str(tmp_path / "saved"), SAVE_AT, 2)
    assert [r["step"] for r in saved] == [SAVE_AT] * 4
    shutil.copytree(tmp_path / "saved", tmp_path / "pp2")
    resumed = run_distributed(_ckpt_worker, 2, 1, "ddp", str(tmp_path / "pp2"), SAVE_AT + 1, 2)
    assert [(r["start"], r["step"]) for r in resumed] == [(SAVE_AT, SAVE_AT + 1)] * 2
    reference = merged(saved)
    assert any("qkv_heads.weight" in k for k in reference) and any(k.endswith("exp_avg") for k in reference)
    assert _same_state(merged(resumed), reference) == []
    shutil.copytree(tmp_path / "saved", tmp_path / "tp2")
    whole = run_distributed(_ckpt_worker, 2, 2, "ddp", str(tmp_path / "tp2"), SAVE_AT + 1)
    assert [(r["start"], r["step"]) for r in whole] == [(SAVE_AT, SAVE_AT + 1)] * 2
    assert "model.blocks.0.qkv_heads.weight" in whole[0]["state"]
    assert _same_state(whole[0]["state"], _without_stages(reference)) == []


# ---------------------------------------------------------------------- the step's agreement
def _budget_worker(rank: int, world: int) -> dict:
    from benchmarks.tensor_parallel import ACCUM, collectives_per_step
    from hookloop.engine import init_distributed
    from hookloop.engine.tensor_parallel import apply_tensor_parallel
    from hookloop.models.gpt import tp_plan
    from tests.conftest import tiny_gpt, token_batches

    info = init_distributed("gloo", tp_size=world)
    model = tiny_gpt(**GPT_ARGS)
    apply_tensor_parallel(model, info.mesh_dim("tp"), tp_plan, sequence_parallel=True)
    per_step, sites = collectives_per_step(model, token_batches(8 * ACCUM, batch=MB), clip=CLIP)
    return {"per_step": per_step, "sites": sites}


@pytest.mark.distributed
def test_tp_step_keeps_one_small_collective_over_the_world():
    """At tp=2 with sequence parallelism, the step's control values still travel in one
    ``torch.distributed`` all-reduce per step (the agreement); the layers' own communication is
    DTensor's (functional collectives on the tp group), the gradient norm's too."""
    for result in run_distributed(_budget_worker, 2):
        assert result["per_step"] == [1] * 7, result
        assert any("all_reduce at engine/agreement.py" in site for site in result["sites"]), result


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_llama_pp2_tp2_matches_one_process(tmp_path):
    """The Hugging Face Llama recipe at pp=2 x tp=2 under torchrun (stages cut, then parallelized
    with the Llama plan) logs the same training losses and gradient norms as one process."""
    pytest.importorskip("transformers")
    import json
    import sys

    from tests.dist_utils import REPO, run_process, run_torchrun

    def args(run: str) -> list[str]:
        return [
            "train",
            str(REPO / "examples" / "configs" / "hf_tiny.yaml"),
            f"train.run_dir={tmp_path / run}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "train.seq_len=16",
            "train.local_batch_size=2",
            "step_scheduler.global_batch_size=4",
            "step_scheduler.max_steps=4",
            "step_scheduler.ckpt_every_steps=null",
            "step_scheduler.val_every_steps=null",
            "lr.warmup_steps=1",
            "logging.log_interval=1",
        ]

    def logged(run: str) -> list[tuple[float, float]]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "grad_norm" in r]
        # every sample's tokens once, per dataset too (the last stage's two TP ranks both see the
        # outputs): 4 samples x 15 predicted tokens per step
        assert [r["tokens/docs"] for r in steps] == [4 * 15] * len(steps), run
        return [(r["loss"], r["grad_norm"]) for r in steps]

    one = run_process([sys.executable, "-m", "hookloop", *args("one")], cwd=tmp_path, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    layout = ["distributed.pp_size=2", "distributed.tp_size=2", "pipeline.pp_schedule=1f1b"]
    four = run_torchrun("hookloop", 4, [*args("pp_tp"), *layout], module=True, cwd=tmp_path)
    assert four.returncode == 0, four.stderr[-3000:]
    assert "world size 4 (dp 1 x tp 2 x pp 2)" in four.stderr
    expected, got = logged("one"), logged("pp_tp")
    assert len(expected) == 4
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in expected], rel=REL)
    assert [norm for _, norm in got] == pytest.approx([norm for _, norm in expected], rel=REL)
