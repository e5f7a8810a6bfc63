"""Hugging Face models, first-class: dict microbatches as keyword arguments, the model's own loss
(``Trainer(loss_fn=None)``), token counts, the errors that name the convention, pipeline stages of
a ``transformers`` causal LM, and ``examples/train_hf.py`` on 1 process, DDP, FSDP2 and 2 pipeline
stages (losses equal to 1 process) with a checkpoint resume."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="Hugging Face tests need transformers: pip install -e '.[hf]'")

from hookloop.engine import ConfigError, Events, PipelineConfig, Trainer  # noqa: E402
from hookloop.engine.batch import count_batch, default_prepare_batch  # noqa: E402
from hookloop.engine.pipeline import default_module_fqns, split_stage_module  # noqa: E402
from hookloop.engine.pipeline.hf_patches import (  # noqa: E402
    causal_lm_loss,
    check_hf_pipeline,
    layers_as_module_dict,
    patch_stage_module,
)
from hookloop.engine.pipeline.split import find_layer_container  # noqa: E402
from tests.dist_utils import REPO, run_process, run_torchrun  # noqa: E402

SCRIPT = REPO / "examples" / "train_hf.py"


def tiny_llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def trainer_for(model: nn.Module, loss_fn=None, lr: float = 0.0, **kwargs) -> Trainer:
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), loss_fn, hang_timeout_s=None, **kwargs)


class KwargsModel(nn.Module):
    """Records the keyword arguments it is called with; returns logits from input_ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.head = nn.Linear(8, 256)
        self.calls: list[dict] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask})
        return self.head(self.emb(input_ids))


def flat_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------- the batch convention
def test_dict_microbatch_goes_to_the_model_as_keyword_arguments():
    model = KwargsModel()
    x, mask = ids(), torch.ones(2, 16, dtype=torch.long)
    seen: list = []
    trainer = trainer_for(model, flat_ce)
    trainer.on(Events.MICROBATCH)(lambda: seen.append(trainer.state.microbatch_targets))
    batch = {"input_ids": x, "attention_mask": mask, "labels": x.roll(1), "source_idx": torch.zeros(2)}
    trainer.run([batch], max_epochs=1)
    (call,) = model.calls
    assert torch.equal(call["input_ids"], x) and torch.equal(call["attention_mask"], mask)
    assert torch.equal(seen[0], x.roll(1))  # labels are loss_fn's targets, never a model argument
    with torch.no_grad():
        expected = flat_ce(model.head(model.emb(x)), x.roll(1))
    assert trainer.state.loss == pytest.approx(float(expected), rel=1e-6)


def test_tuple_batches_still_call_the_model_positionally():
    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
    trainer = trainer_for(model, flat_ce)
    trainer.run([(ids(), ids(seed=2))], max_epochs=1)
    assert trainer.state.tokens_seen == 32 and trainer.state.samples_seen == 2


def test_loss_fn_none_trains_on_the_models_own_loss():
    model = tiny_llama()
    x = ids()
    with torch.no_grad():
        expected = float(model(input_ids=x, labels=x).loss)
    trainer = trainer_for(model)  # lr 0: the step's loss is the untouched model's
    trainer.run([{"input_ids": x, "labels": x}], max_epochs=1)
    assert trainer.state.loss == pytest.approx(expected, rel=1e-6)
    # ... and it trains: a few steps with a real learning rate lower it
    model = tiny_llama()
    trainer = trainer_for(model, lr=0.1)
    losses: list[float] = []
    trainer.on(Events.STEP_END)(lambda: losses.append(trainer.state.loss))
    trainer.run([{"input_ids": x, "labels": x}] * 8, max_epochs=1)
    assert losses[-1] < losses[0] - 0.5, losses


