"""Train a tiny Hugging Face causal LM (built from a config, nothing downloaded) on text every Python
install has, with the full handler set.

    python examples/train_hf.py                                            # examples/configs/hf_tiny.yaml
    python examples/train_hf.py step_scheduler.max_steps=50 train.run_dir=runs/try
    torchrun --nproc-per-node 2 examples/train_hf.py train.run_dir=runs/hf_ddp                  # DDP
    torchrun --nproc-per-node 2 examples/train_hf.py distributed.dp_mode=fsdp train.run_dir=runs/hf_fsdp
    torchrun --nproc-per-node 2 examples/train_hf.py distributed.pp_size=2 train.run_dir=runs/hf_pp

Needs ``transformers`` (``pip install -e ".[hf]" --config-settings editable_mode=strict``). The
same as ``hookloop train examples/configs/hf_tiny.yaml [overrides]``: ``model.target:
hookloop.models.hf:recipe`` builds a ``transformers`` causal LM (``model.architecture``: ``llama``
or ``gpt2``; every other ``model`` key is a field of its config class, e.g.
``model.num_hidden_layers=4``) over a byte vocabulary, which computes its own loss from
``{"input_ids", "labels"}`` microbatches.
"""

from __future__ import annotations

from pathlib import Path

from hookloop.cli import run, train_script

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "hf_tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    return train_script(DEFAULT_CONFIG, argv)


if __name__ == "__main__":
    run(main)  # the thread settings, then main(), then the exit code
