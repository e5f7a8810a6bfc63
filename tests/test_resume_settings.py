"""A resume honours the config or refuses it, and says which (docs/checkpoint.md, "Changing settings
on resume"). Real ``hookloop train`` processes (one, or two under torchrun) follow docs/requeue.md's
advice after a NaN give-up (76) as written, and show a refused change (optimizer kind, ``seq_len``,
dataset list) as exit 2 and one ``config error:`` line naming the field, with no traceback, before
anything loads, alike on every rank. The same composition built in this process shows the rest
quickly: a changed learning rate and weight decay are in the optimizer's parameter groups from the
resumed step (its state still the checkpoint's) and said in one lifecycle line with the
checkpoint's old values; ``checkpoint.load_optimizer=false`` keeps the configured rate on every
resumed step; a stretched decay end is said with its rate; the global batch, seed and model width
are refused by name; a checkpoint written before checkpoints recorded their settings still
resumes."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from hookloop import Events, Trainer
from hookloop.engine import ConfigError
from hookloop.engine.checkpoint_format.directory import MARKER, step_dir_name
from hookloop.engine.checkpoint_format.manifest import file_checksum
from hookloop.engine.data import prepare_tokens
from hookloop.engine.lr import build_lr_scheduler, lr_at
from hookloop.handlers import AsyncCheckpointer
from hookloop.train import build, load_training_config
from hookloop.train import train as train_here
from tests.cadence import save_every
from tests.dist_utils import run_process, run_torchrun

# No position embedding: train.seq_len leaves the model's shapes alone, so only the settings check
# can refuse a changed seq_len before the data position would fail to load.
MODEL = """
import torch

