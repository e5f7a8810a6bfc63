"""The settings of a ``hookloop train`` config that every checkpoint records beside the optimizer's
and the LR schedule's, and which of them a resume refuses to change (the table in
docs/checkpoint.md, "Changing settings on resume"). A refused one says what in the checkpoint
depends on it; every other one takes effect from the resumed step and is said when it changed."""

from __future__ import annotations

import dataclasses
from typing import Any

from hookloop.handlers.checkpoint import Recorded
from hookloop.recipe import ResolvedModel

__all__ = ["resume_settings"]

_DATA_POSITION = (
    "the data position the checkpoint holds counts samples of these datasets, so the data would not "
    "continue where it stopped"
)


def resume_settings(cfg: Any, model: ResolvedModel) -> dict[str, Recorded]:
    """Dotted field -> :class:`Recorded` for ``cfg`` (a :data:`~hookloop.train.TrainingConfig`) and
    its resolved model."""
    data = cfg.data
    out = {
        "train.seq_len": Recorded(
            cfg.train.seq_len,
            "the samples are windows of this many tokens, and the data position the checkpoint holds "
            "counts them",
        ),
        "train.seed": Recorded(
            cfg.train.seed,
            "a resume continues the random streams and the data order the checkpoint's seed began",
        ),
    }
    if cfg.step_scheduler.enabled:
        out["step_scheduler.global_batch_size"] = Recorded(
            cfg.step_scheduler.global_batch_size,
            "the data position counts steps of this many samples, and each step must take the samples "
            "it would have taken without the restart (local_batch_size and the number of ranks may change)",
        )
        out["step_scheduler.max_steps"] = Recorded(cfg.step_scheduler.max_steps)
    if data.target is None:
        out["data.datasets"] = Recorded(dict(data.datasets), _DATA_POSITION)
    else:
        out["data.target"] = Recorded(data.target, _DATA_POSITION)
        out["data.args"] = Recorded(dict(data.args), _DATA_POSITION)
    out["data.val_fraction"] = Recorded(
        data.val_fraction,
        "it sets how many samples of each dataset train, which the data position counts",
    )
    out["data.weights"] = Recorded(dict(data.weights))
    out["data.mix_temperature"] = Recorded(data.mix_temperature)
    phases = [dataclasses.asdict(p) if dataclasses.is_dataclass(p) else p for p in data.phases]
    out["data.phases"] = Recorded(phases)
    # The model's arguments take effect when the checkpoint's weights fit the model they build (a
    # dropout rate, say); another layout is refused by the layout check, named by the argument.
    for name, value in model.settings().items():
        out[f"model.{name}"] = Recorded(value)
    return out
