"""Two DDP ranks train with async checkpoints on storage made slow, under a 2 s HealthCheck bound.

Usage (torchrun-style environment): slow_storage.py RUN_DIR STEPS [EVERY]

Saves every EVERY steps (default 2) into RUN_DIR/checkpoints and resumes from there. The
environment makes storage slow, on the ranks listed in ``SLOW_RANKS`` (default all), by sleeping
inside the write and verify paths: ``SLOW_WRITE_S`` seconds in each DCP write once its files are
durable, before it lists them (the writer thread), ``SLOW_VERIFY_S`` seconds each time a
checkpoint is verified on load. Marker files in RUN_DIR tell a test when to strike:
``slow-write-rank<R>`` once a slow write has begun, ``finish-wait-rank<R>`` once the training
thread waits for a save still on disk, and ``pid-rank<R>`` (the process id) once training started.
Exits with the run's exit code.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

from hookloop.engine import TrainingAborted
from hookloop.engine.checkpoint_format.manifest import RecordingWriter
from hookloop.engine.parallel import exit_process, init_distributed, wrap_data_parallel
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.handlers.checkpoint import reader as checkpoint_reader
from hookloop.handlers.checkpoint.writer import CheckpointWriter
from hookloop.handlers.health_check import HealthCheck
from tests.cadence import save_every


def main() -> int:
    # Ctrl-C works as in a terminal even when the test runner was started with SIGINT ignored (a
    # background job): an ignored disposition survives exec, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    torch.set_num_threads(1)
    info = init_distributed("gloo", timeout_s=120)
    rank = info.rank
    slow_ranks = {int(r) for r in os.environ.get("SLOW_RANKS", "0,1").split(",") if r}
    slow_write = float(os.environ.get("SLOW_WRITE_S", "0"))
    slow_verify = float(os.environ.get("SLOW_VERIFY_S", "0"))
    if rank in slow_ranks and slow_write:
        record = RecordingWriter._record

        def slow_record(self, names):
            (run_dir / f"slow-write-rank{rank}").write_text(str(time.time()))
            time.sleep(slow_write)
            return record(self, names)

        RecordingWriter._record = slow_record
    if rank in slow_ranks and slow_verify:
        verify = checkpoint_reader.verify_checkpoint

        def slow_verify_checkpoint(*args, **kwargs):
            time.sleep(slow_verify)
            return verify(*args, **kwargs)

        checkpoint_reader.verify_checkpoint = slow_verify_checkpoint
    finish = CheckpointWriter.finish

    def marked_finish(self, wait):
        if wait and not self.inflight.done.done():  # publishing waits for a write still on disk
            (run_dir / f"finish-wait-rank{rank}").write_text(str(time.time()))
        return finish(self, wait)

    CheckpointWriter.finish = marked_finish

    torch.manual_seed(0)
    model = wrap_data_parallel(torch.nn.Linear(64, 64), "ddp")
    from hookloop.engine import Events, Trainer

    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.nn.functional.mse_loss,
        run_dir=run_dir,
    )
    AsyncCheckpointer(run_dir / "checkpoints", keep_last=3).attach(trainer)
    save_every(trainer, every)
    HealthCheck(every_steps=1, timeout_s=2.0).attach(trainer)

    @trainer.on(Events.STEP_END)
    def pace(engine):  # steps of ~0.1 s: a save is still on disk a few steps later
        if engine.state.step == 1:
            (run_dir / f"pid-rank{rank}").write_text(str(os.getpid()))
        time.sleep(0.1)

    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)) for _ in range(64)]
    try:
        state = trainer.run(data, max_steps=steps)
    except TrainingAborted as e:
        print(f"aborted: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    trainer.get_handler(AsyncCheckpointer).close()
    print(f"done: step {state.step}, exit code {int(state.control.exit_code)}", flush=True)
    return int(state.control.exit_code)


if __name__ == "__main__":
    exit_process(main())
