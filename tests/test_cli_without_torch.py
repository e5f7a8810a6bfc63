"""The answers ``hookloop`` gives without importing torch (or ignite): ``--help``, ``config``, an
unknown key, a wrong value, a held run directory and a finished run (issue 43, item 2). Each row
runs the real command in a fresh interpreter and reads, after ``cli.main`` returned, whether torch
was imported (``tests/test_architecture.py`` imports the config layer itself without torch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hookloop.engine.run_lock import RunDirLock
from tests.dist_utils import run_process

NO_TORCH = {"code": 0, "torch": False, "ignite": False}
# cli.main in a fresh interpreter, then what it imported (stderr's last line)
WRAP = (
    "import json, sys\n"
    "from hookloop import cli\n"
    "try:\n"
    "    code = cli.main(sys.argv[1:])\n"
    "except SystemExit as e:\n"
    "    code = e.code\n"
    "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules, 'ignite': 'ignite' in sys.modules}),"
    " file=sys.stderr)\n"
)

MODEL = """
import torch

def build(dim: int = 8, seq_len: int = 8, vocab: int = 256):
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))
"""

CONFIG = """
model:
  target: tiny_model.py:build
train:
  seq_len: 8
  local_batch_size: 2
step_scheduler:
  global_batch_size: 2
  max_steps: 1
  ckpt_every_steps: 1
lr:
  warmup_steps: 0
data:
  cache_dir: data
  val_samples: 2
"""


def hookloop(*args: str, cwd: Path) -> tuple[dict, str, str]:
    """Exit code and whether torch / ignite were imported, stdout, stderr (without that line)."""
    out = run_process([sys.executable, "-c", WRAP, *args], cwd=cwd, timeout=180, fresh=True)
    *lines, last = out.stderr.rstrip("\n").splitlines() or [""]
    return json.loads(last), out.stdout, "\n".join(lines)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tiny_model.py").write_text(MODEL)
    (tmp_path / "run.yaml").write_text(CONFIG)
    return tmp_path


def test_help_config_and_refusals_are_answered_without_torch(project):
    said, out, _ = hookloop("--help", cwd=project)
    assert said == NO_TORCH and "usage: hookloop" in out
    said, out, _ = hookloop("config", cwd=project)
    assert said == NO_TORCH
    assert "step_scheduler:" in out and "max_steps: null" in out
    said, out, _ = hookloop("config", "run.yaml", "nan.action=raise", cwd=project)
    assert said == NO_TORCH and "action: raise" in out
    said, out, _ = hookloop("config", "--markdown", cwd=project)
    assert said == NO_TORCH and out.startswith("# Configuration reference")
    for command in ("check", "train"):
        said, _, err = hookloop(command, "run.yaml", "train.bogus=1", cwd=project)
        assert said == {**NO_TORCH, "code": 2}
        assert err.startswith("config error: train.bogus: Key 'bogus' not in 'TrainConfig'"), err
        said, _, err = hookloop(command, "run.yaml", "nan.action=foo", cwd=project)
        assert said == {**NO_TORCH, "code": 2}
        assert err == "config error: nan.action: must be one of 'warn', 'raise', 'rollback', got 'foo'"
    with RunDirLock(project / "busy"):
        said, _, err = hookloop("train", "run.yaml", "train.run_dir=busy", cwd=project)
    assert said == {**NO_TORCH, "code": 2}
    assert err.startswith("config error: train.run_dir:") and "busy" in err, err
    assert not (project / "data").exists()  # nothing was prepared for a refused start


def test_a_finished_run_is_answered_from_its_records_without_torch(project):
    said, out, err = hookloop("train", "run.yaml", cwd=project)
    assert said["code"] == 0 and said["torch"], err[-3000:]
    assert "done: step 1, loss " in out
    records = {p.name: p.stat().st_mtime_ns for p in (project / "runs" / "run").iterdir()}

    said, out, err = hookloop("train", "run.yaml", cwd=project)
    assert said == NO_TORCH, err
    assert out == "done: step 1, no step left to train, exit code 0 (SUCCESS)\n"
    assert "nothing left to train, this run is finished" in err and "step_00000001" in err
    # nothing of the run's record was written again
    assert {p.name: p.stat().st_mtime_ns for p in (project / "runs" / "run").iterdir()} == records

    # A run whose last start did not end cleanly is not finished for certain: the full start decides.
    status = project / "runs" / "run" / "exit_status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "code": 75}))
    said, out, err = hookloop("train", "run.yaml", cwd=project)
    assert said["code"] == 0 and said["torch"], err[-3000:]
    assert "done: step 1, no step left to train" in out
    # Nor is a changed setting (the full start honours it or refuses it by name).
    said, out, err = hookloop("train", "run.yaml", "optimizer.lr=0.001", cwd=project)
    assert said["code"] == 0 and said["torch"], err[-3000:]
    assert "done: step 1, no step left to train" in out


def test_a_finished_run_whose_newest_checkpoint_is_damaged_is_not_answered_finished(project):
    said, out, err = hookloop("train", "run.yaml", "step_scheduler.max_steps=2", cwd=project)
    assert said["code"] == 0, err[-3000:]
    newest = project / "runs" / "run" / "checkpoints" / "step_00000002"
    data = next(newest.glob("*.distcp"))
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40  # one flipped bit: the size is right, the checksum is not
    data.write_bytes(damaged)

    # The full start falls back to the checkpoint of step 1 and trains step 2 again: not finished.
    said, out, err = hookloop("train", "run.yaml", "step_scheduler.max_steps=2", cwd=project)
    assert said["code"] == 0 and said["torch"], err[-3000:]
    assert "nothing left to train" not in err and "done: step 2, loss " in out, out + err[-3000:]
