"""A ``handlers:`` entry for tests/test_export.py: when training ends, each rank writes the weights
it trained (whole tensors, under the plain model's names) to ``<run_dir>/trained_rank<R>.pt`` and,
when its model runs whole (no pipeline stages), the logits of a fixed batch as computed by the
model as it trained (tensor-parallel included)."""

from __future__ import annotations

import re

import torch

from hookloop.engine import Events


class DumpTrained:
    def __init__(self, run_dir, pipeline: bool = False) -> None:
        self.run_dir, self.pipeline = run_dir, pipeline

    def attach(self, trainer) -> None:
        trainer.add_event_handler(Events.TRAIN_END, self.dump)

    def dump(self, trainer) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        model = trainer.model
        weights = {}
        for name, value in model.state_dict().items():
            name = re.sub(r"^\d+\.", "", name) if self.pipeline else name  # the stage's index
            name = name.removeprefix("module.")  # a data-parallel wrapper's
            weights[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
        out = {"weights": {k: v.detach().clone() for k, v in weights.items()}}
        if not self.pipeline:
            model.eval()
            with torch.no_grad():
                logits = model(batch())
            out["logits"] = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        torch.save(out, f"{self.run_dir}/trained_rank{rank}.pt")


def batch() -> torch.Tensor:
    """The fixed batch the logits are computed on."""
    return torch.arange(32).reshape(2, 16) % 50
