"""TokenAccuracy: the share of a language model's predicted tokens that are right, as an ignite metric.

    validation:
      metrics:
        accuracy: hookloop.engine:TokenAccuracy                         # logits vs next-token ids
        hf_accuracy: {target: hookloop.engine:TokenAccuracy, shift_labels: true}   # HF labels

It is also the pattern for a validation metric of your own (see :mod:`engine.validation`): sums
and counts per rank, reduced in ``compute()`` by ignite's ``sync_all_reduce``, which validation
points at the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from ignite.exceptions import NotComputableError
from ignite.metrics.metric import Metric, reinit__is_reduced, sync_all_reduce

__all__ = ["TokenAccuracy"]


class TokenAccuracy(Metric):
    """Share of positions where the argmax of the logits is the target token.

    Fed ``(output, targets)``: ``output`` the logits ``[batch, seq, vocab]`` (or a model output with
    ``.logits`` / ``["logits"]``), ``targets`` the token ids ``[batch, seq]``. Positions whose
    target is ``ignore_index`` do not count.

    Args:
        ignore_index: the target id of positions without a prediction to grade (-100, as in
            torch's cross entropy).
        shift_labels: the targets are the input ids themselves (the Hugging Face convention, labels
            unshifted): logits at position t are graded against the target at t + 1.
        output_transform: ignite's: turns the evaluator's output into ``(output, targets)``.
        device: where the counts live.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        shift_labels: bool = False,
        output_transform: Callable = lambda x: x,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an integer token id, got {ignore_index!r}")
        if not isinstance(shift_labels, bool):
            raise TypeError(f"shift_labels must be true or false, got {shift_labels!r}")
        self.ignore_index = ignore_index
        self.shift_labels = shift_labels
        super().__init__(output_transform=output_transform, device=device)

    @reinit__is_reduced
    def reset(self) -> None:
        self._correct = torch.zeros((), dtype=torch.long, device=self._device)
        self._count = torch.zeros((), dtype=torch.long, device=self._device)

    @reinit__is_reduced
    def update(self, output: Any) -> None:
        logits, targets = output
        if isinstance(logits, Mapping):
            logits = logits["logits"]
        logits = getattr(logits, "logits", logits)
        if logits.dim() != targets.dim() + 1 or logits.shape[:-1] != targets.shape:
            raise ValueError(
                f"TokenAccuracy takes logits [batch, seq, vocab] and targets [batch, seq], got "
                f"{tuple(logits.shape)} and {tuple(targets.shape)}"
            )
        if self.shift_labels:
            logits, targets = logits[..., :-1, :], targets[..., 1:]
        graded = targets != self.ignore_index
        right = (logits.argmax(-1) == targets) & graded
        self._correct += right.sum().to(self._device)
        self._count += graded.sum().to(self._device)

    @sync_all_reduce("_correct", "_count")
    def compute(self) -> float:
        if self._count == 0:
            raise NotComputableError("TokenAccuracy needs at least one graded position before compute()")
        return self._correct.item() / self._count.item()