def test_model_loss_read_from_a_mapping_output_and_in_validation():
    class DictLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(2.0))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
            return {"loss": self.w * (input_ids - labels).float().abs().mean()}

    x = ids()
    trainer = trainer_for(DictLoss())
    trainer.set_validation([{"input_ids": x, "labels": x + 1}])
    trainer.run([{"input_ids": x, "labels": x + 2}], max_epochs=1)
    assert trainer.state.loss == pytest.approx(4.0)
    assert trainer.validate() == pytest.approx(2.0)


def test_token_counts_from_input_ids_or_attention_mask():
    x = ids(batch=3, seq=8)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 2:] = 0
    samples, tokens = count_batch({"input_ids": x})
    assert (samples, tokens) == (3, 24)
    samples, tokens = count_batch({"input_ids": x, "attention_mask": mask})
    assert samples == 3 and isinstance(tokens, torch.Tensor) and tokens.dim() == 0 and int(tokens) == 15
    trainer = trainer_for(tiny_llama())
    trainer.run(
        [{"input_ids": x, "attention_mask": mask, "labels": x}, {"input_ids": x, "labels": x}],
        max_epochs=1,
    )
    assert trainer.state.tokens_seen == 15 + 24 and trainer.state.samples_seen == 6


# ---------------------------------------------------------------------- errors that name the convention
def test_loss_fn_none_without_labels_names_the_hf_convention():
    trainer = trainer_for(tiny_llama())
    with pytest.raises(ValueError, match=r"put 'labels' in every dict microbatch.*unshifted"):
        trainer.run([{"input_ids": ids()}], max_epochs=1)


def test_loss_fn_with_a_dict_batch_lacking_labels():
    trainer = trainer_for(KwargsModel(), flat_ce)
    with pytest.raises(ValueError, match=r"no 'labels'.*Trainer\(loss_fn=None\)"):
        trainer.run([{"input_ids": ids()}], max_epochs=1)


def test_tuple_batch_with_loss_fn_none():
    trainer = trainer_for(tiny_llama())
    with pytest.raises(TypeError, match=r"loss_fn=None.*dict microbatch.*pass a loss_fn"):
        trainer.run([(ids(), ids())], max_epochs=1)


def test_model_without_a_loss_output():
    trainer = trainer_for(KwargsModel())  # returns plain logits: no loss to take
    with pytest.raises(ValueError, match=r"returned Tensor without one.*pass a loss_fn"):
        trainer.run([{"input_ids": ids()}], max_epochs=1)


def test_dict_batch_without_input_ids():
    with pytest.raises(TypeError, match=r"needs 'input_ids'.*Hugging Face convention"):
        default_prepare_batch({"tokens": ids(), "labels": ids()}, torch.device("cpu"))


def test_non_callable_loss_fn_is_refused_at_construction():
    with pytest.raises(TypeError, match="loss_fn must be callable.*or None"):
        trainer_for(KwargsModel(), loss_fn="cross_entropy")


def test_loss_fn_none_under_a_pipeline_without_a_stage_loss():
    from hookloop.engine.pipeline import PipelineRuntime

    model = KwargsModel()
    runtime = PipelineRuntime.__new__(PipelineRuntime)  # no stages: refused before it would need them
    runtime.module, runtime.n_microbatches, runtime.loss_fn = model, 1, None
    with pytest.raises(ConfigError, match=r"loss_fn: is None but pipeline stages.*patch_causal_lm_model"):
        trainer_for(model, step_body=runtime)


# ---------------------------------------------------------------------- pipeline stages of an HF model
def test_default_split_of_a_causal_lm():
    model = tiny_llama(layers=4)
    assert find_layer_container(model) == "model.layers"
    fqns = default_module_fqns(model, 2)
    assert fqns == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.layers.3", "model.norm", "model.rotary_emb", "lm_head"],
    ]


