"""What a user sees on stderr: the lifecycle lines without set-up (in a plain script too), how the
standard ``logging`` calls redirect or silence them, setup_logging, the start-up summary of
``hookloop train`` (fresh run, final checkpoint, resume with nothing left to train), and the
per-config run directory."""

import logging
import sys
from pathlib import Path

import pytest

from hookloop.engine.logging_setup import LOGGER_NAME, install_default, setup_logging
from hookloop.handlers import load_run_config
from hookloop.train import resolve_run_dir
from tests.dist_utils import REPO, run_process

SCRIPT = REPO / "examples" / "train_gpt.py"
DEFAULT_CONFIG = REPO / "examples" / "configs" / "gpt_tiny.yaml"
LOGGER_NAMES = (LOGGER_NAME,)


@pytest.fixture
def clean_loggers():
    """setup_logging changes process-wide loggers: put them back as they were."""
    names = [*LOGGER_NAMES, "hookloop.engine.trainer.ignite"]
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in names}
    for n in LOGGER_NAMES:
        logging.getLogger(n).handlers = []
    install_default()
    yield
    for n, (level, handlers) in saved.items():
        logging.getLogger(n).setLevel(level)
        logging.getLogger(n).handlers = handlers


def test_setup_logging_twice_adds_one_handler(clean_loggers, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    first = setup_logging()
    second = setup_logging(level="DEBUG")
    assert first is second
    for name in LOGGER_NAMES:
        assert logging.getLogger(name).handlers == [first]
    assert logging.getLogger("hookloop").level == logging.DEBUG
    logging.getLogger("hookloop.handlers.checkpoint").info("resumed from x (step 3)")
    logging.getLogger("hookloop.engine.trainer").warning("slow step")
    err = capsys.readouterr().err
    assert err.count("[hookloop] resumed from x (step 3)\n") == 1
    assert "[hookloop] WARNING: slow step\n" in err


def test_setup_logging_silences_info_on_other_ranks(clean_loggers, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    setup_logging()
    logging.getLogger("hookloop.handlers.checkpoint").info("resumed from x (step 3)")
    logging.getLogger("hookloop.handlers.nan_detector").warning("rolled back")
    err = capsys.readouterr().err
    assert "resumed from" not in err
    assert "[hookloop] WARNING: rolled back" in err
    # Rank 1 shows info lines when asked to.
    setup_logging(rank_zero_only=False)
    logging.getLogger("hookloop.handlers.checkpoint").info("resumed from y")
    assert "[hookloop] resumed from y" in capsys.readouterr().err


def test_setup_logging_rejects_unknown_level(clean_loggers):
    with pytest.raises(ValueError, match="not a logging level"):
        setup_logging(level="LOUD")


def test_run_dir_defaults_to_config_stem(tmp_path):
    cfg = load_run_config(DEFAULT_CONFIG, ["train.run_dir=null"])
    assert cfg.train.run_dir is None
    assert resolve_run_dir(cfg, DEFAULT_CONFIG) == Path("runs/gpt_tiny")
    assert cfg.train.run_dir == str(Path("runs/gpt_tiny"))
    # A config that does not set run_dir gets its own directory too.
    own = tmp_path / "my_experiment.yaml"
    own.write_text("train:\n  seq_len: 32\nstep_scheduler:\n  max_steps: 10\n")
    cfg = load_run_config(own, [])
    assert resolve_run_dir(cfg, own) == Path("runs/my_experiment")
    # An explicit one is kept.
    cfg = load_run_config(own, [f"train.run_dir={tmp_path / 'mine'}"])
    assert resolve_run_dir(cfg, own) == tmp_path / "mine"


def test_second_run_resumes_and_says_nothing_is_left(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        f"train.run_dir={run_dir}",
        f"data.cache_dir={tmp_path / 'data'}",
        "model.d_model=32",
        "model.n_layers=1",
        "train.seq_len=32",
        "step_scheduler.max_steps=6",
        "lr.decay_steps=100",
        "lr.warmup_steps=0",
    ]
    first = run_process([sys.executable, str(SCRIPT), *args], timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    err = first.stderr
    assert "[hookloop] model: hookloop.models.gpt:recipe, " in err and " parameters\n" in err
    assert f"[hookloop] run directory: {run_dir}\n" in err
    assert "[hookloop] start: fresh (step 0)" in err
    assert "[hookloop] handlers: StepScheduler, AsyncCheckpointer" in err
    final = run_dir / "checkpoints" / "step_00000006"
    assert f"[hookloop] checkpoint of step 6 is complete: {final}\n" in err
    assert "done: step 6" in first.stdout and "exit code 0 (SUCCESS)" in first.stdout

    # Again: the run's records say it is finished, which is said without loading anything
    # (tests/test_cli_without_torch.py); without a record of its end, the checkpointer decides.
    again = run_process([sys.executable, str(SCRIPT), *args], timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("nothing left to train") == 1, again.stderr
    assert f"[hookloop] stopping after step 6: the checkpoint {final} is at step 6" in again.stderr
    assert "done: step 6, no step left to train, exit code 0 (SUCCESS)" in again.stdout
    (run_dir / "exit_status.json").unlink()

    second = run_process([sys.executable, str(SCRIPT), *args], timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    err = second.stderr
    assert f"[hookloop] resumed from {final} (step 6)\n" in err
    assert err.count("nothing left to train") == 1, err  # said once, as the stop reason
    assert "[hookloop] stopping after step 6: the checkpoint" in err
    assert "train.run_dir=<new dir>" in err and "checkpoint.resume=null" in err
    assert f"[hookloop] start: resuming from {final} (step 6)" in err
    # The summary follows the checkpointer's decision, so it cannot claim a fresh start.
    assert "fresh" not in err
    assert "checkpoint of step" not in err  # nothing trained, nothing saved again
    assert "done: step 6, no step left to train, exit code 0 (SUCCESS)" in second.stdout


PLAIN_SCRIPT = """
import logging, sys
import torch
from hookloop import Trainer
from hookloop.handlers import AsyncCheckpointer, StepScheduler
MODE = sys.argv[2]
if MODE == "basicConfig":
    logging.basicConfig(format="APP %(name)s: %(message)s", level=logging.INFO)
elif MODE == "quiet":
    logging.getLogger("hookloop").setLevel(logging.WARNING)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(4)]
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                  run_dir=sys.argv[1])
StepScheduler(2, 2, 1, data, max_steps=3, ckpt_every_steps=3).attach(trainer)
AsyncCheckpointer(sys.argv[1] + "/ckpt", mode="sync").attach(trainer)
state = trainer.run(data)
print("loss", state.loss, "step", state.step)
"""


@pytest.mark.parametrize("mode", ["plain", "basicConfig", "quiet"])
def test_a_plain_script_says_what_happened_without_set_up(tmp_path, mode):
    """A user's own script (no setup_logging) hears the lifecycle lines on stderr; an application
    that configures logging gets them through its own handler, once; setLevel silences them."""
    script = tmp_path / "mine.py"
    script.write_text(PLAIN_SCRIPT)
    cmd = [sys.executable, str(script), str(tmp_path / "run"), mode]
    first = run_process(cmd, timeout=120, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_process(cmd, timeout=120, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    err = second.stderr
    # A run that resumes a finished one still reports the run's last loss, not nan.
    assert first.stdout.split()[:4] == second.stdout.split()[:4]
    assert first.stdout.startswith("loss ") and "nan" not in first.stdout
    if mode == "plain":
        assert "[hookloop] checkpoint of step 3 is complete" in first.stderr
        assert "[hookloop] resumed from " in err and "(step 3)" in err
        assert err.count("nothing left to train") == 1, err
    elif mode == "basicConfig":
        assert "[hookloop]" not in err  # the application's handler took over, nothing twice
        assert "APP hookloop.handlers.checkpoint: resumed from " in err
        assert err.count("nothing left to train") == 1, err
    else:
        assert "resumed from" not in err and "nothing left to train" not in err
