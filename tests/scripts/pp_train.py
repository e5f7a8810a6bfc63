"""Pipeline-parallel training under torchrun, wired from a run config the way an example script is.

    torchrun --nproc-per-node 2 tests/scripts/pp_train.py distributed.pp_size=2 pipeline.pp_schedule=1f1b

Trains the example GPT on a fixed synthetic token stream and prints one JSON line per rank with the
first and last step's loss, so a test can check every rank agrees and the loss went down.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hookloop.engine import Events, Trainer, init_distributed  # noqa: E402
from hookloop.engine.parallel import destroy_distributed, exit_process  # noqa: E402
from hookloop.engine.pipeline import PipelineConfig, build_pipeline  # noqa: E402
from hookloop.handlers import load_run_config  # noqa: E402
from hookloop.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    defaults = [
        "model.n_layers=4",
        "model.d_model=32",
        "model.n_heads=2",
        "train.seq_len=16",
        "train.local_batch_size=2",
        "step_scheduler.global_batch_size=8",
        "step_scheduler.max_steps=6",
    ]
    cfg = load_run_config(None, defaults + sys.argv[1:])
    pp = cfg.distributed.pp_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = init_distributed(
        cfg.distributed.backend, mesh_shape=(world // pp, pp), mesh_dim_names=("dp", "pp")
    )
    try:
        torch.manual_seed(cfg.train.seed)
        model = GPT(GPTConfig(vocab_size=64, seq_len=cfg.train.seq_len, **cfg.model))
        runtime = build_pipeline(
            model,
            PipelineConfig.from_section(cfg.pipeline),
            info,
            cross_entropy_loss,
            dp_mode=cfg.distributed.dp_mode,
        )
        optimizer = torch.optim.AdamW(runtime.parameters(), lr=3e-3)
        trainer = Trainer(
            runtime.module, optimizer, cross_entropy_loss, grad_clip_norm=1.0, step_body=runtime
        )
        # every pp rank of one pipeline reads the same samples; dp ranks read different ones
        g = torch.Generator().manual_seed(runtime.dp_rank)
        stream = torch.arange(64).repeat(64)  # a learnable pattern
        data = []
        for _ in range(runtime.n_microbatches * cfg.step_scheduler.max_steps):
            starts = torch.randint(
                0, len(stream) - cfg.train.seq_len - 1, (cfg.train.local_batch_size,), generator=g
            )
            x = torch.stack([stream[s : s + cfg.train.seq_len + 1] for s in starts.tolist()])
            data.append((x[:, :-1], x[:, 1:]))
        losses = []
        trainer.add_event_handler(Events.STEP_END, lambda: losses.append(trainer.state.loss))
        trainer.run(data, max_steps=cfg.step_scheduler.max_steps)
        row = {"rank": info.rank, "stages": runtime.stage_ids, "first": losses[0], "last": losses[-1]}
        print(json.dumps(row), flush=True)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)  # not the interpreter's shutdown, which gloo's threads can abort