class Bag(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.head = torch.nn.Linear(dim, 256)

    def forward(self, tokens):
        return self.head(torch.relu(self.embed(tokens)))

def build(dim: int = 16):
    return Bag(dim)
"""

CONFIG = """
model:
  target: tiny_model.py:build
train:
  seq_len: 16
  local_batch_size: 4
step_scheduler:
  global_batch_size: 4
  max_steps: 2
  ckpt_every_steps: 2
lr:
  decay_style: constant
nan:
  action: raise
  max_consecutive: 1
logging:
  log_interval: 1
data:
  datasets:
    a: a.u8
  val_samples: 0
"""

TIMEOUT = 120


def make_project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny_model.py").write_text(MODEL)
    (root / "run.yaml").write_text(CONFIG)
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    prepare_tokens([text], root / "a.u8")
    prepare_tokens([text.upper()], root / "b.u8")
    return root


def train(project: Path, *overrides: str) -> object:
    return run_process(
        [sys.executable, "-m", "hookloop", "train", "run.yaml", *overrides], cwd=project, timeout=TIMEOUT
    )


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


def metrics(project: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (project / "runs/run/metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "lr" in row}


def rank_state(project: Path, step: int) -> dict:
    return json.loads(
        (project / "runs/run/checkpoints" / step_dir_name(step) / "rank_00000.json").read_text()
    )


def settings_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "settings from the checkpoint" in line]


def refused(proc, field: str) -> str:
    """The one ``config error: <field>: ...`` line of a refused resume (exit 2, no traceback)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"config error: {field}: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" not in proc.stderr  # refused before anything loaded
    return errors[0]


@pytest.fixture
def project(tmp_path) -> Path:
    return make_project(tmp_path)


# ------------------------------------------------------------------ real hookloop train processes
def test_requeue_advice_after_a_nan_give_up_works_as_written(project):
    """docs/requeue.md, exit code 76: "look at the data around the logged steps, lower the learning
    rate (``optimizer.lr=...``), then resume". Step 4's loss is NaN (its microbatch is poisoned);
    the run stops with 76 and its last checkpoint is step 2's. The data is fixed (the poison
    removed) and the learning rate lowered: the resumed run trains from step 3 on the lowered
    schedule and says so."""
    schedule = ["lr.decay_style=cosine", "lr.decay_steps=6", "step_scheduler.max_steps=6"]
    nan = ["fault_injection.enabled=true", "fault_injection.kind=nan", "fault_injection.microbatches=[3]"]
    gave_up = train(project, *schedule, *nan)
    assert gave_up.returncode == 76, gave_up.stderr[-3000:]
    assert json.loads((project / "runs/run/exit_status.json").read_text())["code"] == 76
    resumed = train(project, *schedule, "optimizer.lr=0.0001")
    ok(resumed)
    (line,) = settings_lines(resumed.stderr)
    assert "resuming at step 2" in line and "in effect from step 3): optimizer.lr 0.0003 -> 0.0001" in line
    rows = metrics(project)
    for step in (3, 4, 5):  # (the rate after step 6 is 0 in both schedules)
        assert rows[step]["lr"] == pytest.approx(lr_at(step, peak_lr=1e-4, decay_steps=6))
        assert rows[step]["lr"] < lr_at(step, peak_lr=3e-4, decay_steps=6) / 2
    group = rank_state(project, 6)["settings"]["optimizer"]["groups"][0]
    assert group["lr"] == 1e-4  # the base rate the optimizer trained the resumed steps with


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    project = make_project(tmp_path_factory.mktemp("refusals"))
    ok(train(project))
    return project


def checkpoint_files(project: Path) -> dict[str, bytes]:
    root = project / "runs/run/checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


REFUSALS = [
    ("optimizer.name=sgd", "optimizer.name", "set checkpoint.load_optimizer=false"),
    ("train.seq_len=8", "train.seq_len", "set train.seq_len=16"),
    ("data.datasets.b=b.u8", "data.datasets", "set data.datasets back to {a: a.u8}"),
    ("step_scheduler.global_batch_size=8", "step_scheduler.global_batch_size", "global_batch_size=4"),
    ("train.seed=1", "train.seed", "set train.seed=0"),
    ("model.dim=24", "model.dim", "set model.dim=16"),
]


@pytest.mark.parametrize("override, field, fix", REFUSALS[:3])
def test_hookloop_train_refuses_a_change_with_exit_2_and_one_line(trained, override, field, fix):
    """The real CLI: exit 2, one ``config error:`` line naming the field and the way on, no
    traceback, nothing loaded, the checkpoints untouched."""
    before = checkpoint_files(trained)
    line = refused(train(trained, "step_scheduler.max_steps=3", override), field)
    assert fix in line and "train.run_dir=<new dir>" in line, line
    assert checkpoint_files(trained) == before


def test_every_rank_refuses_alike_under_torchrun(tmp_path):
    project = make_project(tmp_path)
    two = ["train.local_batch_size=2", "step_scheduler.max_steps=1", "step_scheduler.ckpt_every_steps=1"]
    first = run_torchrun(
        "hookloop", 2, ["train", "run.yaml", *two], module=True, cwd=project, timeout=TIMEOUT
    )
    ok(first)
    proc = run_torchrun(
        "hookloop", 2, ["train", "run.yaml", *two, "step_scheduler.max_steps=2", "data.datasets.b=b.u8"],
        module=True, cwd=project, timeout=TIMEOUT, launcher="torchrun",
    )  # fmt: skip
    # Both workers exit 2 (torchrun then exits 1 and lists them); rank 0 alone says why.
    assert proc.returncode == 1 and proc.stderr.count("exitcode  : 2 ") == 2, proc.stderr[-3000:]
    workers = proc.stderr.split("torch/distributed/elastic")[0]  # what the launcher adds comes after
    errors = [line for line in workers.splitlines() if "config error:" in line]
    assert len(errors) == 1 and errors[0].startswith("config error: data.datasets: "), proc.stderr[-3000:]
    assert "Traceback" not in workers, proc.stderr[-3000:]


# ------------------------------------------------------------------ the same run, built in this process
class Rates:
    """Records, before each optimizer step, what the optimizer steps with: every group's
    ``(lr, weight_decay)`` and its state's step count (0: fresh state)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[list[tuple[float, float]], int]] = {}

    def attach(self, trainer) -> None:
        self.trainer = trainer
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, self._record)

    def _record(self) -> None:
        optimizer = self.trainer.optimizer
        counts = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        groups = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
        self.seen[self.trainer.state.step] = (groups, max(counts, default=0))


@pytest.fixture
def in_project(project, monkeypatch) -> Path:
    monkeypatch.chdir(project)
    return project


def run_here(*overrides: str) -> tuple[int, Rates]:
    """``hookloop train run.yaml *overrides`` in this process (the project is the working
    directory); returns the exit code and what the optimizer stepped with."""
    rates = Rates()
    with build(load_training_config("run.yaml", list(overrides)), handlers=[rates]) as run:
        code = run.run()
    return code, rates


def said(caplog) -> list[str]:
    """The settings lines logged since the last call."""
    lines = [r.getMessage() for r in caplog.records if "settings from the checkpoint" in r.getMessage()]
    caplog.clear()
    return lines


def test_a_changed_lr_and_weight_decay_take_effect_and_are_said(in_project, caplog):
    caplog.set_level(logging.INFO, logger="hookloop")
    assert run_here()[0] == 0
    # Only what changed is said: the unchanged rate and decay are not.
    assert run_here("step_scheduler.max_steps=3")[0] == 0
    assert said(caplog) == [
        "resuming at step 2 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 3): step_scheduler.max_steps 2 -> 3"
    ]
    code, rates = run_here("step_scheduler.max_steps=5", "optimizer.lr=0.001", "optimizer.weight_decay=0.01")
    assert code == 0
    assert said(caplog) == [
        "resuming at step 3 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 4): optimizer.lr 0.0003 -> 0.001, optimizer.weight_decay 0.1 -> 0.01, "
        "step_scheduler.max_steps 3 -> 5; learning rate 0.0003 -> 0.001"
    ]
    # The optimizer's state is the checkpoint's (3 steps taken), its hyperparameters this run's.
    assert rates.seen == {4: ([(1e-3, 0.01)], 3), 5: ([(1e-3, 0.01)], 4)}
    rows = metrics(in_project)
    assert [rows[s]["lr"] for s in (1, 2, 3, 4, 5)] == [3e-4] * 3 + [1e-3] * 2
    # The rate and decay unchanged: not said, and they stay.
    code, rates = run_here("step_scheduler.max_steps=6", "optimizer.lr=0.001", "optimizer.weight_decay=0.01")
    assert code == 0 and rates.seen == {6: ([(1e-3, 0.01)], 5)}
    assert said(caplog) == [
        "resuming at step 5 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 6): step_scheduler.max_steps 5 -> 6"
    ]


def test_load_optimizer_false_keeps_the_configured_rate_and_decay(in_project, caplog):
    """Without the optimizer's state the rate is the configured one too, on every resumed step (not
    the base rate the LR scheduler saved)."""
    caplog.set_level(logging.INFO, logger="hookloop")
    assert run_here()[0] == 0
    fresh = ["checkpoint.load_optimizer=false", "optimizer.lr=0.002", "optimizer.weight_decay=0.01"]
    code, rates = run_here("step_scheduler.max_steps=4", *fresh)
    assert code == 0
    assert said(caplog) == [
        "resuming at step 2 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 3): checkpoint.load_optimizer=false: the optimizer's state starts fresh, "
        "optimizer.lr 0.0003 -> 0.002, optimizer.weight_decay 0.1 -> 0.01, step_scheduler.max_steps 2 -> 4; "
        "learning rate 0.0003 -> 0.002"
    ]
    assert rates.seen == {3: ([(2e-3, 0.01)], 0), 4: ([(2e-3, 0.01)], 1)}
    assert [metrics(in_project)[s]["lr"] for s in (3, 4)] == [2e-3, 2e-3]


def test_a_changed_decay_end_is_said_with_the_learning_rate_it_gives(in_project, caplog):
    """``lr.decay_steps`` null follows ``step_scheduler.max_steps``: raising it stretches the decay,
    from the resumed step on, and the line says so with the rate before and after."""
    caplog.set_level(logging.INFO, logger="hookloop")
    linear = ["lr.decay_style=linear", "lr.min_lr=0.0001"]
    assert run_here(*linear)[0] == 0
    code, rates = run_here(*linear, "step_scheduler.max_steps=4")
    assert code == 0
    (line,) = said(caplog)
    assert "lr.decay_steps (null: step_scheduler.max_steps) 2 -> 4" in line
    assert line.endswith("; learning rate 0.0001 -> 0.0002")
    schedule = dict(peak_lr=3e-4, decay_style="linear", min_lr=1e-4, decay_steps=4)
    for step in (3, 4):
        assert rates.seen[step][0][0][0] == pytest.approx(lr_at(step - 1, **schedule))
        assert metrics(in_project)[step]["lr"] == pytest.approx(lr_at(step, **schedule))


@pytest.mark.parametrize("override, field, fix", REFUSALS[3:])
def test_a_refused_change_is_one_line_naming_the_field_before_anything_loads(
    trained, monkeypatch, capsys, override, field, fix
):
    monkeypatch.chdir(trained)
    before = checkpoint_files(trained)
    cfg = load_training_config("run.yaml", ["step_scheduler.max_steps=3", override])
    assert train_here(cfg, handlers=[Rates()]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and errors[0].startswith(f"config error: {field}: "), err
    assert fix in errors[0] and "train.run_dir=<new dir>" in errors[0], errors[0]
    assert checkpoint_files(trained) == before


def test_a_checkpoint_without_recorded_settings_still_resumes_and_says_so(in_project, caplog):
    """A checkpoint written before checkpoints recorded their settings: its rank state has no
    ``settings`` entry (the manifest is rewritten to match, as that version wrote it)."""
    caplog.set_level(logging.INFO, logger="hookloop")
    assert run_here()[0] == 0
    step = in_project / "runs/run/checkpoints" / step_dir_name(2)
    state_file = step / "rank_00000.json"
    state = json.loads(state_file.read_text())
    del state["settings"]
    state_file.write_text(json.dumps(state))
    marker = json.loads((step / MARKER).read_text())
    size, crc = file_checksum(state_file)
    marker["manifest"]["files"]["rank_00000.json"].update(size=size, checksum=crc)
    (step / MARKER).write_text(json.dumps(marker))
    code, rates = run_here("step_scheduler.max_steps=3", "optimizer.lr=0.001")
    assert code == 0
    (line,) = said(caplog)
    assert "not recorded in the checkpoint (an earlier version wrote it)" in line, line
    assert rates.seen == {3: ([(1e-3, 0.1)], 2)}


# ------------------------------------------------------------------ a bare Trainer
DATA = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)), torch.zeros(8, 1)) for i in range(8)]


def fit(directory: Path, lr: float, max_steps: int, scheduler=None):
    """A Trainer with AdamW at ``lr`` and a sync checkpointer every 2 steps, run to ``max_steps``."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    trainer = Trainer(
        model, optimizer, torch.nn.functional.mse_loss, lr_scheduler=scheduler and scheduler(optimizer)
    )
    checkpointer = AsyncCheckpointer(directory, mode="sync").attach(trainer)
    save_every(trainer, 2)
    trainer.run(DATA, max_steps=max_steps)
    return trainer, checkpointer


