"""The thread settings of the ``hookloop`` command: made before torch loads its OpenMP runtime (which
reads them then), kept when the environment names them, said in the start-up summary; and the
``hookloop`` package imports no torch until one of its names is used. Every process here is a
fresh interpreter (``fresh=True``): the test commands' fork server has torch loaded already."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hookloop import threads
from hookloop.engine import prepare_tokens
from tests.dist_utils import run_process

CONFIG = """
model:
  target: hookloop.models.gpt:recipe
  n_layers: 1
  d_model: 16
  n_heads: 2
train:
  seq_len: 16
  local_batch_size: 2
step_scheduler:
  global_batch_size: 2
  max_steps: 2
  ckpt_every_steps: null
  val_every_steps: null
data:
  datasets:
    docs: docs.u8
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "run.yaml").write_text(CONFIG)
    prepare_tokens(["".join(chr(c) for c in range(32, 127)) * 40], tmp_path / "docs.u8")
    return tmp_path


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in threads.ENVIRONMENT}
    return {**env, "OMP_DISPLAY_ENV": "VERBOSE", **variables}  # the runtime prints what it read


def test_importing_hookloop_and_its_command_imports_no_torch_until_a_name_is_used(tmp_path):
    code = (
        "import sys, hookloop, hookloop.cli\n"
        "from hookloop import threads\n"
        "assert 'torch' not in sys.modules, 'torch imported by hookloop or hookloop.cli'\n"
        "import hookloop.engine as engine\n"
        "assert sorted(hookloop.__all__) == sorted([*engine.__all__, '__version__'])\n"
        "names = {}\n"
        "exec('from hookloop import *', names)\n"
        "assert all(names[n] is getattr(engine, n) for n in engine.__all__)\n"
        "assert hookloop.Trainer is engine.Trainer and 'Trainer' in dir(hookloop)\n"
        "try:\n"
        "    hookloop.Trainr\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    proc = run_process([sys.executable, "-c", code], cwd=tmp_path, timeout=120, fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert "module 'hookloop' has no attribute 'Trainr'" in proc.stdout


def test_the_command_sets_its_wait_default_before_torch_loads_and_keeps_the_users(project):
    ours = run_process(
        [sys.executable, "-m", "hookloop", "check", "run.yaml"], cwd=project, env=_env(), timeout=120, fresh=True
    )
    assert ours.returncode == 0, ours.stderr
    assert f"GOMP_SPINCOUNT = '{threads.ENVIRONMENT['GOMP_SPINCOUNT']}'" in ours.stderr, ours.stderr
    theirs = run_process(
        [sys.executable, "-m", "hookloop", "check", "run.yaml"],
        cwd=project,
        env=_env(GOMP_SPINCOUNT="77"),
        timeout=120,
        fresh=True,
    )
    assert theirs.returncode == 0, theirs.stderr
    assert "GOMP_SPINCOUNT = '77'" in theirs.stderr, theirs.stderr


def test_the_start_up_summary_says_the_threads_and_where_their_settings_came_from(project):
    env = _env(OMP_NUM_THREADS="2")
    proc = run_process(
        [sys.executable, "-m", "hookloop", "train", "run.yaml"], cwd=project, env=env, timeout=180, fresh=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spin = threads.ENVIRONMENT["GOMP_SPINCOUNT"]
    assert f"[hookloop] threads: 2 intra-op thread(s); waits: GOMP_SPINCOUNT={spin} (hookloop's default)" in (
        proc.stderr
    ), proc.stderr[-3000:]
    # A script that imported torch first: the runtime's own settings, and the summary says why.
    code = (
        "import torch, sys\n"
        "from hookloop.cli import run\n"
        "sys.argv = ['train', 'train', 'run.yaml', 'train.run_dir=runs/late']\n"
        "run()\n"
    )
    late = run_process([sys.executable, "-c", code], cwd=project, env=env, timeout=180, fresh=True)
    assert late.returncode == 0, late.stderr[-3000:]
    assert f"GOMP_SPINCOUNT = '{spin}'" not in late.stderr and "GOMP_SPINCOUNT = '300000'" in late.stderr
    assert "waits: the OpenMP runtime's defaults (torch was imported before hookloop" in late.stderr


def test_apply_environment_changes_nothing_once_torch_is_imported():
    import torch  # noqa: F401  (as a training script that imported torch first)

    environ: dict[str, str] = {}
    assert threads.apply_environment(environ) == {} and environ == {}
