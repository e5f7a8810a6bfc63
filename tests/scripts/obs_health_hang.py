"""Two-rank run where one rank stops taking part: the HealthCheck must end the other one.

Usage (one process per rank, torchrun-style environment): obs_health_hang.py SLEEP_RANK SLEEP_STEP
SLEEP_S TIMEOUT_S. The rank ``SLEEP_RANK`` sleeps ``SLEEP_S`` seconds at STEP_END of step
``SLEEP_STEP`` before the health check runs. Every rank prints ``RESULT {json}`` and exits with the
TrainingAborted exit code (77) when the check fails.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from hookloop.engine import Events, Trainer, TrainingAborted
from hookloop.engine.parallel import init_distributed, wrap_data_parallel
from hookloop.handlers import Places
from hookloop.handlers.health_check import HealthCheck


def main() -> int:
    sleep_rank, sleep_step, sleep_s, timeout_s = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        float(sys.argv[4]),
    )
    torch.set_num_threads(1)
    info = init_distributed("gloo", timeout_s=120)
    torch.manual_seed(0)
    model = wrap_data_parallel(torch.nn.Linear(8, 1), "ddp")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss)
    health = HealthCheck(every_steps=1, timeout_s=timeout_s, exit_grace_s=20).attach(trainer)
    closed = []
    trainer.add_event_handler(Events.TRAIN_FAILED, lambda e: closed.append(type(e).__name__))

    @trainer.on(Events.STEP_END, priority=Places.HEALTH + 1)
    def stall() -> None:
        if info.rank == sleep_rank and trainer.state.step == sleep_step:
            time.sleep(sleep_s)

    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(20)]
    start = time.monotonic()
    result = {"rank": info.rank, "checks": 0, "exception_handlers": closed}
    try:
        trainer.run(data, max_steps=20)
        code = 0
    except TrainingAborted as e:
        code = e.exit_code
        result["error"] = str(e)
        result["failed_after_s"] = health.last_duration_s
    result.update(
        step=trainer.state.step, checks=health.checks, exit_code=code, elapsed_s=time.monotonic() - start
    )
    result["stop_reason"] = trainer.control.stop_reason
    result["state_exit_code"] = trainer.control.exit_code
    print("RESULT " + json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
