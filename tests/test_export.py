"""``hookloop export`` and ``load_model``: a run trained at tp=2 (the example GPT) and one trained
at pp=2 (the Hugging Face Llama recipe) under torchrun, exported, then loaded in this one plain
process: the weights the ranks trained, the logits of the model as it trained, and a damaged
checkpoint refused in one line."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.dist_utils import REPO, run_process, run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DUMP = REPO / "tests" / "scripts" / "export_dump.py"
COMMON = {
    "train": {"seq_len": 16, "local_batch_size": 2, "seed": 0},
    "step_scheduler": {
        "global_batch_size": 4,
        "max_steps": 3,
        "ckpt_every_steps": 3,
        "val_every_steps": None,
    },
    "lr": {"warmup_steps": 1},
    "logging": {"log_interval": 1},
}
LAYOUTS = {
    "tp2": (
        {"target": "hookloop.models.gpt:recipe", "n_layers": 2, "d_model": 32, "n_heads": 2},
        {"tp_size": 2},
    ),
    "pp2": (
        {
            "target": "hookloop.models.hf:recipe",
            "architecture": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        {"pp_size": 2},
    ),
}


def _train(tmp_path, layout: str):
    """Train ``layout`` for 3 steps under torchrun; returns the run directory."""
    model, distributed = LAYOUTS[layout]
    run_dir = tmp_path / layout
    config = {
        **COMMON,
        "model": model,
        "distributed": distributed,
        "train": {**COMMON["train"], "run_dir": str(run_dir)},
        "data": {"datasets": {"docs": "stdlib_docs"}, "cache_dir": str(tmp_path / "cache")},
        "handlers": [{"target": f"{DUMP}:DumpTrained", "pipeline": layout == "pp2"}],
    }
    path = tmp_path / f"{layout}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_torchrun("hookloop", 2, ["train", str(path)], module=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def _export(run_dir, out, *more: str):
    return run_process(
        [sys.executable, "-m", "hookloop", "export", str(run_dir), "--out", str(out), *more],
        cwd=run_dir.parent,
        timeout=120,
    )


def _trained(run_dir) -> dict:
    """What the ranks trained: their weights merged, and the logits rank 0 computed (if any)."""
    weights, logits = {}, None
    for rank in (0, 1):
        dumped = torch.load(run_dir / f"trained_rank{rank}.pt", weights_only=True)
        weights.update(dumped["weights"])
        logits = dumped.get("logits") if logits is None else logits
    return {"weights": weights, "logits": logits}


def test_tp2_run_exports_the_weights_and_logits_it_trained(tmp_path):
    from safetensors.torch import load_file

    from hookloop.train import load_model
    from tests.scripts.export_dump import batch

    run_dir = _train(tmp_path, "tp2")
    proc = _export(run_dir, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-4000:]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert (tmp_path / "out" / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()
    trained = _trained(run_dir)
    assert sorted(exported) == sorted(trained["weights"])
    assert all(torch.equal(exported[k], trained["weights"][k]) for k in exported)
    model = load_model(run_dir)  # built from config.yaml in this plain process
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.data.zero_()
    plain.load_state_dict(exported)  # strict: the plain model's names, whole tensors
    model.eval(), plain.eval()
    with torch.no_grad():
        got, loaded = plain(batch()), model(batch())
    assert torch.equal(got, loaded)
    assert trained["logits"] is not None
    torch.testing.assert_close(got, trained["logits"], rtol=1e-5, atol=1e-5)  # the tp=2 forward's


def test_pp2_hf_run_exports_a_save_pretrained_folder_and_damage_is_refused(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from hookloop.engine.checkpoint_format.directory import complete_checkpoints
    from hookloop.export import main
    from hookloop.train import load_model
    from tests.scripts.export_dump import batch

    run_dir = _train(tmp_path, "pp2")
    proc = _export(run_dir, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-4000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = _trained(run_dir)
    state = hf.state_dict()
    assert sorted(trained["weights"]) == sorted(state)  # the stages' names mapped back to the model's
    assert all(torch.equal(state[k], trained["weights"][k]) for k in state)
    model = load_model(run_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(batch()).logits, model(batch()).logits, rtol=0, atol=0)

    capsys.readouterr()
    assert main([str(run_dir), "--best", "--out", str(tmp_path / "best")]) == 2
    assert main([str(run_dir), "--step", "2", "--out", str(tmp_path / "step2")]) == 2
    refusals = capsys.readouterr().err.splitlines()
    assert "checkpoint.keep_best is 0" in refusals[0] and "(complete steps: 3, 0)" in refusals[1]
    assert not (tmp_path / "best").exists() and not (tmp_path / "step2").exists()

    newest = complete_checkpoints(run_dir / "checkpoints")[0][0][1]
    damaged = sorted(p for p in Path(newest).iterdir() if p.suffix == ".distcp")[-1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    refused = _export(run_dir, tmp_path / "again")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and damaged.name in lines[0], refused.stderr
    assert not (tmp_path / "again" / "model.safetensors").exists()
    assert (
        _export(run_dir, tmp_path / "ema", "--ema")
        .stderr.strip()
        .endswith(f"this run has no EMA weights ({run_dir})")
    )
