"""Two-rank stop-signal run for tests/test_step_scheduler.py.

Each rank trains a tiny GPT under DDP with a StepScheduler attached and prints one JSON line per
step (what the state says at STEP_END, after the scheduler's exit check) and a final line, then
exits with ``trainer.control.exit_code``. ``--mode self``: rank ``--signal-rank`` sends SIGTERM to itself
during its first microbatch of step ``--signal-step``. ``--mode external``: nobody signals; steps
are slowed down so the test can send the signal from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

from hookloop.engine import parallel
from hookloop.engine.events import Events
from hookloop.engine.trainer import Trainer
from hookloop.handlers.step_scheduler import StepScheduler
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("self", "external"), default="self")
    parser.add_argument("--signal-rank", type=int, default=1)
    parser.add_argument("--signal-step", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    info = parallel.init_distributed("gloo", timeout_s=60)
    torch.manual_seed(0)
    model = parallel.wrap_data_parallel(
        GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=1, d_model=32, n_heads=2)), "ddp"
    )
    g = torch.Generator().manual_seed(100 + info.rank)
    data = []
    for _ in range(64):
        x = torch.randint(0, 64, (2, 17), generator=g)
        data.append((x[:, :-1], x[:, 1:]))

    scheduler = StepScheduler(
        global_batch_size=8,
        local_batch_size=2,
        dp_size=2,
        dataloader=data,
        max_steps=args.max_steps,
        ckpt_every_steps=1000,
        val_every_steps=1,
    )
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy_loss)
    trainer.set_validation(data[:2], eval_iters=1)
    scheduler.attach(trainer)
    state = trainer.state
    validated: list[int] = []

    @trainer.on(Events.STEP_START)
    def slow_down() -> None:
        if args.step_sleep:
            time.sleep(args.step_sleep)

    @trainer.on(Events.MICROBATCH)
    def send_signal() -> None:
        if (
            args.mode == "self"
            and info.rank == args.signal_rank
            and state.step == args.signal_step
            and state.microbatch == 0
        ):
            os.kill(os.getpid(), signal.SIGTERM)

    @trainer.on(Events.VALIDATION_END)
    def record_validation() -> None:
        validated.append(state.step)

    @trainer.on(Events.STEP_END)
    def record_step() -> None:
        line = {
            "rank": info.rank,
            "step": state.step,
            "decided_save": trainer.control.decided.save,
            "decided_stop": trainer.control.decided.stop,
            "validated": state.step in validated,
            "loss_avg": state.metrics.get("loss_avg"),
        }
        print(json.dumps(line), flush=True)

    trainer.run(data)
    final = {
        "rank": info.rank,
        "final": True,
        "step": state.step,
        "exit_code": int(state.control.exit_code),
        "stop_reason": state.control.stop_reason,
        "handler_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    }
    print(json.dumps(final), flush=True)
    parallel.destroy_distributed()
    return int(state.control.exit_code)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: here a gloo process sometimes aborts in C++ static teardown
    # after destroy_process_group ("terminate called without an active exception", about 1 run in
    # 12, with or without any signal), which would replace the exit code this script reports.
    os._exit(code)