def test_patched_stages_chain_to_the_full_models_logits_and_loss():
    model = tiny_llama(layers=3).eval()
    fqns = default_module_fqns(model, 2)
    container = find_layer_container(model)
    stages = []
    for s in range(2):
        part = split_stage_module(model, fqns, s, lambda m: layers_as_module_dict(m, container))
        patch_stage_module(part, patch_inner=True, patch_causal_lm=True)
        stages.append(part.eval())
    # The first stage has no head, the last no embedding; both keep the rotary embedding.
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is None
    assert stages[1].model.rotary_emb is not None
    assert sorted(stages[0].model.layers) == ["0", "1"] and sorted(stages[1].model.layers) == ["2"]
    names = {n for st in stages for n, _ in st.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # names kept, every parameter once
    x = ids()
    with torch.no_grad():
        hidden = stages[0](x)
        logits = stages[1](hidden)
        reference = model(input_ids=x, labels=x)
    assert hidden.shape == (2, 16, 32)
    torch.testing.assert_close(logits, reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal_lm_loss(logits, x), reference.loss, rtol=1e-6, atol=1e-6)
    labels = x.clone()
    labels[:, :4] = -100  # ignored positions count as in the model's own loss
    with torch.no_grad():
        torch.testing.assert_close(
            causal_lm_loss(logits, labels), model(input_ids=x, labels=labels).loss, rtol=1e-5, atol=1e-6
        )


def test_tied_embeddings_across_stages_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them by default
    fqns = default_module_fqns(model, 2)
    with pytest.raises(ConfigError, match=r"tied weights.*tie_word_embeddings=False"):
        split_stage_module(model, fqns, 0)


def test_hf_pipeline_checks_name_the_patch_fields():
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"pipeline\.patch_causal_lm_model.*CausalLMOutput"):
        check_hf_pipeline(model, PipelineConfig(patch_causal_lm_model=False))
    with pytest.raises(ConfigError, match=r"pipeline\.patch_inner_model"):
        check_hf_pipeline(model, PipelineConfig(patch_inner_model=False))
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False)
    gpt2 = GPT2LMHeadModel(config)
    with pytest.raises(ConfigError, match=r"pipeline\.patch_inner_model.*Llama"):
        check_hf_pipeline(gpt2, PipelineConfig())
    for field in ("patch_inner_model", "patch_causal_lm_model", "patch_stage_backward_maybe_with_nosync"):
        with pytest.raises(ConfigError, match=rf"pipeline\.{field}"):
            PipelineConfig(**{field: "yes"}).validate()


def _nosync_worker(rank: int, world: int) -> dict:
    """dp 2 x pp 2, FSDP2 stages with patch_stage_backward_maybe_with_nosync: one step of two
    microbatches per replica; returns the loss, every gradient, and the gradient-sync switches."""
    from hookloop.engine import init_distributed
    from hookloop.engine.pipeline import build_pipeline
    from tests.dist_utils import to_numpy

    info = init_distributed(mesh_shape=(2, 2), mesh_dim_names=("dp", "pp"))
    cfg = PipelineConfig(pp_microbatch_size=2, pp_batch_size=4, patch_stage_backward_maybe_with_nosync=True)
    runtime = build_pipeline(tiny_llama(), cfg, info, dp_mode="fsdp")
    (stage,) = runtime.stages
    syncs: list[bool] = []  # every gradient-sync switch, in order: one per backward, then the schedule's
    set_sync = stage.submod.set_requires_gradient_sync

    def spy(requires_gradient_sync: bool, **kwargs) -> None:
        syncs.append(requires_gradient_sync)
        set_sync(requires_gradient_sync, **kwargs)

    stage.submod.set_requires_gradient_sync = spy
    trainer = Trainer(
        runtime.module,
        torch.optim.SGD(runtime.parameters(), lr=0.0),
        None,
        step_body=runtime,
        hang_timeout_s=None,
    )
    grads: dict = {}

    @trainer.on(Events.BEFORE_OPTIMIZER_STEP)
    def keep_grads():
        for name, p in runtime.module.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.split(".", 1)[1]] = g.detach().clone()

    dp = runtime.dp_rank
    batches = [{"input_ids": ids(seed=10 * dp + i), "labels": ids(seed=10 * dp + i)} for i in range(2)]
    trainer.run(batches, max_epochs=1)
    return {"loss": trainer.state.loss, "grads": to_numpy(grads), "syncs": syncs}


