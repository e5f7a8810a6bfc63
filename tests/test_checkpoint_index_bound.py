"""``checkpoint.max_index_mb`` is a setting, not damage.

- A save whose DCP index (``.metadata``) is larger than the bound fails the run at that save with a
  config error (exit 2) naming the setting and the value needed; the checkpoint is published, so
  the same command with that value resumes from it.
- A resume that meets an intact checkpoint over the bound refuses with the same config error, never
  calls it damaged, and does not fall back to an older checkpoint (that would drop steps).
- A NaN rollback never meets one of the run's own checkpoints it cannot read: the run stopped at
  the save that wrote it (exit 2, not 76).
- ``exit_status.json`` of ``hookloop train`` says the same as the error.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hookloop.engine import Events, Trainer
from hookloop.engine.checkpoint_format.directory import is_complete, parse_step, step_dir_name
from hookloop.engine.checkpoint_format.errors import index_mb
from hookloop.engine.checkpoint_format.safe_read import SafeReader, verify_checkpoint
from hookloop.engine.errors import ConfigError, exit_code_of
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every
from tests.conftest import token_batches
from tests.test_cli import hookloop, project  # noqa: F401 - the fixture
from tests.test_rollback_known_good import build

SMALL = 0.002  # MiB: smaller than the index of the tiny GPTs here (8-30 kB)


def _trainer(seed: int = 0) -> Trainer:
    from tests.conftest import tiny_gpt

    model = tiny_gpt(seed)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy_loss)


def _needed(checkpoint) -> float:
    return index_mb((checkpoint / ".metadata").stat().st_size)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_over_the_bound_fails_the_run_at_that_save_naming_the_value(tmp_path, mode):
    trainer = _trainer()
    AsyncCheckpointer(tmp_path, mode=mode, max_index_mb=SMALL).attach(trainer)
    save_every(trainer, 2)
    with pytest.raises(ConfigError) as info:
        trainer.run(token_batches(8, seed=1), max_steps=8)
    first = tmp_path / step_dir_name(2)
    assert is_complete(first), "the checkpoint is published: the fix resumes from it"
    needed = _needed(first)
    error = info.value
    assert error.field == "checkpoint.max_index_mb" and exit_code_of(error) == 2
    assert f"at least {needed:g}" in str(error) and "damaged" not in str(error)
    # async publishes a save once it is durable, at the latest when the next one starts: the
    # run stops there, and no later checkpoint is written
    assert trainer.state.step == 2 if mode == "sync" else trainer.state.step <= 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step_")] == [first.name]

    resumed = _trainer(seed=3)
    checkpointer = AsyncCheckpointer(tmp_path, mode=mode, max_index_mb=needed).attach(resumed)
    save_every(resumed, 2)
    resumed.run(token_batches(8, seed=1), max_steps=6)
    assert checkpointer.resumed_from == str(first) and resumed.state.step == 6


def test_a_resume_over_the_bound_names_the_setting_and_does_not_fall_back(tmp_path, caplog):
    trainer = _trainer()
    AsyncCheckpointer(tmp_path, mode="sync").attach(trainer)
    save_every(trainer, 2)
    trainer.run(token_batches(8, seed=1), max_steps=4)
    newest = tmp_path / step_dir_name(4)
    refusing = _trainer(seed=3)
    checkpointer = AsyncCheckpointer(tmp_path, mode="sync", max_index_mb=SMALL).attach(refusing)
    before = {n: p.detach().clone() for n, p in refusing.model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="hookloop.handlers.checkpoint"):
        with pytest.raises(ConfigError) as info:
            refusing.run(token_batches(8, seed=1), max_steps=6)
    error = info.value
    assert error.field == "checkpoint.max_index_mb" and exit_code_of(error) == 2
    assert str(newest) in str(error) and f"at least {_needed(newest):g}" in str(error)
    assert "damaged" not in str(error)
    assert not any("damaged" in r.getMessage() for r in caplog.records), "a setting, not damage"
    assert checkpointer.resumed_from is None and refusing.state.step == 0
    assert all(torch.equal(p, before[n]) for n, p in refusing.model.named_parameters())
    # the reader alone says the same
    with pytest.raises(ConfigError, match="checkpoint.max_index_mb.*at least"):
        SafeReader(newest, index_limit=int(SMALL * 2**20)).read_metadata()
    assert not verify_checkpoint(newest)[0], "within the default bound it is intact"


def test_a_nan_rollback_never_meets_an_own_checkpoint_over_the_bound(tmp_path):
    """Today's failure: the run trained on past its oversized saves and, at its first NaN streak,
    refused every one of them as damaged (exit 76). Now it stops at the first such save (exit 2)."""
    cfg, trainer, data, attached = build(
        tmp_path,
        ["step_scheduler.ckpt_every_steps=2", "nan.max_consecutive=2", f"checkpoint.max_index_mb={SMALL}"],
        steps=12,
    )

    @trainer.on(Events.STEP_END(once=1), priority=5)
    def bad_update(engine):
        engine.model.poisoned_at.fill_(1)  # NaN from step 3 on

    with pytest.raises(ConfigError) as info:
        trainer.run(data)
    assert exit_code_of(info.value) == 2 and "checkpoint.max_index_mb" in str(info.value)
    assert "damaged" not in str(info.value)
    assert trainer.state.step < 3, "stopped at the first save, before the NaN streak"


def test_the_command_exits_2_at_the_save_and_on_resume_and_resumes_with_the_value(project):  # noqa: F811
    small = "checkpoint.max_index_mb=0.001"  # MiB: smaller than the index of this model's checkpoint
    run_dir = project / "runs" / "my_run"
    first = hookloop("train", "my_run.yaml", small, cwd=project, timeout=300)
    assert first.returncode == 2, first.stderr[-3000:]
    assert "checkpoint.max_index_mb" in first.stderr
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 2 and status["meaning"] == "CONFIG_ERROR"
    saved = run_dir / "checkpoints" / step_dir_name(parse_step(status["checkpoint"].split("/")[-1]))
    assert status["checkpoint"] == str(saved) and is_complete(saved)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_") and p != saved]
    needed = _needed(saved)
    assert f"checkpoint.max_index_mb to at least {needed:g}" in status["reason"]
    assert "damaged" not in status["reason"]

    again = hookloop("train", "my_run.yaml", small, cwd=project, timeout=300)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "damaged" not in again.stderr and f"at least {needed:g}" in again.stderr
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 2 and "checkpoint.max_index_mb" in status["reason"]
    assert "damaged" not in status["reason"]

    fixed = hookloop("train", "my_run.yaml", f"checkpoint.max_index_mb={needed:g}", cwd=project, timeout=300)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert f"resumed from {saved} (step {parse_step(saved.name)})" in fixed.stderr
    assert "done: step 8, loss " in fixed.stdout
