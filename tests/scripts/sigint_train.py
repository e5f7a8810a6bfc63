"""Trains until Ctrl-C; the test sends SIGINT once or twice.

Usage: sigint_train.py RUN_DIR. Writes RUN_DIR/ready after step 5; each step sleeps 50 ms so a
signal lands mid-run. Prints ``RESULT {json}`` and exits with the run's code (130 on an interrupt).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import torch

from hookloop.engine import Events, Trainer
from hookloop.handlers.checkpoint import AsyncCheckpointer


def main() -> int:
    # Ctrl-C works as in a terminal even when the test runner was started with SIGINT ignored (a
    # background job): an ignored disposition survives exec, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_dir = Path(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss,
                      run_dir=run_dir)  # fmt: skip
    checkpointer = AsyncCheckpointer(run_dir / "checkpoints", mode="sync").attach(trainer)
    trainer.add_event_handler(Events.STEP_END, lambda: time.sleep(0.05))
    trainer.add_event_handler(Events.STEP_END(once=5), lambda: (run_dir / "ready").write_text("1"))
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(16)]
    try:
        state = trainer.run(data, max_steps=100_000)
    except KeyboardInterrupt:
        print("RESULT " + json.dumps({"interrupted": True, "step": trainer.state.step}), flush=True)
        return 130
    saved = checkpointer.last_saved_step
    print(
        "RESULT " + json.dumps({"step": state.step, "saved": saved, "reason": state.control.stop_reason}),
        flush=True,
    )
    return int(state.control.exit_code)


if __name__ == "__main__":
    sys.exit(main())
