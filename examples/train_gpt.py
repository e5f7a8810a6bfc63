"""Train a small byte-level GPT on text every Python install has.

    python examples/train_gpt.py                                   # examples/configs/gpt_tiny.yaml
    python examples/train_gpt.py --config examples/configs/gpt_mixture.yaml
    python examples/train_gpt.py step_scheduler.max_steps=50 train.run_dir=runs/try
    torchrun --nproc-per-node 2 examples/train_gpt.py train.run_dir=runs/gpt_ddp   # DDP, gloo on CPU

The same as ``hookloop train examples/configs/gpt_tiny.yaml [overrides]``: the config's
``model.target`` (``hookloop.models.gpt:recipe``) names the model, and :mod:`hookloop.train` builds
the data, the parallel layout and every handler the config enables. Train your own model the same
way: write a factory that returns an ``nn.Module`` and name it in ``model.target``.

``fault_injection.kind=nan`` injects NaN losses on purpose, to watch the NaN detector veto the
steps and roll back (``examples/fault_tolerance_demo.sh`` shows it).
"""

from __future__ import annotations

from pathlib import Path

from hookloop.cli import run, train_script

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "gpt_tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    return train_script(DEFAULT_CONFIG, argv)


if __name__ == "__main__":
    run(main)  # the thread settings, then main(), then the exit code
