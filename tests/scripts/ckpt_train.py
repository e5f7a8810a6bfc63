"""A small deterministic training run with an AsyncCheckpointer, for the kill/resume tests.

``python tests/scripts/ckpt_train.py DIR STEPS OUT [--mode async]``: trains the tiny GPT for STEPS
optimizer steps (resuming from DIR's newest complete checkpoint), saving every 2 steps, printing
``STEP n`` after each step and ``RESUMED path`` when it resumed; at the end writes the parameters and
optimizer state to OUT (``torch.save``; read back with ``weights_only=True``).
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np
import torch

from engine import Events, Trainer
from examples.models.gpt import GPT, GPTConfig, cross_entropy_loss
from handlers.checkpoint import AsyncCheckpointer


def build(
    directory: str | None, mode: str = "async", every_steps: int = 2
) -> tuple[Trainer, AsyncCheckpointer | None]:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    random.seed(0)  # every RNG the checkpoint holds starts the same in every process
    np.random.seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    trainer = Trainer(model, optimizer, cross_entropy_loss, lr_scheduler=scheduler, grad_accum_steps=2)
    checkpointer = None
    if directory is not None:
        checkpointer = AsyncCheckpointer(directory, every_steps=every_steps, keep_last=2, mode=mode)
        checkpointer.attach(trainer)
    return trainer, checkpointer


def loader() -> torch.utils.data.DataLoader:
    """14 samples of 2 sequences: 7 steps per epoch, reshuffled every epoch from its generator."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (14, 17), generator=g)
    pairs = list(zip(x[:, :-1], x[:, 1:]))
    return torch.utils.data.DataLoader(
        pairs, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(2)
    )


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
    args = parser.parse_args(argv)
    trainer, checkpointer = build(args.directory, args.mode)

    @trainer.on(Events.STEP_END, priority=-100)
    def _progress(engine: Trainer) -> None:
        print(f"STEP {engine.state.step}", flush=True)
        if checkpointer.saving:  # the background write of this step's save has just started
            print(f"SAVING {engine.state.step}", flush=True)

    @trainer.on(Events.TRAIN_START, priority=-100)
    def _report(_engine: Trainer) -> None:
        if checkpointer.resumed_from:
            print(f"RESUMED {checkpointer.resumed_from}", flush=True)

    trainer.run(loader(), max_steps=args.steps)
    checkpointer.close()
    torch.save(final_state(trainer), args.out)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
