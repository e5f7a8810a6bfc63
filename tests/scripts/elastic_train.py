"""The map-style data path under any number of data-parallel ranks, for the elastic-data tests.

``python tests/scripts/elastic_train.py RUN_DIR --steps N [--step-sleep S]`` (or under torchrun):
a plain ``DataLoader(mixture, batch_size=2, sampler=MixtureSampler(...))`` without workers, a
global batch of 8 samples per step (grad_accum_steps = 8 / (2 x ranks)), DDP when there are several
ranks, a checkpoint every 2 steps in RUN_DIR/checkpoints (resumed from when there is one) and the
sample trace in RUN_DIR. Prints ``RESUMED AT <step>`` at the start and ``STEP <n>`` after each step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from hookloop.engine import Events, Trainer
from hookloop.engine.data import MixtureDataset, MixtureSampler, SampleTrace
from hookloop.engine.parallel import init_distributed, wrap_data_parallel
from hookloop.handlers import Places
from hookloop.handlers.checkpoint import AsyncCheckpointer
from hookloop.models.gpt import cross_entropy_loss
from tests.cadence import save_every

GLOBAL_BATCH, MICROBATCH = 8, 2


def samples(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (n, 9), generator=g)
    return [(row[:-1], row[1:]) for row in x]


def prepare(microbatch, device):
    return microbatch[0].to(device), microbatch[1].to(device)  # the source index comes third


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    info = init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    if info.world_size > 1:
        model = wrap_data_parallel(model, "ddp")
    mixture = MixtureDataset({"a": samples(200, 1), "b": samples(120, 2)})
    sampler = MixtureSampler(
        mixture, {"a": 2.0, "b": 1.0}, seed=3, rank=info.rank, world_size=info.world_size
    )
    loader = torch.utils.data.DataLoader(mixture, batch_size=MICROBATCH, sampler=sampler)
    accum = GLOBAL_BATCH // (MICROBATCH * info.world_size)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        cross_entropy_loss,
        grad_accum_steps=accum,
        prepare_batch=prepare,
    )
    checkpointer = AsyncCheckpointer(os.path.join(args.run_dir, "checkpoints"), mode="sync")
    checkpointer.attach(trainer)
    save_every(trainer, 2)
    SampleTrace(args.run_dir, loader, rank=info.rank, world_size=info.world_size).attach(trainer)

    @trainer.on(Events.TRAIN_START, priority=Places.RESUME - 1)
    def _report(engine: Trainer) -> None:
        if info.rank == 0:
            print(f"RESUMED AT {engine.state.step}", flush=True)

    @trainer.on(Events.STEP_END, priority=-100)
    def _progress(engine: Trainer) -> None:
        print(f"STEP {engine.state.step}", flush=True)
        time.sleep(args.step_sleep)  # room for a test to kill the run mid-way

    trainer.run(loader, max_steps=args.steps)
    checkpointer.close()
    if info.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
