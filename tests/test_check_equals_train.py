"""``hookloop check`` refuses what ``hookloop train`` refuses: for each of a table of realistic
mistakes (model, data, handler, metric, layout, tokenizer, resume) in a small project, both
commands exit 2 with the same one ``config error`` line and no traceback, and neither trains.

Each command is a real ``python -m hookloop`` process (a fork of the suite's server, which has
imported torch once: ``tests/forked.py``) with a hard timeout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.dist_utils import run_process

MY_MODELS = """
import torch

from hookloop.recipe import ModelRecipe


class TinyLM(torch.nn.Module):
    def __init__(self, dim, vocab_size):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.head = torch.nn.Linear(dim, vocab_size)

    def forward(self, tokens):
        return self.head(torch.relu(self.embed(tokens)))


def build(dim: int = 8, vocab_size: int = 256):
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    return TinyLM(dim, vocab_size)


def features(dim: int = 8):  # wants float features: token ids fail in its forward
    return torch.nn.Linear(dim, 256)


def regressor(dim: int = 8):
    return torch.nn.Sequential(torch.nn.Linear(4, dim), torch.nn.ReLU(), torch.nn.Linear(dim, 1))


def _squeeze_mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


regression = ModelRecipe(build=regressor, loss_fn=_squeeze_mse)
wrong_loss = ModelRecipe(build=build, loss_fn=lambda output, target: output.sum(dim=-1))
"""

MY_DATA = """
import torch


class Ids(torch.utils.data.Dataset):
    def __init__(self, seq_len, n, top, ragged):
        self.seq_len, self.n, self.top, self.ragged = seq_len, n, top, ragged

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        width = self.seq_len + (i if self.ragged else 0)
        ids = (torch.arange(width + 1) + i) % (self.top + 1)
        ids[0] = self.top
        return ids[:-1], ids[1:]


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((4,), float(i))
        return {"x": x, "y": x.sum(0, keepdim=True)}


def build(seq_len: int, n: int = 64, top: int = 255, ragged: bool = False, fail: bool = False):
    if fail:
        raise OSError("the corpus server is down")
    return {"ids": Ids(seq_len, n, top, ragged)}


def pairs():
    return {"pairs": Pairs()}
"""

MY_HOOKS = """
import dataclasses

from ignite.metrics import Metric

from hookloop import ConfigError, Handler


class Counter(Handler):
    def __init__(self, every: int = 1):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every, self.seen = every, 0

    def on_step_end(self, trainer):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class Shared(Counter):
    state_key = "Counter"


class Tokenizing(Handler):
    def attach(self, trainer):
        raise ValueError("Tokenizing needs data.tokenizer: none is set")


class Patience(Handler):
    @dataclasses.dataclass
    class Config:
        patience: int = 3

        def validate(self, prefix):
            if self.patience < 1:
                raise ConfigError(f"{prefix}.patience", f"must be at least 1, got {self.patience}")

    def __init__(self, patience):
        self.patience = patience


def not_a_handler():
    return 42


class Wrong(Metric):
    def reset(self):
        self.total = 0.0

    def update(self, output):
        logits, targets = output
        if logits.dim() != 2:
            raise ValueError(f"Wrong expects logits [batch, classes], got {tuple(logits.shape)}")
        self.total += float(logits.sum())

    def compute(self):
        return self.total
"""

BASE = """
model:
  target: my_models.py:build
  dim: 8
train:
  seq_len: 8
  local_batch_size: 2
step_scheduler:
  global_batch_size: 2
  max_steps: 2
  ckpt_every_steps: null
  val_every_steps: 1
lr:
  warmup_steps: 0
data:
  target: my_data.py:build
  val_samples: 4
logging:
  log_interval: 1
