"""The ``hookloop`` command and the package's shape: a user's own model trained from a config
(resumed, retrained from the saved config), ``check`` and ``config``, torchrun ``-m hookloop``,
and one installed name (a local ``engine.py`` or ``handlers/`` stays the user's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hookloop.engine.run_lock import RunDirLock
from hookloop.train import load_training_config
from tests.dist_utils import REPO, run_process, run_torchrun

MY_MODEL = """
import torch

class TinyLM(torch.nn.Module):
    def __init__(self, dim, seq_len, vocab=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq_len, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(torch.relu(self.embed(tokens) + self.pos(positions)))

def build(dim: int = 16, seq_len: int = 32):
    return TinyLM(dim, seq_len)
"""

MY_CONFIG = """
model:
  target: my_models.py:build
  dim: 24
train:
  seq_len: 16
  local_batch_size: 4
step_scheduler:
  global_batch_size: 4
  max_steps: 8
  ckpt_every_steps: 4
  val_every_steps: 4
lr:
  warmup_steps: 0
logging:
  log_interval: 4
data:
  cache_dir: data
"""


def hookloop(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-m", "hookloop", *args], cwd=cwd, timeout=timeout)


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's project: their own model file and config, nothing copied from hookloop."""
    (tmp_path / "my_models.py").write_text(MY_MODEL)
    (tmp_path / "my_run.yaml").write_text(MY_CONFIG)
    return tmp_path


def test_train_a_users_own_model_resume_and_retrain_from_the_saved_config(project):
    first = hookloop("train", "my_run.yaml", cwd=project)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = project / "runs" / "my_run"  # the config's stem: each config its own run directory
    assert "[hookloop] model: my_models.py:build, " in first.stderr
    assert "done: step 8, loss " in first.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [4, 8]
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    # The resolved config is saved beside the run, every default included.
    saved = run_dir / "config.yaml"
    cfg = load_training_config(saved)
    assert cfg.model == {"target": "my_models.py:build", "dim": 24}
    assert cfg.train.run_dir == "runs/my_run" and cfg.step_scheduler.max_steps == 8
    assert cfg.optimizer.lr == load_training_config(project / "my_run.yaml").optimizer.lr

    again = hookloop("train", "my_run.yaml", cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    # answered from the run's records, without loading the checkpoint (tests/test_cli_without_torch.py)
    newest = run_dir / "checkpoints" / "step_00000008"
    assert f"the checkpoint {newest} is at step 8 >= max_steps (8)" in again.stderr
    assert "done: step 8, no step left to train" in again.stdout

    # Overrides anywhere on the line; the saved config trains the same run further.
    more = hookloop("train", str(saved), "step_scheduler.max_steps=12", cwd=project)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "(step 8)" in more.stderr and "done: step 12, loss " in more.stdout


def test_the_console_script_is_installed_and_checks(project):
    # pip installs console scripts beside the interpreter that installed the package.
    exe = Path(sys.executable).with_name("hookloop")
    assert exe.is_file(), f"no hookloop console script beside {sys.executable}: pip install -e . installs it"
    exe = str(exe)
    ok = run_process([exe, "check", "my_run.yaml", "--nproc", "2", "train.local_batch_size=2"], cwd=project)
    assert ok.returncode == 0, ok.stderr
    # --nproc is the world size checked for: 4 samples a step cannot split into 2 x 4.
    bad = run_process([exe, "check", "--nproc", "2", "my_run.yaml"], cwd=project)
    assert bad.returncode == 2 and "step_scheduler.global_batch_size: (4)" in bad.stderr, bad.stderr
    assert ok.stdout.startswith(
        "config ok: my_run.yaml (model my_models.py:build, run directory runs/my_run)"
    )


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["model.dimm=3"], "model.dimm: is not an argument of my_models.py:build (it takes: dim, seq_len)"),
        (["model.target=my_models.py:nope"], "model.target: my_models.py has no attribute 'nope'"),
        (["model.target=nowhere.py:build"], "model.target: nowhere.py is not a file"),
        (["model.target=build"], "model.target: must look like module:attribute"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["step_scheduler.max_stepz=3"], "step_scheduler.max_stepz"),
        (
            ["checkpoint.every_steps=5"],
            "checkpoint.every_steps: is not a setting here; use step_scheduler.ckpt_every_steps",
        ),
        (["data.datasets.docs=missing.u8"], "data.datasets.docs: missing.u8 is not a file"),
        (
            ["validation.metrics.acc=ignite.metrics:Acuracy"],
            "validation.metrics.acc.target: ignite.metrics has no",
        ),
        (
            [
                "validation.metrics.top.target=ignite.metrics:TopKCategoricalAccuracy",
                "validation.metrics.top.kk=5",
            ],
            "validation.metrics.top.kk: is not an argument of ignite.metrics:TopKCategoricalAccuracy",
        ),
        (
            ["--nproc", "3", "distributed.pp_size=2"],
            "distributed.pp_size: (2) must divide the world size (3)",
        ),
    ],
)
def test_check_names_the_field_in_one_line_and_creates_nothing(project, args, field):
    before = sorted(p.name for p in project.iterdir())
    proc = hookloop("check", "my_run.yaml", *args, cwd=project, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr
    assert field in lines[0]
    assert sorted(p.name for p in project.iterdir()) == before  # no runs/, no data/


def test_check_and_train_reject_unreadable_configs_in_one_line(project):
    (project / "broken.yaml").write_text("model:\n  target: [unclosed\n")
    for args in (["check", "broken.yaml"], ["train", "broken.yaml"], ["check", "."], ["check", "none.yaml"]):
        proc = hookloop(*args, cwd=project, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("config error: config: "), (args, proc.stderr)
    # an example script's --config naming a directory: the same one line
    script = run_process(
        [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--config", "."], cwd=project
    )
    assert script.returncode == 2, script.stderr
    lines = script.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0] == "config error: config: . is a directory; pass the path of a .yaml or .toml file"
    ), script.stderr
    assert not (project / "runs").exists()


def test_resume_and_finetune_paths_resolve_a_directory_of_checkpoints_or_fail_in_one_line(project):
    """``checkpoint.resume`` / ``checkpoint.finetune_from`` naming the run's ``checkpoints`` folder
    mean its newest intact checkpoint (said in a lifecycle line); a torn step directory or a folder
    without checkpoints is one ``config error`` line, exit 2, before any directory or token cache
    of the new run exists."""
    first = hookloop("train", "my_run.yaml", cwd=project)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = project / "runs" / "my_run" / "checkpoints"
    (checkpoints / "step_00000004" / ".complete").unlink()  # torn, as if killed while writing
    fresh = ["train.run_dir=runs/second", "data.cache_dir=cache2"]
    for field, path, says in [
        ("resume", checkpoints / "step_00000004", "is incomplete (no .complete marker"),
        ("finetune_from", checkpoints / "step_00000004", "is incomplete (no .complete marker"),
        ("resume", project / "runs" / "my_run", f"(did you mean {checkpoints}?)"),
        ("resume", project / "my_models.py", "is not a directory"),
    ]:
        proc = hookloop("train", "my_run.yaml", *fresh, f"checkpoint.{field}={path}", cwd=project)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"config error: checkpoint.{field}: "), proc.stderr
        assert str(path) in lines[0] and says in lines[0], lines[0]
        assert not (project / "runs" / "second").exists() and not (project / "cache2").exists()
    # the folder of checkpoints: its newest intact one (step 8), in a new run directory
    resumed = hookloop(
        "train", "my_run.yaml", *fresh, f"checkpoint.resume={checkpoints}", "step_scheduler.max_steps=10",
        cwd=project,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint.resume {checkpoints} is a directory of checkpoints" in resumed.stderr
    assert f"resumed from {checkpoints / 'step_00000008'} (step 8)" in resumed.stderr
    assert "done: step 10, loss " in resumed.stdout
    tuned = hookloop(
        "train", "my_run.yaml", "train.run_dir=runs/third", f"checkpoint.finetune_from={checkpoints}",
        "step_scheduler.max_steps=2", cwd=project,
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert f"fine-tuning from the model weights of {checkpoints / 'step_00000008'}" in tuned.stderr


def test_config_prints_the_resolved_config_that_loads_back(project):
    proc = hookloop("config", "my_run.yaml", "optimizer.lr=0.01", cwd=project, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "  lr: 0.01  # " in out and "(default 0.0003)" in out  # value, meaning, default
    assert "  max_steps: 8  # " in out
    (project / "resolved.yaml").write_text(out)
    a = load_training_config(project / "resolved.yaml")
    b = load_training_config(project / "my_run.yaml", ["optimizer.lr=0.01"])
    b.train.run_dir = a.train.run_dir  # resolved from each file's own name
    assert a == b


def test_config_markdown_is_the_committed_reference(tmp_path):
    proc = hookloop("config", "--markdown", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (REPO / "docs" / "configuration.md").read_text(), (
        "docs/configuration.md is stale: run  hookloop config --markdown > docs/configuration.md"
    )
    assert "## fault" in proc.stdout and "`model.target`" in proc.stdout


def test_check_order_prints_the_runs_order_as_docs_concepts_shows_it(tmp_path, monkeypatch, capsys):
    """``hookloop check CONFIG --order`` prints ``trainer.describe()`` of the run the config builds,
    creating nothing; docs/concepts.md's order block is that output for the example config."""
    from hookloop.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["check", str(REPO / "examples" / "configs" / "gpt_tiny.yaml"), "--order"]) == 0
    first, *order = capsys.readouterr().out.rstrip("\n").split("\n")
    assert first.startswith("config ok: ") and list(tmp_path.iterdir()) == []
    assert "  ACT            AsyncCheckpointer._on_step_end" in order  # the save, where the code puts it
    text = (REPO / "docs" / "concepts.md").read_text()
    shown = text.split("`hookloop check examples/configs/gpt_tiny.yaml --order` prints", 1)[1]
    shown = shown.split("```text\n", 1)[1].split("\n```", 1)[0]
    assert shown.split("\n") == order, (
        "docs/concepts.md's order is stale: paste what  hookloop check examples/configs/gpt_tiny.yaml "
        "--order  prints (after its first line)"
    )


@pytest.mark.distributed
def test_torchrun_module_trains_fsdp_and_resumes(project):
    def torchrun() -> subprocess.CompletedProcess:
        args = ["train", "my_run.yaml", "distributed.dp_mode=fsdp", "train.run_dir=runs/fsdp"]
        args.append("train.local_batch_size=2")
        return run_torchrun("hookloop", 2, args, module=True, cwd=project, launcher="torchrun")

    proc = torchrun()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: step 8, loss ") == 1  # rank 0 only
    assert proc.stderr.count("[hookloop] model: my_models.py:build") == 1
    assert "world size 2 (dp 2 x tp 1 x pp 1)" in proc.stderr
    again = torchrun()
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done: step 8, no step left to train" in again.stdout


def test_a_users_engine_and_handlers_stay_theirs(tmp_path):
    """hookloop installs one name: a project's own engine.py and handlers/ keep working beside it."""
    (tmp_path / "engine.py").write_text("def train_one_epoch():\n    return 'mine'\n")
    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "__init__.py").write_text("NAME = 'my handlers'\n")
    code = (
        "import hookloop, hookloop.handlers, hookloop.train\n"
        "from engine import train_one_epoch\n"
        "from handlers import NAME\n"
        "print(train_one_epoch(), NAME, hookloop.Trainer.__module__)\n"
    )
    env = {"PYTHONPATH": ""}
    proc = run_process([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=120, fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["mine", "my", "handlers", "hookloop.engine.trainer"]
    # Outside the repository there is no top-level engine or handlers at all.
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("engine", "handlers", "examples"):
        cmd = [sys.executable, "-c", f"import {name}"]
        proc = run_process(cmd, cwd=empty, env=env, timeout=60, fresh=True)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, name


@pytest.mark.slow
def test_the_wheel_holds_only_hookloop(tmp_path):
    proc = run_process(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("hookloop-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"hookloop"}, sorted(top)
    for module in (
        "hookloop/engine/trainer.py",
        "hookloop/handlers/checkpoint/handler.py",
        "hookloop/cli.py",
    ):
        assert module in names
    info = next(t for t in top if t.endswith(".dist-info"))
    assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split() == ["hookloop"]
    entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "hookloop = hookloop.cli:run" in entry
    assert os.path.basename(wheel).startswith("hookloop-0.")


@pytest.mark.distributed
def test_a_config_error_under_torchrun_is_said_once(project):
    # Rank 0 imports the model module 3 s after rank 1 found the error and wanted to exit: its
    # line must still come (torchrun stops every worker once one exits), and only once.
    slow = "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n"
    (project / "my_models.py").write_text(slow + MY_MODEL)
    args = ["train", "my_run.yaml", "train.local_batch_size=2", "model.dimm=3"]
    proc = run_torchrun("hookloop", 2, args, module=True, cwd=project)
    assert proc.returncode != 0
    assert proc.stderr.count("config error: model.dimm: is not an argument") == 1, proc.stderr
    assert not (project / "runs").exists()


def imports_torch(result: subprocess.CompletedProcess) -> bool:
    """Whether a ``python -X importtime`` run imported torch (its import lines are on stderr)."""
    return re.search(r"^import time:.*\|\s+torch$", result.stderr, re.MULTILINE) is not None


def test_a_held_run_directory_is_refused_before_torch_model_or_data(project):
    """A second start on a busy run directory is one line and exit 2 before torch is imported or
    the model's target is called (its build would write a marker)."""
    marker = project / "built"
    (project / "marking.py").write_text(
        f"from my_models import build as real\n\ndef build(**kw):\n"
        f"    open({str(marker)!r}, 'w').close()\n    return real(**kw)\n"
    )
    config = MY_CONFIG.replace("my_models.py:build", "marking.py:build")
    (project / "marked.yaml").write_text(config)
    with RunDirLock(project / "busy"):
        result = run_process(
            [
                sys.executable,
                "-X",
                "importtime",
                "-m",
                "hookloop",
                "train",
                "marked.yaml",
                "train.run_dir=busy",
            ],
            cwd=project,
            fresh=True,
            timeout=120,
        )
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2 and said == [said[0]] and "busy is in use by another run" in said[0], said
    assert not imports_torch(result) and not marker.exists()


def test_help_is_answered_without_torch(project):
    result = run_process(
        [sys.executable, "-X", "importtime", "-m", "hookloop", "--help"], cwd=project, fresh=True, timeout=120
    )
    assert result.returncode == 0 and "train" in result.stdout and not imports_torch(result)


def test_what_a_resume_changes_in_the_handlers_is_said_once(project):
    first = hookloop("train", "my_run.yaml", "step_scheduler.max_steps=4", "ema.enabled=true", cwd=project)
    assert first.returncode == 0, first.stderr[-3000:]
    # The start's check tries the resume too; only the run says what it changed.
    changed = ("ema.enabled=true", "ema.every_steps=2", "replica_check.enabled=true")
    again = hookloop("train", "my_run.yaml", *changed, cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("ema.every_steps 1 -> 2") == 1, again.stderr
    assert again.stderr.count("handler state 'replica_check' is not in the checkpoint") == 1, again.stderr


def test_a_data_fault_on_a_model_without_floating_point_inputs_is_refused_at_the_first_step(project):
    fault = ("fault_injection.enabled=true", "fault_injection.kind=data", "fault_injection.sample=x:123456")
    out = hookloop("train", "my_run.yaml", "data.trace_samples=true", *fault, cwd=project)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: fault_injection.sample: "), out.stderr
    assert "saving step 4" not in out.stderr  # refused at step 1, not once the sample comes (or never)
