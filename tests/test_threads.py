"""The thread settings of the ``hookloop`` command: passive OpenMP waits set before torch loads its
OpenMP runtime (which reads them then), kept when the environment names them, one thread when a
script imported torch first, said in the start-up summary; and the ``hookloop`` package imports no
torch until one of its names is used. Every process here is a
fresh interpreter (``fresh=True``): the test commands' fork server has torch loaded already."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hookloop import threads
from hookloop.engine.data import prepare_tokens
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


def _env(**variables: str) -> dict[str, str | None]:
    # Neither variable unless given; the OpenMP runtime prints what it read as it loads.
    return {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None, "OMP_DISPLAY_ENV": "VERBOSE", **variables}


def _runtime(stderr: str, name: str) -> str:
    """A setting as the OpenMP runtime read it when it loaded (OMP_DISPLAY_ENV)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip().startswith(f"{name} = ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0].split("'")[1]


# What users write; helpers (config checks, data sets, logging set-up, ...) stay in their modules.
PUBLIC = [
    "Trainer", "Events", "Priority", "Place", "PlaceError", "Handler", "TrainState", "StepControl",
    "ExitCode", "ConfigError", "HookloopError", "StartRefused", "TrainingAborted", "StepBody",
    "StepResult", "EvalResult", "StepContext", "LocalStepBody", "init_distributed",
    "wrap_data_parallel", "apply_tensor_parallel", "PipelineConfig", "build_pipeline",
    "build_lr_scheduler", "TokenAccuracy", "RecordFile",
]  # fmt: skip


def test_the_public_names_are_pinned():
    """Adding a name to ``hookloop.__all__`` is a decision: this list changes with it."""
    import hookloop
    import hookloop.engine as engine

    assert sorted(hookloop.__all__) == sorted([*PUBLIC, "__version__"])
    assert sorted(engine.__all__) == sorted(PUBLIC)
    for name in ("check_int", "load_config", "validate_sections", "setup_logging", "agree_any", "Validator"):
        with pytest.raises(AttributeError):
            getattr(hookloop, name)


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


def _train(project: Path, *args: str, env: dict[str, str], code: str | None = None):
    command = ["-c", code] if code else ["-m", "hookloop", "train", "run.yaml"]
    proc = run_process([sys.executable, *command, *args], cwd=project, env=env, timeout=180, fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_command_starts_torch_with_sleeping_waits_unless_the_environment_or_config_says(project):
    ours = _train(project, "train.run_dir=runs/a", env=_env())
    # GNU OpenMP's spin count is 0 with passive waits (300000 by default): set before it loaded.
    assert _runtime(ours.stderr, "GOMP_SPINCOUNT") == "0", "OMP_WAIT_POLICY was not set before torch loaded"
    cores = os.cpu_count()
    assert _runtime(ours.stderr, "OMP_NUM_THREADS") == str(cores)
    assert (
        f"[hookloop] threads: {cores} intra-op (torch's default, one per core); "
        "waits: passive (hookloop's default)"
    ) in ours.stderr
    theirs = _train(project, "train.run_dir=runs/b", env=_env(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="active"))
    assert _runtime(theirs.stderr, "OMP_NUM_THREADS") == "1"
    assert _runtime(theirs.stderr, "OMP_WAIT_POLICY") == "ACTIVE"
    assert (
        "[hookloop] threads: 1 intra-op (OMP_NUM_THREADS=1 in the environment); "
        "waits: OMP_WAIT_POLICY=active in the environment"
    ) in theirs.stderr
    configured = _train(project, "train.run_dir=runs/c", "train.num_threads=1", env=_env())
    assert "[hookloop] threads: 1 intra-op (train.num_threads); waits: passive" in configured.stderr


def test_a_script_that_imported_torch_first_trains_with_one_thread(project):
    # The runtime started with spinning waits: the run is built with torch.set_num_threads(1).
    code = (
        "import torch, sys\n"
        "from hookloop.cli import run\n"
        "sys.argv = ['train', 'train', 'run.yaml', 'train.run_dir=runs/late']\n"
        "run()\n"
    )
    late = _train(project, env=_env(), code=code)
    assert _runtime(late.stderr, "GOMP_SPINCOUNT") == "300000"
    assert "[hookloop] threads: 1 intra-op (hookloop's default when torch was imported first" in late.stderr
    assert "waits: spinning (the OpenMP runtime's default: torch was imported first)" in late.stderr


def test_apply_environment_changes_nothing_once_torch_is_imported():
    import torch  # noqa: F401  (as a training script that imported torch first)

    environ: dict[str, str] = {}
    assert threads.apply_environment(environ) is False and environ == {}
    assert threads.chosen(None, {"OMP_NUM_THREADS": "4"}) is None
    assert threads.chosen(None, {"OMP_WAIT_POLICY": "passive"}) is None
    assert threads.chosen(None, {}) == threads.FALLBACK_THREADS
    assert threads.chosen(3, {"OMP_NUM_THREADS": "4"}) == 3
