"""A small deterministic training run with an AsyncCheckpointer, for the kill/resume tests.

``python tests/scripts/ckpt_train.py DIR STEPS OUT [--mode async] [--every 2] [--stall-staging-at N]
[--save-steps 5,10] [--stall-publish STEP:WHERE] [--ddp]``: trains the tiny GPT for STEPS optimizer
steps (resuming from DIR's newest complete checkpoint), saving every 2 steps (``--every``; or at the
``--save-steps`` and the last step), printing ``STEP n`` after each step and ``RESUMED path`` when
it resumed; at the end writes the parameters and optimizer state to OUT (``torch.save``; read back
with ``weights_only=True``). ``--stall-staging-at N``: the copy to host memory of step N's save
never starts, and ``STAGING N`` is printed when the next optimizer step has to wait for it (a test
kills the process there). ``--stall-publish STEP:WHERE``: publishing step STEP's save stops for good
at WHERE (``marker``: its completion marker written, not yet renamed; ``rename``: renamed to
``step_N``, ``latest`` not yet moved), after printing ``PUBLISHING STEP WHERE THREAD`` (a test kills
the process there, once training went on without it; ``STEP_START n`` is printed as each step
starts, and the step after a save waits until its files are durable). ``--ddp``: join the process
group the torchrun environment describes and train with DistributedDataParallel (each rank writes
OUT with its rank appended).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from hookloop.engine import Events, Trainer
from hookloop.handlers import Places, Priority
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss
from tests.cadence import save_every


class GatedStager(DefaultStager):
    """DCP's stager (as the checkpointer uses it on CPU) whose copy to host memory starts only while
    ``gate`` is open: holds a save's staging in flight for as long as a test needs."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(False, False, False, False))
        self.gate = threading.Event()
        self.gate.set()

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if not self.gate.wait(timeout=120):
            raise TimeoutError("the test never opened the staging gate")
        return super().stage(state_dict, **kwargs)


def build(
    directory: str | None,
    mode: str = "async",
    every_steps: int = 2,
    ddp: bool = False,
    save_steps: tuple[int, ...] = (),
) -> tuple[Trainer, AsyncCheckpointer | None]:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    random.seed(0)  # every RNG the checkpoint holds starts the same in every process
    np.random.seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2))
    if ddp:
        from hookloop.engine.parallel import init_distributed, wrap_data_parallel

        init_distributed()
        model = wrap_data_parallel(model, "ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    trainer = Trainer(model, optimizer, cross_entropy_loss, lr_scheduler=scheduler, grad_accum_steps=2)
    checkpointer = None
    if directory is not None:
        checkpointer = AsyncCheckpointer(directory, keep_last=2, mode=mode)
        checkpointer.attach(trainer)
        if save_steps:  # these steps only (and the last)

            @trainer.on(Events.STEP_START)
            def _save_at(engine: Trainer) -> None:
                if engine.state.step in save_steps:
                    engine.control.request_save(f"step {engine.state.step}")

        else:
            save_every(trainer, every_steps)
    return trainer, checkpointer


def loader() -> torch.utils.data.DataLoader:
    """14 samples of 2 sequences: 7 steps per epoch, reshuffled every epoch from its generator."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (14, 17), generator=g)
    pairs = list(zip(x[:, :-1], x[:, 1:]))
    return torch.utils.data.DataLoader(
        pairs, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(2)
    )


def say(line: str) -> None:
    """Print ``line`` in one write (the writer thread may print meanwhile)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def stall_publish(step: str, where: str) -> None:
    """Publishing the save of ``step`` stops for good at ``where`` (see the module docstring)."""
    import os
    import time

    from hookloop.handlers.checkpoint import store

    name = f"step_{int(step):08d}"
    original = store.write_json_atomic if where == "marker" else store.write_latest

    def stall(*args: Any) -> None:
        if where == "marker":
            original(*args)
        if name in os.fspath(args[0 if where == "marker" else 1]):
            say(f"PUBLISHING {int(step)} {where} {threading.current_thread().name}")
            time.sleep(600)  # killed here
        if where != "marker":
            original(*args)

    setattr(store, "write_json_atomic" if where == "marker" else "write_latest", stall)


def final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, s in enumerate(trainer.optimizer.state.values()):
        for k, v in s.items():
            out[f"optim/{i}/{k}"] = torch.as_tensor(v).clone()
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--mode", default="async")
    parser.add_argument("--stall-staging-at", type=int, default=None)
    parser.add_argument("--every", type=int, default=2, help="save every this many steps")
    parser.add_argument("--save-steps", default="", help="save at these steps only: 5,10")
    parser.add_argument("--stall-publish", default=None)
    parser.add_argument("--ddp", action="store_true")
    args = parser.parse_args(argv)
    save_steps = tuple(int(step) for step in args.save_steps.split(",") if step)
    trainer, checkpointer = build(args.directory, args.mode, args.every, ddp=args.ddp, save_steps=save_steps)
    if args.stall_publish is not None:
        stall_publish(*args.stall_publish.split(":"))
    if args.stall_staging_at is not None:
        stager = checkpointer._writer.stager = GatedStager()

        @trainer.on(Events.STEP_END, priority=Places.CHECKPOINT + 1)
        def _stall(engine: Trainer) -> None:  # before the checkpointer starts this step's save
            if engine.state.step == args.stall_staging_at:
                stager.gate.clear()

        @trainer.on(Events.BEFORE_OPTIMIZER_STEP, priority=Priority.DEFAULT)
        def _report_staging(_engine: Trainer) -> None:  # the staging wait comes right after this
            if checkpointer.staging:
                say(f"STAGING {checkpointer.last_saved_step}")

    if args.stall_publish is not None:

        @trainer.on(Events.STEP_START)
        def _starting(engine: Trainer) -> None:
            say(f"STEP_START {engine.state.step}")
            save = checkpointer._writer.inflight  # on a loaded machine the writer may lag many steps:
            if save is not None and not checkpointer._writer.released:  # durable, released at this end
                save.done.result(timeout=120)

    @trainer.on(Events.STEP_END, priority=-100)
    def _progress(engine: Trainer) -> None:
        say(f"STEP {engine.state.step}")
        if checkpointer.saving:  # the background write of this step's save has just started
            say(f"SAVING {engine.state.step}")

    @trainer.on(Events.TRAIN_START, priority=-100)
    def _report(_engine: Trainer) -> None:
        if checkpointer.resumed_from:
            say(f"RESUMED {checkpointer.resumed_from}")

    trainer.run(loader(), max_steps=args.steps)
    checkpointer.close()
    if args.ddp:
        import torch.distributed as dist

        args.out = f"{args.out}.{dist.get_rank()}"
        dist.destroy_process_group()
    torch.save(final_state(trainer), args.out)
    say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
