"""``hookloop check`` ok means step 1 trains: what would fail at the first step (a pipeline stage
without a layer, an argument of the wrong type or refused by the model's own construction, token
ids beyond the model's vocabulary, samples the model cannot take) is one ``config error`` line,
before any process group exists, and the check creates nothing.

Checks run in this process (``hookloop.cli.main``); one real ``torchrun`` run shows that ``hookloop
train`` refuses the same before any process group exists.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import hookloop.first_step as first_step
from hookloop.cli import main as hookloop_main
from hookloop.train import check, load_training_config
from tests.dist_utils import run_torchrun

GPT = """
model:
  target: hookloop.models.gpt:recipe
  n_layers: 2
  d_model: 32
  n_heads: 2
"""
HF = """
model:
  target: hookloop.models.hf:recipe
  hidden_size: 32
  intermediate_size: 64
  num_hidden_layers: 2
  num_attention_heads: 2
  num_key_value_heads: 2
"""
REST = """
train:
  seq_len: 16
  local_batch_size: 4
step_scheduler:
  global_batch_size: 8
  max_steps: 4
  ckpt_every_steps: 2
  val_every_steps: 2
lr:
  warmup_steps: 0
data:
  cache_dir: data
"""

# Samples of a factory of the project's own: windows of ``width`` ids, the largest one ``top``.
MY_DATA = """
import torch

class Ids(torch.utils.data.Dataset):
    def __init__(self, width, top, ragged):
        self.width, self.top, self.ragged = width, top, ragged

    def __len__(self):
        return 64

    def __getitem__(self, i):
        n = self.width + (i % 2 if self.ragged else 0)
        ids = torch.arange(n) % (self.top + 1)
        ids[0] = self.top
        return ids, ids

def build(width: int = 16, top: int = 255, ragged: bool = False, fail: bool = False):
    if fail:
        raise OSError("the corpus server is down")
    return {"ids": Ids(width, top, ragged)}
"""

# A factory refusing its arguments with an assertion, and one the meta device cannot build.
MY_MODELS = """
import torch

def asserting(dim: int = 16):
    assert dim % 8 == 0, f"dim must be a multiple of 8, got {dim}"
    return torch.nn.Sequential(torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256))

def needs_real_tensors(dim: int = 16):
    model = torch.nn.Sequential(torch.nn.Embedding(256, dim), torch.nn.Linear(dim, 256))
    if float(model[1].weight.abs().sum()) < 0:  # reads a value: impossible on the meta device
        raise RuntimeError("unreachable")
    return model
