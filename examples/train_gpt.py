"""Train a small byte-level GPT on text every Python install has.

    python examples/train_gpt.py                                   # examples/configs/gpt_tiny.yaml
    python examples/train_gpt.py --config examples/configs/gpt_mixture.yaml
    python examples/train_gpt.py step_scheduler.max_steps=50 train.run_dir=runs/try
    python examples/train_gpt.py "fault.nan_microbatches=[120,121,122,123,124,125]"   # a NaN burst
    torchrun --nproc-per-node 2 examples/train_gpt.py              # data parallel (DDP, gloo on CPU)

Datasets are the standard library's own documentation text (``stdlib_docs``) and its ``.py``
source files (``stdlib_source``), tokenized to bytes into ``data.cache_dir`` on first use. The run
directory gets ``metrics.jsonl`` (one line per logged step). The process exits with
``state.exit_code`` (see ``engine.ExitCode``).

``fault.nan_microbatches`` injects a fault on purpose, to watch the recovery path work: the loss
of each listed microbatch of the run (0-based, counted over the whole run as
``state.microbatches_seen``, which a rollback never rewinds) becomes NaN, so its step's gradients
are NaN too. The NaN detector vetoes those steps and, after ``nan.max_consecutive`` of them, rolls
back to the last good checkpoint and trains on past the poisoned data
(``examples/fault_tolerance_demo.sh`` shows it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.parallel import exit_process  # noqa: E402
from examples.models.gpt import GPT, GPTConfig, cross_entropy_loss  # noqa: E402
from examples.training import ModelRecipe, resolve_run_dir, run  # noqa: E402
from handlers import RunConfig  # noqa: E402

__all__ = ["DEFAULT_CONFIG", "RECIPE", "main", "resolve_run_dir"]

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "gpt_tiny.yaml"


def gpt_config(cfg: RunConfig) -> GPTConfig:
    """The ``model`` section as a :class:`GPTConfig` (its checks raise ValueError naming the field)."""
    return GPTConfig(**{"seq_len": cfg.train.seq_len, **cfg.model})


def build_gpt(cfg: RunConfig) -> tuple[GPT, float]:
    model = GPT(gpt_config(cfg))
    return model, model.flops_per_token()


RECIPE = ModelRecipe(
    description="Train a small GPT with hookloop.",
    default_config=DEFAULT_CONFIG,
    check=gpt_config,
    build=build_gpt,
    loss_fn=cross_entropy_loss,
)


def main(argv: list[str] | None = None) -> int:
    return run(argv, RECIPE)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_process(main())
