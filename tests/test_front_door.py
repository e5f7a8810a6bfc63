"""The front door takes a project's own parts: ``handlers:`` entries in the config, handlers and the
wired run in Python (``build`` / ``train``), and data from a factory (``data.target``).

Config checks run in this process; the runs are real ``hookloop`` processes (one, or two under
torchrun) on a tiny model, each with a hard timeout.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from hookloop import ConfigError
from hookloop.engine.run_lock import RunDirInUse
from hookloop.train import build, check, load_training_config, train
from tests.dist_utils import run_process, run_torchrun
from tests.test_elastic_data import global_batches
from tests.user_models import tiny_lm_config

# A project of its own: samples that are dicts (not token-file tuples), a collate_fn that insists on
# them, a stateful handler with a section of its own, and an ignite-style object from a factory.
MY_DATA = '''
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Windows(Dataset):
    """Windows of bytes of one text as dicts: {"ids": seq_len + 1 ids, "origin": name}."""

    def __init__(self, text: bytes, seq_len: int, origin: str) -> None:
        self.ids = torch.tensor(list(text), dtype=torch.long)
        self.seq_len, self.origin = seq_len, origin

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict:
        start = i * self.seq_len
        return {"ids": self.ids[start : start + self.seq_len + 1], "origin": self.origin}


def build(seq_len: int, chars: int = 12000):
    from pydoc_data.topics import topics

    docs = "".join(topics[k] for k in sorted(topics)).encode()[:chars]
    code = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_bytes()[:chars]
    return {"docs": Windows(docs, seq_len, "docs"), "code": Windows(code, seq_len, "code")}
'''

MY_MODELS = """
import torch

from hookloop.recipe import ModelRecipe


