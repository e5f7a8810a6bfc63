"""PerDatasetMetrics: loss and token counts per source dataset of a mixture, at no extra forward.

At every MICROBATCH the handler takes the logits the trainer already computed
(``state.microbatch_output``, shape ``(..., vocab)``) and the targets, computes the per-token
cross-entropy under ``no_grad`` (a softmax over outputs that exist anyway, no forward pass), and adds
each sample's loss sum and token count to its source, read from the microbatch the batch carries
(``state.batch[state.microbatch]``: a :class:`~engine.data.MixtureDataset` batch is
``(input_ids, labels, source_idx)``). Targets equal to ``ignore_index`` count neither way.

Every ``log_interval`` steps (and at the last step, and at TRAIN_END for a partial interval) it sums
the interval over data-parallel ranks with one all-reduce and publishes, for every dataset
``name``:

* ``state.metrics["loss/<name>"]``: mean per-token loss of that dataset's tokens in the interval
  (removed from ``state.metrics`` when the interval had none of them, e.g. a phase with weight 0);
* ``state.metrics["tokens/<name>"]``: how many of that dataset's tokens the interval trained on.

The accumulation stays on the logits' device; nothing is synchronised between log steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine import parallel
from engine.data.mixture import MixtureDataset
from engine.data.sampler import MixtureSampler
from engine.errors import ConfigError
from engine.events import Events

__all__ = ["PerDatasetMetrics"]

# STEP_END: after the MetricsTracker (inf), before loggers and the checkpointer.
_PUBLISH_PRIORITY = 1e5
# TRAIN_END: before the MetricsTracker's partial interval (1000) and the loggers closing.
_END_PRIORITY = 1001


class PerDatasetMetrics:
    """Per-source loss and tokens, published as ``loss/<name>`` and ``tokens/<name>``.

    Args:
        names: dataset names in source-index order, or the ``MixtureDataset`` / ``MixtureSampler``.
        log_interval: publish every this many steps (use the loggers' interval).
        ignore_index: target value that is not a token (as in ``F.cross_entropy``).
    """

    def __init__(
        self,
        names: Sequence[str] | MixtureDataset | MixtureSampler,
        log_interval: int = 10,
        *,
        ignore_index: int = -100,
    ) -> None:
        if isinstance(names, MixtureSampler):
            names = names.mixture
        if isinstance(names, MixtureDataset):
            names = names.names
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise ConfigError("names", f"must be the non-empty list of dataset names, got {names!r}")
        if isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 1:
            raise ConfigError("log_interval", f"must be a positive integer, got {log_interval!r}")
        self.names = tuple(str(n) for n in names)
        self.log_interval = log_interval
        self.ignore_index = ignore_index
        self._trainer: Any = None
        self._sums: torch.Tensor | None = None  # rows: loss sum, token count; one column per source
        self._steps = 0

    def attach(self, trainer: Any) -> PerDatasetMetrics:
        self._trainer = trainer
        trainer.add_event_handler(Events.TRAIN_START, self._reset)
        trainer.add_event_handler(Events.MICROBATCH, self._on_microbatch)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=_PUBLISH_PRIORITY)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=_END_PRIORITY)
        return self

    def _reset(self) -> None:
        if self._sums is not None:
            self._sums.zero_()
        self._steps = 0

    def _source_of(self, microbatch: Any) -> torch.Tensor:
        if isinstance(microbatch, dict) and "source_idx" in microbatch:
            return microbatch["source_idx"]
        if isinstance(microbatch, list | tuple) and len(microbatch) >= 3:
            return microbatch[2]
        raise TypeError(
            "PerDatasetMetrics needs the source index in every microbatch: (input_ids, labels, source_idx) "
            "as a MixtureDataset yields, or a dict with 'source_idx'"
        )

    @torch.no_grad()
    def _on_microbatch(self) -> None:
        state = self._trainer.state
        logits, targets = state.microbatch_output, state.microbatch_targets
        if logits is None or targets is None:  # e.g. a pipeline stage that holds no outputs
            return
        if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != targets.shape:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TypeError(
                f"PerDatasetMetrics expects logits of shape targets.shape + (vocab,), got {shape} for "
                f"targets {tuple(targets.shape)}"
            )
        source = torch.as_tensor(self._source_of(state.batch[state.microbatch]), device=logits.device).long()
        per_token = F.cross_entropy(
            logits.detach().reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            reduction="none",
            ignore_index=self.ignore_index,
        )
        batch = source.shape[0]
        loss = per_token.reshape(batch, -1).double().sum(1)
        tokens = (targets != self.ignore_index).reshape(batch, -1).sum(1).double()
        if self._sums is None or self._sums.device != logits.device:
            self._sums = torch.zeros(2, len(self.names), dtype=torch.float64, device=logits.device)
        self._sums[0].index_add_(0, source, loss)
        self._sums[1].index_add_(0, source, tokens)

    def _on_step_end(self) -> None:
        state = self._trainer.state
        self._steps += 1
        max_steps = self._trainer.max_steps
        if state.step % self.log_interval == 0 or state.is_last_step or state.step == max_steps:
            self._publish()

    def _on_train_end(self) -> None:
        if self._steps:
            self._publish()

    def _publish(self) -> None:
        sums = self._sums if self._sums is not None else torch.zeros(2, len(self.names), dtype=torch.float64)
        totals = parallel.all_reduce_sum(sums.clone()).cpu()
        metrics = self._trainer.state.metrics
        for i, name in enumerate(self.names):
            tokens = float(totals[1, i])
            metrics[f"tokens/{name}"] = int(tokens)
            if tokens > 0:
                metrics[f"loss/{name}"] = float(totals[0, i]) / tokens
            else:
                metrics.pop(f"loss/{name}", None)
        self._reset()