@pytest.mark.distributed
@pytest.mark.slow
def test_stage_backward_nosync_patch_syncs_on_the_last_microbatch_only():
    from tests.dist_utils import from_numpy, run_distributed

    per_rank = run_distributed(_nosync_worker, 4)
    model = tiny_llama()
    microbatches = [ids(seed=10 * d + i) for d in range(2) for i in range(2)]
    losses = []
    for x in microbatches:
        loss = model(input_ids=x, labels=x).loss
        (loss / len(microbatches)).backward()
        losses.append(float(loss.detach()))
    reference = {n: p.grad for n, p in model.named_parameters()}
    covered: set[str] = set()
    for rank, result in enumerate(per_rank):
        # The first microbatch's backward runs without the sync, the last one with it (torch's own
        # backward keeps it off for both and reduces after the schedule: False, False, True).
        assert result["syncs"][:2] == [False, True], (rank, result["syncs"])
        assert result["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
        for name, grad in from_numpy(result["grads"]).items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6)
            covered.add(name)
    assert covered == set(reference)


# ---------------------------------------------------------------------- examples/train_hf.py
def common(run) -> list[str]:
    return [
        f"train.run_dir={run / 'run'}",
        f"data.cache_dir={run.parent / 'data'}",
        "train.seq_len=32",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "logging.log_interval=5",
        "lr.warmup_steps=2",
        "lr.decay_steps=10",
        "train.deterministic=true",
    ]


def read_metrics(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def single(run, steps: int) -> None:
    proc = run_process(
        [sys.executable, str(SCRIPT), *common(run), f"step_scheduler.max_steps={steps}"], timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"done: step {steps}" in proc.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_train_hf_single_ddp_fsdp_and_pipeline_agree_and_resume(tmp_path):
    single(tmp_path / "single", 10)
    reference = read_metrics(tmp_path / "single")
    assert [r["step"] for r in reference] == [5, 10]
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert "loss/docs" in reference[-1]  # per-dataset metrics scored the model's own (shifted) loss
    assert reference[-1]["loss/docs"] == pytest.approx(reference[-1]["loss"], rel=0.05)
    assert (tmp_path / "single" / "run" / "checkpoints" / "step_00000010").is_dir()

    # Stop after 5 steps, then resume from that checkpoint to 10: the same losses as straight through.
    single(tmp_path / "resumed", 5)
    single(tmp_path / "resumed", 10)
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [5, 10]
    for a, b in zip(reference, resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)

    runs = {
        "ddp": ["distributed.dp_mode=ddp"],
        "fsdp": ["distributed.dp_mode=fsdp"],
        "pipeline": ["distributed.pp_size=2", "pipeline.pp_schedule=1f1b"],
    }
    for name, extra in runs.items():
        run = tmp_path / name
        proc = run_torchrun(SCRIPT, 2, [*common(run), "step_scheduler.max_steps=10", *extra])
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == [5, 10], name
        for a, b in zip(reference, rows):
            # Same model, same data (one global stream split between ranks), same losses.
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["loss"], b["loss"])
            assert b["tokens_seen"] == a["tokens_seen"], name


def test_train_hf_config_errors_name_the_field(tmp_path):
    proc = run_process([sys.executable, str(SCRIPT), *common(tmp_path), "model.hidden_sise=32"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.hidden_sise" in proc.stderr and "LlamaConfig" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_importing_engine_does_not_import_transformers():
    code = (
        "import sys, engine, engine.batch, engine.pipeline, engine.pipeline.hf_patches, handlers\n"
        "print('transformers' in sys.modules)"
    )
    proc = run_process([sys.executable, "-c", code], timeout=120, fresh=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