class TinyLM(torch.nn.Module):
    def __init__(self, dim: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(torch.relu(self.embed(tokens)))


def collate(samples):
    assert all(isinstance(s, dict) and s["origin"] in ("docs", "code") for s in samples), samples
    ids = torch.stack([s["ids"] for s in samples])
    return ids[:, :-1], ids[:, 1:]


recipe = ModelRecipe(build=TinyLM, collate_fn=collate)
"""

MY_HOOKS = '''
import json
from dataclasses import dataclass
from pathlib import Path

from hookloop import Events, Handler, Priority
from hookloop.engine.checks import check_int
from hookloop.engine import parallel


@dataclass
class StepCounterConfig:
    enabled: bool = True
    every: int = 1

    def validate(self, prefix: str = "step_counter") -> None:
        check_int(f"{prefix}.every", self.every, hint="steps between counts")


class StepCounter(Handler):
    """Counts the steps it saw; its count is checkpointed, so a resumed run continues it."""

    Config = StepCounterConfig
    asks_after_agreement = False  # counts at STEP_END, never asks for a stop
    publishes = ("steps_counted",)  # what it writes into state.metrics: checkpoint.metric may rank by it

    def __init__(self, every: int = 1, run_dir: str = ".") -> None:
        self.every, self.run_dir, self.seen = every, Path(run_dir), 0

    def attach(self, trainer):
        trainer.add_event_handler(Events.STEP_END(every=self.every), self._count, priority=Priority.RECORD)
        trainer.add_event_handler(Events.TRAIN_END, self._write)
        return super().attach(trainer)

    def _count(self) -> None:
        self.seen += 1
        self.trainer.state.metrics["steps_counted"] = self.seen

    def _write(self) -> None:
        out = {"seen": self.seen, "step": self.trainer.state.step}
        (self.run_dir / f"counter-rank{parallel.rank()}.json").write_text(json.dumps(out))

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class LossFile:
    """ignite's convention only: attach(trainer), no hookloop base class."""

    def __init__(self, trainer, run_dir, name: str) -> None:
        self.trainer, self.path, self.rows = trainer, Path(run_dir) / name, 0

    def attach(self, trainer):
        trainer.add_event_handler(Events.STEP_END, self._write)

    def _write(self) -> None:
        self.rows += 1
        if parallel.rank() == 0:
            with open(self.path, "a") as f:
                row = {"step": self.trainer.state.step, "loss": float(self.trainer.state.loss)}
                f.write(json.dumps(row) + "\\n")

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        self.rows = state["rows"]


def loss_file(trainer, run_dir, name: str = "losses.jsonl"):
    return LossFile(trainer, run_dir, name)
'''

HEAD = tiny_lm_config(max_steps=12, ckpt_every_steps=4, val_every_steps=4, target="my_models.py:recipe")
CONFIG = (
    HEAD
    + """
  decay_style: constant   # the same schedule whatever max_steps a leg of the run is given
logging:
  log_interval: 4
data:
  target: my_data.py:build
  args: {chars: 12000}
  weights: {docs: 1.0, code: 1.0}
  val_fraction: 0.1
  val_samples: 8
  trace_samples: true
  phases:
    - start_step: 6
      dataset_weights: {docs: 0.0}
handlers:
  - target: my_hooks.py:StepCounter
    every: 1
  - target: my_hooks.py:loss_file
    name: losses.jsonl
"""
)

TOTAL = 12


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("front_door")
    for name, text in (("my_data.py", MY_DATA), ("my_models.py", MY_MODELS), ("my_hooks.py", MY_HOOKS)):
        (root / name).write_text(text)
    (root / "run.yaml").write_text(CONFIG)
    return root


@pytest.fixture
def in_project(project, monkeypatch) -> Path:
    monkeypatch.chdir(project)
    return project


def config(*overrides: str):
    return load_training_config("run.yaml", list(overrides))


def hookloop(project: Path, nproc: int, *args: str):
    if nproc == 1:
        return run_process([sys.executable, "-m", "hookloop", *args], cwd=project, timeout=180)
    return run_torchrun("hookloop", nproc, list(args), module=True, cwd=project)


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


# ------------------------------------------------------------------ handlers: entries are checked
@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["handlers.0.evry=3"], "handlers[0].evry", "did you mean 'every'"),
        (["handlers.0.every=0"], "handlers[0].every", ">= 1"),
        (["handlers.0.every=abc"], "handlers[0].every", "abc"),
        (["handlers.1.nme=x.jsonl"], "handlers[1].nme", "is not an argument of my_hooks.py:loss_file"),
        (["handlers.1.target=my_hooks.py:nothing"], "handlers[1].target", "has no attribute 'nothing'"),
        (["handlers.1.target=my_hooks.py:StepCounterConfig"], "handlers[1].target", "no attach(trainer)"),
        (["handlers.1.target=json"], "handlers[1].target", "must look like module:attribute"),
        (["handlers.1.target=my_hooks.py:loss_fiel"], "handlers[1].target", "(did you mean 'loss_file'?)"),
        (["handlers.1.target=my_hoks.py:loss_file"], "handlers[1].target", "(did you mean 'my_hooks.py'?)"),
        (["model.target=my_models.py:recipr"], "model.target", "(did you mean 'recipe'?)"),
        (["model.target=hookloop.modls.gpt:recipe"], "model.target", "(did you mean 'hookloop.models.gpt'?)"),
        (
            ["data.args.chars=abc", "data.args.nope=1"],
            "data.args.nope",
            "is not an argument of my_data.py:build",
        ),
        (["data.datasets.x=x.u8"], "data.datasets", "together with data.target"),
    ],
)
def test_check_names_the_handler_entry_or_data_argument_at_fault(in_project, overrides, field, words):
    with pytest.raises(ConfigError) as e:
        check(config(*overrides))
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_checkpoints_rank_by_a_metric_a_handler_of_the_run_publishes(in_project):
    best = ["checkpoint.keep_best=1", "checkpoint.metric_mode=max"]
    check(config(*best, "checkpoint.metric=steps_counted"))  # StepCounter.publishes names it
    with pytest.raises(ConfigError) as e:
        check(config(*best, "checkpoint.metric=steps_seen"))
    assert e.value.field == "checkpoint.metric" and "steps_counted" in str(e.value)


def test_hookloop_check_exits_2_with_one_line_for_a_bad_handler_argument(project):
    proc = hookloop(project, 1, "check", "run.yaml", "handlers.0.evry=3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: handlers[0].evry: is not a setting of my_hooks.py:StepCounter (did you mean "
        "'every'? its StepCounterConfig has: enabled, every)"
    ]
    good = hookloop(project, 1, "check", "run.yaml")
    assert good.returncode == 0 and "2 handler(s) of its own" in good.stdout, good.stderr


def test_unknown_dataset_names_are_refused_before_any_process_group(in_project):
    with pytest.raises(ConfigError) as e:  # the names are known once the factory ran: in build()
        build(config("data.weights.prose=1.0", "train.run_dir=runs/never"))
    assert e.value.field == "data.weights.prose" and "known: docs, code" in str(e.value)
    assert not (in_project / "runs/never").exists()  # nothing written


# ------------------------------------------------------------------ build: the wired run in Python
class Recorder:
    """A hook passed in Python: records the order of STEP_END callbacks it sees and the steps."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def attach(self, trainer) -> None:
        from hookloop import Events
        from hookloop.handlers import Places

        self.trainer = trainer
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=Places.CHECKPOINT + 1)

    def _on_step_end(self) -> None:
        self.steps.append(self.trainer.state.step)


def test_build_wires_everything_and_runs_nothing_until_run(in_project):
    from hookloop import Events
    from hookloop.handlers import AsyncCheckpointer, JSONLLogger, StepScheduler

    cfg = config("train.run_dir=runs/built", "step_scheduler.max_steps=8")
    recorder = Recorder()
    with build(cfg, handlers=[recorder]) as run:
        run_dir = in_project / "runs/built"
        # the run holds its directory; nothing is written there until it has started
        assert [p.name for p in run_dir.iterdir()] == [".hookloop.lock"]
        with pytest.raises(RunDirInUse, match="runs/built is in use by this process"):
            build(cfg)  # one run per directory, in this process too
        assert run.trainer.state.iteration == 0 and recorder.steps == []
        assert run.trainer.model is run.model and run.trainer.optimizer is run.optimizer
        assert run.trainer.lr_scheduler is run.lr_scheduler and run.val_loader is not None
        kinds = [type(h).__name__ for h in run.handlers]
        assert kinds[:2] == ["StepScheduler", "AsyncCheckpointer"]
        assert kinds[-3:] == ["StepCounter", "LossFile", "Recorder"]  # config entries, then Python's
        # Phases decide the order on an event, not the attach order: the recorder, placed just
        # before the checkpoint, runs before the checkpointer and after the step scheduler.
        owners = [getattr(e.original, "__self__", None) for e in run.trainer.events.entries(Events.STEP_END)]
        at = {type(o): i for i, o in reversed(list(enumerate(owners)))}
        assert at[StepScheduler] < at[Recorder] < at[AsyncCheckpointer] < at[JSONLLogger]
        assert set(run.trainer.stateful) >= {"StepCounter", "LossFile"}  # both checkpointed
        assert run.run() == 0
        assert (run_dir / "config.yaml").is_file()
    assert not (run_dir / ".hookloop.lock").exists()  # released by close()
    assert recorder.steps == list(range(1, 9))
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 0 and status["step"] == 8
    saved = json.loads((run_dir / "checkpoints/step_00000008/rank_00000.json").read_text())
    assert {"StepCounter", "LossFile"} <= set(saved["handlers"])


def test_a_build_refused_on_a_process_group_it_found_leaves_that_group_alone(in_project, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = config("train.run_dir=runs/in_group", "step_scheduler.max_steps=2")
        with build(cfg) as run:
            with pytest.raises(RunDirInUse):
                build(cfg)
            assert dist.is_initialized()  # the first run's group survives the refusal
            assert run.run() == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_train_returns_the_exit_code_and_2_for_a_config_error(in_project, capsys):
    assert train(config("train.run_dir=runs/t", "step_scheduler.max_steps=2"), handlers=[Recorder()]) == 0
    assert train(config("train.run_dir=runs/bad", "data.weights.prose=1.0")) == 2
    assert "config error: data.weights.prose" in capsys.readouterr().err
    with pytest.raises(TypeError, match="no attach"):
        build(config("train.run_dir=runs/t2"), handlers=[object()])


# ------------------------------------------------------------------ data.target: the shipped guarantees
def val_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}


@pytest.mark.distributed
@pytest.mark.slow
def test_factory_data_and_config_handlers_resume_exactly_across_dp_sizes(project):
    """A data.target mixture with a phase and the config's own handlers: dp=2 and dp=1 train the
    same global batches and validate on the same samples; a run stopped at dp=2, resumed at dp=2
    (bitwise the uninterrupted run) and then at dp=1 trains every sample once, and its stateful
    handlers continue their counts."""
    ok(hookloop(project, 2, "train", "run.yaml", "train.run_dir=runs/ref2"))
    ok(hookloop(project, 1, "train", "run.yaml", "train.run_dir=runs/ref1"))
    ref2, ref1 = global_batches(project / "runs/ref2"), global_batches(project / "runs/ref1")
    assert sorted(ref2) == list(range(1, TOTAL + 1)) and all(len(ids) == 8 for ids in ref2.values())
    assert max(Counter(i for ids in ref2.values() for i in ids).values()) == 1  # each sample once
    assert ref1 == ref2
    assert all({i.split(":")[0] for i in ref2[s]} == {"code"} for s in range(6, TOTAL + 1))  # the phase
    v1, v2 = val_losses(project / "runs/ref1"), val_losses(project / "runs/ref2")
    assert sorted(v1) == [4, 8, 12] and v1 == pytest.approx(v2, rel=1e-5)  # the same 8 samples

    run = project / "runs/elastic"
    ok(hookloop(project, 2, "train", "run.yaml", "train.run_dir=runs/elastic", "step_scheduler.max_steps=4"))
    ok(hookloop(project, 2, "train", "run.yaml", "train.run_dir=runs/elastic", "step_scheduler.max_steps=8"))
    ok(hookloop(project, 1, "train", "run.yaml", "train.run_dir=runs/elastic"))
    assert global_batches(run) == ref2
    counter = json.loads((run / "counter-rank0.json").read_text())
    assert counter == {"seen": TOTAL, "step": TOTAL}  # restored at each resume, not restarted
    losses = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (project / "runs/ref2/losses.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses] == list(range(1, TOTAL + 1))
    assert losses[:8] == ref[:8]  # resumed on the same layout: bitwise the uninterrupted run
    # on one rank the same samples, summed in another order: equal up to rounding
    assert losses[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=1e-2)


# ------------------------------------------------------------------ build under torchrun, every layout
GPT_CONFIG = """
model: {target: hookloop.models.gpt:recipe, n_layers: 2, d_model: 32, n_heads: 2}
train: {seq_len: 16, local_batch_size: 2}
step_scheduler:
  {global_batch_size: 4, max_steps: 4, num_epochs: null, ckpt_every_steps: 2, val_every_steps: null}
lr: {warmup_steps: 0, decay_style: constant}
logging: {log_interval: 2}
data: {val_samples: 0}
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "model"),
    [(["distributed.tp_size=2"], "GPT"), (["distributed.pp_size=2"], "ModuleList")],
    ids=["tp2", "pp2"],
)
def test_build_with_python_handlers_runs_under_torchrun(tmp_path, layout, model):
    """``build(cfg, handlers=[...])`` in a script under torchrun: the model wrapped for the layout,
    the hook on every rank at every step, ``exit_status.json``, and a resume that restores the
    hook's state (its list of steps continues instead of restarting)."""
    from tests.dist_utils import REPO

    (tmp_path / "run.yaml").write_text(GPT_CONFIG)
    script = REPO / "tests/scripts/build_run.py"
    args = [str(tmp_path / "run.yaml"), f"train.run_dir={tmp_path / 'run'}", *layout]
    ok(run_torchrun(script, 2, [*args, "step_scheduler.max_steps=2"], cwd=tmp_path))
    ok(run_torchrun(script, 2, args, cwd=tmp_path))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"run/hook-rank{rank}.json").read_text())
        assert seen["steps"] == [1, 2, 3, 4] and seen["model"] == model, seen
    assert json.loads((tmp_path / "run/exit_status.json").read_text())["code"] == 0


# ------------------------------------------------------------------ dict samples with keys of their own
MY_REGRESSION = """
import torch
from torch.utils.data import Dataset

from hookloop import Handler
from hookloop.recipe import ModelRecipe


class Points(Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def mlp(hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


recipe = ModelRecipe(build=mlp, loss_fn=torch.nn.functional.mse_loss)
keyed = ModelRecipe(build=mlp, loss_fn=torch.nn.functional.mse_loss, inputs="x", targets="y")


class BestLoss(Handler):  # says nothing: on_step_end attaches itself
    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold, self.best = threshold, float("inf")

    def on_step_end(self, trainer) -> None:
        self.best = min(self.best, float(trainer.state.loss))
        if self.best < self.threshold:
            trainer.control.request_stop("low loss")

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]
"""

REGRESSION_CONFIG = """
model: {target: my_regression.py:recipe, hidden: 16}
train: {local_batch_size: 4}
step_scheduler:
  {global_batch_size: 4, max_steps: 6, num_epochs: null, ckpt_every_steps: 3, val_every_steps: null}
lr: {warmup_steps: 0, decay_style: constant}
logging: {log_interval: 3}
data: {target: my_regression.py:Points, val_samples: 0, inputs: x, targets: y}
handlers:
  - target: my_regression.py:BestLoss
    threshold: 0.0
"""


def test_dict_samples_with_keys_of_their_own_train_and_a_wrong_key_is_one_line(tmp_path):
    (tmp_path / "my_regression.py").write_text(MY_REGRESSION)
    (tmp_path / "run.yaml").write_text(REGRESSION_CONFIG)
    ok(hookloop(tmp_path, 1, "check", "run.yaml"))
    ok(hookloop(tmp_path, 1, "train", "run.yaml", "train.run_dir=run"))
    assert json.loads((tmp_path / "run/exit_status.json").read_text())["code"] == 0
    line = "config error: data.inputs: 'z' is not a key of the microbatch; keys found: x, y"
    for command in ("check", "train"):
        proc = hookloop(tmp_path, 1, command, "run.yaml", "data.inputs=z", "train.run_dir=wrong")
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]
    # the recipe may name the keys instead
    no_keys = ["data.inputs=null", "data.targets=null"]
    ok(hookloop(tmp_path, 1, "check", "run.yaml", *no_keys, "model.target=my_regression.py:keyed"))
    # without the keys a dict follows the Hugging Face convention: one line saying how to name them
    proc = hookloop(tmp_path, 1, "check", "run.yaml", *no_keys)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "got keys ['x', 'y']: name the input and target keys with data.inputs" in proc.stderr
