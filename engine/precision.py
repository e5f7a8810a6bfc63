"""The training precisions: their names and the autocast dtype each one means.

``train.precision``, ``Trainer(precision=...)`` and ``wrap_data_parallel(mixed_precision=...)``
accept exactly these names; see docs/performance.md.
"""

from __future__ import annotations

import torch

from hookloop.engine.config import PRECISIONS

__all__ = ["AUTOCAST_DTYPES", "PRECISIONS"]

#: Precision name -> the dtype the forward and loss autocast to (None: no autocast). fp16 also
#: takes a gradient scaler.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
}
assert tuple(AUTOCAST_DTYPES) == PRECISIONS  # the names are the config's (engine.config)
