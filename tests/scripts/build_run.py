"""``build(cfg, handlers=[hook])`` then ``run.run()`` under torchrun: the hook, passed in Python,
records what it saw on every rank into ``<run_dir>/hook-rank<R>.json``.

    torchrun --nproc-per-node 2 tests/scripts/build_run.py CONFIG [overrides]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hookloop import Events, Handler
from hookloop.engine import parallel
from hookloop.engine.parallel import exit_process
from hookloop.train import build, load_training_config


class Seen(Handler):
    """Stateful: the steps it saw, checkpointed with the run."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def attach(self, trainer):
        trainer.add_event_handler(Events.STEP_END, lambda: self.steps.append(trainer.state.step))
        trainer.add_event_handler(Events.TRAIN_END, self._write)
        return super().attach(trainer)

    def _write(self) -> None:
        state = self.trainer.state
        row = {"steps": self.steps, "loss": float(state.loss), "model": type(self.trainer.model).__name__}
        path = Path(self.trainer.run_dir) / f"hook-rank{parallel.rank()}.json"
        path.write_text(json.dumps(row))

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = list(state["steps"])


def main() -> int:
    cfg = load_training_config(sys.argv[1], sys.argv[2:])
    with build(cfg, handlers=[Seen()]) as run:
        assert run.trainer.handlers[-1].__class__ is Seen
        return run.run()


if __name__ == "__main__":
    exit_process(main())
