"""A resume honours the config or refuses it, and says which (docs/checkpoint.md, "Changing settings
on resume"): with real ``hookloop train`` processes, a changed learning rate and weight decay take
effect from the resumed step (in the optimizer's parameter groups and ``metrics.jsonl``) and are
said in one lifecycle line with the checkpoint's old values; ``checkpoint.load_optimizer=false``
keeps the configured rate; docs/requeue.md's advice after a NaN give-up (76) works as written; every
refused change (optimizer kind, ``seq_len``, dataset list, global batch, seed, model width) is exit 2
and one ``config error:`` line naming the field, found before anything loads and alike on every
rank; a checkpoint written before checkpoints recorded their settings still resumes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hookloop import Trainer
from hookloop.engine import ConfigError
from hookloop.engine import checkpoint_io as io
from hookloop.engine.data import prepare_tokens
from hookloop.engine.lr import build_lr_scheduler, lr_at
from hookloop.handlers import AsyncCheckpointer
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
        (project / "runs/run/checkpoints" / io.step_dir_name(step) / "rank_00000.json").read_text()
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


def test_a_changed_lr_and_weight_decay_take_effect_and_are_said(project):
    ok(train(project))
    assert settings_lines(train(project, "step_scheduler.max_steps=3").stderr) == [
        "[hookloop] resuming at step 2 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 3): step_scheduler.max_steps 2 -> 3"
    ]
    resumed = train(
        project, "step_scheduler.max_steps=5", "optimizer.lr=0.001", "optimizer.weight_decay=0.01"
    )
    ok(resumed)
    assert settings_lines(resumed.stderr) == [
        "[hookloop] resuming at step 3 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 4): optimizer.lr 0.0003 -> 0.001, optimizer.weight_decay 0.1 -> 0.01, "
        "step_scheduler.max_steps 3 -> 5; learning rate 0.0003 -> 0.001"
    ]
    rows = metrics(project)
    assert [rows[s]["lr"] for s in (1, 2, 3)] == [3e-4] * 3
    assert [rows[s]["lr"] for s in (4, 5)] == [1e-3] * 2
    # What the optimizer trained with, from its parameter groups at the save of step 5.
    group = rank_state(project, 5)["settings"]["optimizer"]["groups"][0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.01 and group["betas"] == [0.9, 0.95]
    # Nothing changed: nothing to say.
    again = train(project, "step_scheduler.max_steps=6", "optimizer.lr=0.001", "optimizer.weight_decay=0.01")
    ok(again)
    assert settings_lines(again.stderr) == [
        "[hookloop] resuming at step 5 with settings from the checkpoint changed (checkpoint -> this run, "
        "in effect from step 6): step_scheduler.max_steps 5 -> 6"
    ]


def test_load_optimizer_false_keeps_the_configured_learning_rate(project):
    ok(train(project))
    resumed = train(
        project, "step_scheduler.max_steps=3", "optimizer.lr=0.002", "checkpoint.load_optimizer=false"
    )
    ok(resumed)
    (line,) = settings_lines(resumed.stderr)
    assert "optimizer.lr 0.0003 -> 0.002" in line
    assert "checkpoint.load_optimizer=false: the optimizer's state starts fresh" in line
    assert metrics(project)[3]["lr"] == 0.002
    assert rank_state(project, 3)["settings"]["optimizer"]["groups"][0]["lr"] == 0.002


def test_a_changed_decay_end_is_said_with_the_learning_rate_it_gives(project):
    """``lr.decay_steps`` null follows ``step_scheduler.max_steps``: raising it stretches the decay,
    from the resumed step on, and the line says so with the rate before and after."""
    ok(train(project, "lr.decay_style=linear", "lr.min_lr=0.0001"))
    resumed = train(project, "lr.decay_style=linear", "lr.min_lr=0.0001", "step_scheduler.max_steps=4")
    ok(resumed)
    (line,) = settings_lines(resumed.stderr)
    assert "lr.decay_steps (null: step_scheduler.max_steps) 2 -> 4" in line
    assert line.endswith("; learning rate 0.0001 -> 0.0002")
    schedule = dict(peak_lr=3e-4, decay_style="linear", min_lr=1e-4, decay_steps=4)
    assert metrics(project)[3]["lr"] == pytest.approx(lr_at(3, **schedule))


def test_requeue_advice_after_a_nan_give_up_works_as_written(project):
    """docs/requeue.md, exit code 76: "look at the data around the logged steps, lower the learning
    rate, then resume". Step 4's loss is NaN (its microbatch is poisoned); the run stops with 76 and
    its last checkpoint is step 2's. The data is fixed (the poison removed) and the learning rate
    lowered: the resumed run trains from step 3 on the lowered schedule."""
    schedule = ["lr.decay_style=cosine", "lr.decay_steps=6", "step_scheduler.max_steps=6"]
    gave_up = train(project, *schedule, "fault.nan_microbatches=[3]")
    assert gave_up.returncode == 76, gave_up.stderr[-3000:]
    assert json.loads((project / "runs/run/exit_status.json").read_text())["code"] == 76
    resumed = train(project, *schedule, "optimizer.lr=0.0001")
    ok(resumed)
    (line,) = settings_lines(resumed.stderr)
    assert "resuming at step 2" in line and "optimizer.lr 0.0003 -> 0.0001" in line
    rows = metrics(project)
    for step in (3, 4, 5):  # (the rate after step 6 is 0 in both schedules)
        assert rows[step]["lr"] == pytest.approx(lr_at(step, peak_lr=1e-4, decay_steps=6))
        assert rows[step]["lr"] < lr_at(step, peak_lr=3e-4, decay_steps=6) / 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    project = make_project(tmp_path_factory.mktemp("refusals"))
    ok(train(project))
    return project


def checkpoint_files(project: Path) -> dict[str, bytes]:
    root = project / "runs/run/checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "override, field, fix",
    [
        ("optimizer.name=sgd", "optimizer.name", "checkpoint.load_optimizer=false"),
        ("train.seq_len=8", "train.seq_len", "set train.seq_len=16"),
        ("data.datasets.b=b.u8", "data.datasets", "set data.datasets back to {a: a.u8}"),
        ("step_scheduler.global_batch_size=8", "step_scheduler.global_batch_size", "global_batch_size=4"),
        ("train.seed=1", "train.seed", "set train.seed=0"),
        ("model.dim=24", "model.dim", "set model.dim=16"),
    ],
)
def test_a_refused_change_is_one_line_naming_the_field_before_anything_loads(trained, override, field, fix):
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
        module=True, cwd=project, timeout=TIMEOUT,
    )  # fmt: skip
    # Both workers exit 2 (torchrun then exits 1 and lists them); rank 0 alone says why.
    assert proc.returncode == 1 and proc.stderr.count("exitcode  : 2 ") == 2, proc.stderr[-3000:]
    workers = proc.stderr.split("torch/distributed/elastic")[0]  # what the launcher adds comes after
    errors = [line for line in workers.splitlines() if "config error:" in line]
    assert len(errors) == 1 and errors[0].startswith("config error: data.datasets: "), proc.stderr[-3000:]
    assert "Traceback" not in workers, proc.stderr[-3000:]


def test_a_checkpoint_without_recorded_settings_still_resumes_and_says_so(project):
    """A checkpoint written before checkpoints recorded their settings: its rank state has no
    ``settings`` entry (the manifest is rewritten to match, as that version wrote it)."""
    ok(train(project))
    step = project / "runs/run/checkpoints" / io.step_dir_name(2)
    state_file = step / "rank_00000.json"
    state = json.loads(state_file.read_text())
    del state["settings"]
    state_file.write_text(json.dumps(state))
    marker = json.loads((step / io.MARKER).read_text())
    size, crc = io.file_checksum(state_file)
    marker["manifest"]["files"]["rank_00000.json"].update(size=size, checksum=crc)
    (step / io.MARKER).write_text(json.dumps(marker))
    resumed = train(project, "step_scheduler.max_steps=3", "optimizer.lr=0.001")
    ok(resumed)
    (line,) = settings_lines(resumed.stderr)
    assert "not recorded in the checkpoint (an earlier version wrote it)" in line, line
    assert metrics(project)[3]["lr"] == 1e-3


# ------------------------------------------------------------------------------ in one process
DATA = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)), torch.zeros(8, 1)) for i in range(8)]


def fit(directory: Path, lr: float, max_steps: int, scheduler=None):
    """A Trainer with AdamW at ``lr`` and a sync checkpointer every 2 steps, run to ``max_steps``."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    trainer = Trainer(
        model, optimizer, torch.nn.functional.mse_loss, lr_scheduler=scheduler and scheduler(optimizer)
    )
    checkpointer = AsyncCheckpointer(directory, mode="sync", every_steps=2).attach(trainer)
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