def test_the_schedule_records_its_settings_outside_its_state():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    schedule = build_lr_scheduler(
        optimizer, decay_style="linear", decay_steps_default=10, default_name="step_scheduler.max_steps"
    )
    assert schedule.settings["decay_steps"] == 10 and schedule.decay_steps_from == "step_scheduler.max_steps"
    assert not {"_settings", "_decay_steps_from"} & set(schedule.state_dict())
    constant = build_lr_scheduler(optimizer, decay_style="constant", decay_steps_default=10)
    assert constant.settings["decay_steps"] is None and constant.decay_steps_from is None  # never read


def test_a_rollback_to_a_checkpoint_of_an_earlier_run_keeps_this_runs_hyperparameters(tmp_path):
    """The run resumed with a lower rate rolls back to a checkpoint the first run wrote: the
    optimizer's state comes back from it, the rate stays this run's."""
    constant = lambda optimizer: build_lr_scheduler(optimizer, decay_style="constant")  # noqa: E731
    fit(tmp_path, 1e-2, 4, constant)
    trainer, checkpointer = fit(tmp_path, 1e-3, 6, constant)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-3]
    assert checkpointer.restore_latest(keep_data_position=True, at_or_before=4) == 4
    assert [(g["lr"], g["initial_lr"]) for g in trainer.optimizer.param_groups] == [(1e-3, 1e-3)]


def test_a_scheduler_that_cannot_take_other_base_rates_refuses_them(tmp_path):
    step = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # noqa: E731
    fit(tmp_path, 1e-2, 2, step)
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: .* \(StepLR\) cannot be evaluated"):
        fit(tmp_path, 1e-3, 4, step)
    trainer, _ = fit(tmp_path, 1e-2, 4, step)  # the same rate resumes
    assert trainer.state.step == 4