"""

PAIRS = "data.target=my_data.py:pairs"
TOKENS = "data.target=null"  # the token files of data.datasets
METRIC = "validation.metrics"
REGRESSION = "model.target=my_models.py:regression"


def hooks(*entries: str) -> str:
    """``handlers=[...]``: entries of my_hooks.py (``"Counter, every: 2"``)."""
    return "handlers=[" + ", ".join(f"{{target: my_hooks.py:{entry}}}" for entry in entries) + "]"


# id, overrides, the field the one line names
MISTAKES = [
    # the model
    ("model argument of the wrong type", ["model.dim=wide"], "model.dim"),
    ("unknown model argument", ["model.width=8"], "model.width"),
    ("model file missing", ["model.target=models.py:build"], "model.target"),
    ("model attribute misspelt", ["model.target=my_models.py:biuld"], "model.target"),
    ("model refuses its arguments", ["model.dim=7"], "model.dim"),
    ("model forward fails on the batch", ["model.target=my_models.py:features"], "model"),
    ("loss of the wrong shape", ["model.target=my_models.py:wrong_loss"], "model"),
    ("vocabulary smaller than the data", ["model.vocab_size=100"], "model.vocab_size"),
    # the data
    ("data factory fails", ["data.args.fail=true"], "data.target"),
    ("unknown data argument", ["data.args.size=3"], "data.args.size"),
    ("dict samples with keys of their own", [PAIRS, REGRESSION], "data.inputs"),
    (
        "data.inputs names a missing key",
        [PAIRS, REGRESSION, "data.inputs=features", "data.targets=y"],
        "data.inputs",
    ),
    ("ragged samples do not collate", ["data.args.ragged=true"], "data"),
    ("validation holds out every sample", ["data.args.n=1"], "data.val_fraction"),
    ("weight of an unknown dataset", ["data.weights.books=2"], "data.weights"),
    # the tokenizer's token files
    ("token file missing", [TOKENS, "data.datasets.docs=missing.bin"], "data.datasets.docs"),
    ("token file of a larger vocabulary", [TOKENS, "data.datasets.docs=wide.bin"], "model.vocab_size"),
    ("token file shorter than a sample", [TOKENS, "data.datasets.docs=short.bin"], "train.seq_len"),
    # handlers
    ("handler target misspelt", [hooks("Countr")], "handlers[0].target"),
    ("unknown handler argument", [hooks("Counter, evry: 2")], "handlers[0].evry"),
    ("handler refuses its argument", [hooks("Counter, every: 0")], "handlers[0]"),
    ("handler section refuses a value", [hooks("Patience, patience: 0")], "handlers[0].patience"),
    ("handler's attach raises", [hooks("Tokenizing")], "handlers[0]"),
    ("factory returns no handler", [hooks("not_a_handler")], "handlers[0].target"),
    ("two handlers claim one state key", [hooks("Counter", "Shared")], "handlers[1]"),
    # validation metrics
    ("metric target misspelt", [f"{METRIC}.acc=ignite.metrics:Acuracy"], f"{METRIC}.acc.target"),
    ("metric named loss", [f"{METRIC}.loss=ignite.metrics:Accuracy"], f"{METRIC}.loss"),
    ("metric refuses the model's output", [f"{METRIC}.wrong=my_hooks.py:Wrong"], f"{METRIC}.wrong"),
    # the layout
    ("tensor parallel without a plan", ["distributed.tp_size=2"], "distributed.tp_size"),
    ("a device that is not there", ["train.device=cuda"], "train.device"),
    ("activation checkpointing without blocks", ["train.activation_checkpointing=full"], "pipeline"),
    # resume
    ("resume from a missing checkpoint", ["checkpoint.resume_from=nowhere"], "checkpoint.resume_from"),
    ("resume with another sequence length", ["train.run_dir=done", "train.seq_len=4"], "train.seq_len"),
    ("resume with another optimizer", ["train.run_dir=done", "optimizer.name=sgd"], "optimizer.name"),
    ("resume with a wider model", ["train.run_dir=done", "model.dim=16"], "model.dim"),
]


def write_tokens(path: Path, ids: np.ndarray, **sidecar) -> None:
    ids.astype(np.uint16).tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"dtype": "uint16", **sidecar}))


def hookloop(project: Path, *args: str) -> tuple[int, str]:
    result = run_process([sys.executable, "-m", "hookloop", *args], cwd=project, timeout=120)
    return result.returncode, result.stderr


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    (root / "my_models.py").write_text(MY_MODELS)
    (root / "my_data.py").write_text(MY_DATA)
    (root / "my_hooks.py").write_text(MY_HOOKS)
    (root / "base.yaml").write_text(BASE)
    write_tokens(root / "wide.bin", np.arange(4096) % 1000, vocab_size=1000)  # a 1000-token tokenizer's
    write_tokens(root / "short.bin", np.arange(6), vocab_size=256)
    # A run to resume: one step, saved.
    code, err = hookloop(root, "train", "base.yaml", "train.run_dir=done", "step_scheduler.max_steps=1",
                         "step_scheduler.ckpt_every_steps=1")  # fmt: skip
    assert code == 0, err
    return root


@pytest.mark.parametrize(("overrides", "field"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_check_and_train_refuse_with_the_same_line(project, overrides, field):
    resumes = any(o.startswith("train.run_dir") for o in overrides)
    run_dir = [] if resumes else ["train.run_dir=runs/mistake"]
    said = {}
    for command in ("check", "train"):
        code, err = hookloop(project, command, "base.yaml", *run_dir, *overrides)
        lines = [line for line in err.splitlines() if line.startswith("config error: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (command, code, err)
        said[command] = lines[0]
    assert said["check"] == said["train"], said
    assert said["check"].startswith(f"config error: {field}"), said
    assert not (project / "runs" / "mistake").exists()