"""


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    (tmp_path / "run.yaml").write_text(GPT + REST)
    (tmp_path / "hf.yaml").write_text(HF + REST)
    for name in ("asserting", "needs_real_tensors"):
        (tmp_path / f"{name}.yaml").write_text(f"model:\n  target: my_models.py:{name}\n" + REST)
    (tmp_path / "my_data.py").write_text(MY_DATA)
    (tmp_path / "my_models.py").write_text(MY_MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(capsys, *args: str, config: str = "run.yaml") -> str:
    """The one line ``hookloop check CONFIG ARGS`` says (it must exit 2 and create nothing)."""
    before = sorted(p.name for p in Path.cwd().iterdir())
    code = hookloop_main(["check", config, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("config error: "), err
    assert sorted(p.name for p in Path.cwd().iterdir()) == before  # no runs/, no data/
    return err[0].removeprefix("config error: ")


def ok(capsys, *args: str, config: str = "run.yaml") -> str:
    before = sorted(p.name for p in Path.cwd().iterdir())
    code = hookloop_main(["check", config, *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(p.name for p in Path.cwd().iterdir()) == before
    return out.strip()


# ------------------------------------------------------------------ the pipeline split per rank


def test_every_pipeline_stage_must_hold_a_layer(project, capsys):
    pp = ["--nproc", "2", "distributed.pp_size=2"]
    line = refused(capsys, *pp, "model.n_layers=1")
    assert line.startswith(
        "distributed.pp_size: 1 layer(s) in blocks cannot give each of 2 pipeline stages one"
    )
    assert "stage 1 would be empty of layers" in line and "model.n_layers >= 2" in line
    # Two stages per rank (interleaved) need twice the layers: 3 layers cannot fill 4 stages.
    interleaved = [*pp, "pipeline.pp_schedule=interleaved1f1b", "model.n_layers=3"]
    assert refused(capsys, *interleaved).startswith("distributed.pp_size: 3 layer(s) in blocks")
    # Stages the user lists: each must name at least one layer.
    fqns = "pipeline.module_fqns_per_model_part=[[tok_emb,pos_emb],[blocks,norm,head]]"
    line = refused(capsys, *pp, fqns)
    assert line.startswith(
        "pipeline.module_fqns_per_model_part[0]: stage 0 (['tok_emb', 'pos_emb']) holds none"
    )
    # A split that trains: the ok line says how the layers fall on the stages, and that it ran.
    out = ok(capsys, *pp, "model.n_layers=3")
    assert "2 pipeline stages of 2+1 layers; first microbatch int64[4, 16] ran forward and loss on CPU" in out


@pytest.mark.distributed
def test_train_refuses_a_stage_without_a_layer_before_any_process_group(project):
    # Before: rank 1's stage had no block, crashed at step 1, and rank 0 recorded exit 77
    # (a lost peer), which the documented job script requeues forever.
    proc = run_torchrun(
        "hookloop",
        2,
        ["train", "run.yaml", "distributed.pp_size=2", "model.n_layers=1"],
        module=True,
        cwd=project,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("config error: distributed.pp_size: 1 layer(s) in blocks") == 1, proc.stderr[
        -3000:
    ]
    assert not (project / "runs").exists()


# ------------------------------------------------------------------ model arguments and construction


def test_model_arguments_are_checked_against_annotations_and_the_models_construction(project, capsys):
    plain = "model.target=hookloop.models.gpt:build"
    assert refused(capsys, plain, "model.d_model=abc") == (
        "model.d_model: got 'abc' (str), but hookloop.models.gpt:build takes d_model: int"
    )
    assert refused(capsys, plain, "model.d_model=32.0").startswith("model.d_model: got 32.0 (float)")
    # The construction's own refusal (a ValueError naming the argument), from a plain factory.
    assert refused(capsys, plain, "model.d_model=-3") == "model.d_model: must be a positive integer, got -3"
    assert (
        refused(capsys, plain, "model.n_heads=3")
        == "model.d_model: (32) must be a multiple of model.n_heads (3)"
    )
    # An assertion in a project's factory names the argument its message names.
    line = refused(capsys, "model.dim=12", config="asserting.yaml")
    assert line == "model.dim: dim must be a multiple of 8, got 12"
    # A factory the meta device cannot build is built for real, and trains.
    assert "ran forward and loss on CPU" in ok(capsys, config="needs_real_tensors.yaml")


def test_a_hugging_face_models_refusals_are_one_line(project, capsys):
    pytest.importorskip("transformers")
    line = refused(capsys, "model.hidden_size=abc", config="hf.yaml")
    assert line.startswith("model.hidden_size: Field 'hidden_size' expected int, got str")
    line = refused(capsys, "model.hidden_size=-3", config="hf.yaml")
    assert line.startswith("model: The hidden size (-3) is not a multiple of the number of attention heads")
    assert "{input_ids: int64[4, 16]} ran forward and loss on CPU" in ok(capsys, config="hf.yaml")


# ------------------------------------------------------------------ the vocabulary


def write_tokens(path: Path, ids: np.ndarray, **sidecar) -> None:
    ids.astype(np.uint16).tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint16", **sidecar}))


def test_the_vocabulary_is_read_from_the_data_not_only_from_sidecars(project, capsys):
    ids = np.arange(4096) % 200
    # A sidecar without vocab_size: the largest id is read from the file.
    ids[-1] = 300
    write_tokens(project / "unsaid.bin", ids)
    line = refused(capsys, "data.datasets.docs=unsaid.bin")
    assert line.startswith(
        "model.vocab_size: 256 (the factory's default) is smaller than the data's vocabulary"
    )
    assert "has 301 token ids (its largest token id is 300)" in line
    # A sidecar that claims fewer ids than the file holds (only its last token: no microbatch sees it).
    write_tokens(project / "lying.bin", ids, vocab_size=256)
    line = refused(capsys, "data.datasets.docs=lying.bin")
    assert "has 301 token ids (its largest token id is 300, above its sidecar's vocab_size 256)" in line
    assert "ran forward and loss" in ok(capsys, "data.datasets.docs=lying.bin", "model.vocab_size=301")
    # A data.target dataset: its first microbatch's largest id.
    target = ["data.target=my_data.py:build", "data.args.top=300"]
    assert refused(capsys, *target) == (
        "model.vocab_size: the model has 256 token ids but the data's first microbatch holds id 300; "
        "give the model a vocabulary of 301 or more, or data of its vocabulary"
    )


# ------------------------------------------------------------------ the data through the model


def test_the_first_microbatch_goes_through_collate_and_the_model(project, capsys):
    target = "data.target=my_data.py:build"
    assert "first microbatch int64[4, 16] ran forward and loss on CPU" in ok(capsys, target)
    # Samples longer than the model's positions: the forward fails at step 1.
    line = refused(capsys, target, "data.args.width=24")
    assert line.startswith("model: forward and loss on the first microbatch int64[4, 24] fail: IndexError")
    # Samples that do not collate.
    line = refused(capsys, target, "data.args.ragged=true")
    assert line.startswith("data: the first microbatch cannot be made: RuntimeError: stack expects")
    # The factory itself failing.
    assert refused(capsys, target, "data.args.fail=true") == (
        "data.target: my_data.py:build fails: OSError: the corpus server is down"
    )


def test_a_large_model_skips_the_forward_and_says_so(project, capsys, monkeypatch):
    monkeypatch.setattr(first_step, "MAX_PARAMS", 1000)
    out = ok(capsys)
    assert "first microbatch int64[4, 16] collated; forward not tried (" in out
    assert "above the check's bound of 1,000 parameters" in out
    # The model is built on the meta device only: its own refusals are still found.
    assert refused(capsys, "model.n_heads=3").startswith("model.d_model: (32) must be a multiple")


def test_check_leaves_the_random_state_as_it_was(project):
    cfg = load_training_config("run.yaml")
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = random.random(), np.random.rand(), torch.rand(1)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    checked = check(cfg)
    assert checked.first_step is not None and checked.first_step.forward
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert not (project / "runs").exists() and not (project / "data").exists()
