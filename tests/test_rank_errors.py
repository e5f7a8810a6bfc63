"""One rank's error is named on every rank: an exception in a handler on one rank is recorded as that
rank's crash (exit 1, the rank and the exception in ``exit_status.json``), not as a lost peer (77);
a rollback asked for on one rank is carried out by every rank at the same step; a stop asked for on
one rank keeps its reason in ``exit_status.json``. Real torchrun runs with 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import rank_exit_codes, run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HOOKS = '''
import json
from pathlib import Path

from hookloop import Events, Handler, Priority
from hookloop.engine import parallel


class OnOneRank(Handler):
    """At ``step`` on ``rank``: raise, ask for a rollback, or ask for a stop (``what``)."""

    asks_after_agreement = True  # asks at STEP_END on one rank: the late agreement must run

    def __init__(self, what: str, step: int = 3, rank: int = 1, run_dir: str = ".") -> None:
        self.what, self.step, self.rank, self.run_dir = what, step, rank, Path(run_dir)
        self.steps, self.acted = [], False

    def attach(self, trainer):
        trainer.add_event_handler(Events.STEP_END, self._act, priority=Priority.DEFAULT)
        trainer.add_event_handler(Events.ROLLBACK, self._rolled_back)
        trainer.add_event_handler(Events.TRAIN_END, self._write)
        return super().attach(trainer)

    def _act(self, trainer) -> None:
        self.steps.append(trainer.state.step)
        if trainer.state.step != self.step or parallel.rank() != self.rank or self.acted:
            return
        self.acted = True  # once: after a rollback to step 2, step 3 comes again
        if self.what == "raise":
            raise RuntimeError(f"boom on rank {self.rank} at step {self.step}")
        if self.what == "rollback":
            trainer.control.request_rollback(reason="a hook of one rank")
        if self.what == "stop":
            trainer.control.request_stop(f"the data of rank {self.rank} ran dry", exit_code=75)

    def _rolled_back(self, trainer) -> None:
        self.steps.append(("rolled back to", trainer.state.step))

    def _write(self, trainer) -> None:
        path = self.run_dir / f"steps-rank{parallel.rank()}.json"
        path.write_text(json.dumps(self.steps))
'''

CONFIG = """
model: {target: hookloop.models.gpt:recipe, n_layers: 1, d_model: 16, n_heads: 2}
train: {seq_len: 16, local_batch_size: 2}
step_scheduler:
  {global_batch_size: 4, max_steps: 6, num_epochs: null, ckpt_every_steps: 2, val_every_steps: null}
lr: {warmup_steps: 0, decay_style: constant}
logging: {log_interval: 1}
data: {val_samples: 0}
distributed: {timeout_s: 60, hang_timeout_s: 60}
"""


def launch(tmp_path: Path, what: str):
    (tmp_path / "hooks.py").write_text(HOOKS)
    (tmp_path / "run.yaml").write_text(CONFIG)
    run_dir = tmp_path / "run"
    args = [
        "train",
        "run.yaml",
        f"train.run_dir={run_dir}",
        "handlers=[{target: hooks.py:OnOneRank, what: " + what + "}]",
    ]
    proc = run_torchrun("hookloop", 2, args, module=True, cwd=tmp_path)
    status = json.loads((run_dir / "exit_status.json").read_text())
    return proc, status, run_dir


def test_an_exception_on_one_rank_is_that_ranks_crash_not_a_lost_peer(tmp_path):
    proc, status, _ = launch(tmp_path, "raise")
    assert status["code"] == 1 and status["meaning"] == "ERROR", status
    assert status["rank"] == 1, status
    assert "RuntimeError: boom on rank 1 at step 3" in status["reason"], status
    assert "rank 1" in proc.stderr and "lost" not in status["reason"]
    # every worker exits 1: no rank reports a lost peer (77), which a job script would requeue
    codes = rank_exit_codes(proc.stderr)
    assert 77 not in codes and 1 in codes, proc.stderr[-3000:]


def test_a_rollback_asked_for_on_one_rank_is_carried_out_by_every_rank(tmp_path):
    proc, status, run_dir = launch(tmp_path, "rollback")
    assert proc.returncode == 0 and status["code"] == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        steps = json.loads((run_dir / f"steps-rank{rank}.json").read_text())
        assert ["rolled back to", 2] in steps, (rank, steps)  # the step-2 checkpoint, on both ranks
        assert steps[-1] == 6, steps


def test_a_stop_asked_for_on_one_rank_keeps_its_reason(tmp_path):
    proc, status, _ = launch(tmp_path, "stop")
    assert status["code"] == 75 and status["step"] == 3, status
    assert "the data of rank 1 ran dry" in status["reason"], status
