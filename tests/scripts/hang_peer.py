"""Two ranks train a tiny DDP model for a long time; the test stops or kills one of them.

Usage (torchrun-style environment, or under torchrun): hang_peer.py RUN_DIR MODE
MODE: ``health`` (HealthCheck every step, timeout 5 s), ``watchdog`` (no health check, the
trainer's hang_timeout_s=5). Each rank writes ``RUN_DIR/pid-rank<R>`` once it has trained 20
steps, so the test knows when to strike. Exits with the code the run ends with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hookloop.engine import Events, Trainer, TrainingAborted
from hookloop.engine.parallel import exit_process, init_distributed, wrap_data_parallel
from hookloop.handlers.health_check import HealthCheck


def main() -> int:
    run_dir, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    info = init_distributed("gloo", timeout_s=300)
    torch.manual_seed(0)
    model = wrap_data_parallel(torch.nn.Linear(8, 1), "ddp")
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        torch.nn.functional.mse_loss,
        run_dir=run_dir,
        hang_timeout_s=5.0 if mode == "watchdog" else 600.0,
    )
    if mode == "health":
        HealthCheck(every_steps=1, timeout_s=5.0).attach(trainer)

    @trainer.on(Events.STEP_END(once=20))
    def ready() -> None:
        (run_dir / f"pid-rank{info.rank}").write_text(str(__import__("os").getpid()))

    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(64)]
    try:
        state = trainer.run(data, max_steps=10_000_000)
        return int(state.control.exit_code)
    except TrainingAborted as e:
        print(f"aborted: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    exit_process(main())
