"""PerDatasetMetrics: loss and token counts per source dataset of a mixture, at no extra forward.

At every MICROBATCH the handler takes the logits the trainer already computed
(``state.microbatch_output``, shape ``(..., vocab)``) and the targets, computes the per-token
cross-entropy under ``no_grad`` (a softmax over outputs that exist anyway, no forward pass), and adds
each sample's loss sum and token count to its source, read from the microbatch the batch carries
(``state.batch[state.microbatch]``: a :class:`~engine.data.MixtureDataset` batch is
``(input_ids, labels, source_idx)``). Targets equal to ``ignore_index`` count neither way. With
``Trainer(loss_fn=None)`` the model computes its own loss the Hugging Face way: its ``logits`` at
position t are scored against label t + 1 (labels unshifted), as the model scores them.

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

from hookloop.engine import parallel
from hookloop.engine.checks import check_int
from hookloop.engine.data.mixture import MixtureDataset
from hookloop.engine.data.sampler import MixtureSampler
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority, every
from hookloop.engine.handler import Handler
from hookloop.handlers.sections.dataset_metrics import DatasetMetricsConfig

__all__ = ["DatasetMetricsConfig", "PerDatasetMetrics"]

# Where the per-dataset sums run, relative to the phases of an event (engine.Priority).
#: TRAIN_START (zero the sums), MICROBATCH, STEP_END: the last observer, after the data's phase.
DATASET_METRICS = Priority.OBSERVE - 900
#: TRAIN_END: the last sums, just before the metrics tracker closes its files.
DATASET_METRICS_END = Priority.DECIDE + 1


class PerDatasetMetrics(Handler):
    """Per-source loss and tokens, published as ``loss/<name>`` and ``tokens/<name>``.

    Args:
        names: dataset names in source-index order, or the ``MixtureDataset`` / ``MixtureSampler``.
        log_interval: publish every this many steps (use the loggers' interval).
        ignore_index: target value that is not a token (as in ``F.cross_entropy``).
    """

    Config = DatasetMetricsConfig
    section = "dataset_metrics"
    doc = "docs/data.md"  # its page (a shipped handler: handlers/declarations.py)

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
        check_int("log_interval", log_interval)
        self.names = tuple(str(n) for n in names)
        self.log_interval = log_interval
        self.ignore_index = ignore_index
        self._sums: torch.Tensor | None = None  # rows: loss sum, token count; one column per source
        self._steps = 0

    @classmethod
    def from_config(
        cls,
        cfg: DatasetMetricsConfig,
        *,
        sampler: MixtureSampler | MixtureDataset | None = None,
        log_interval: int = 10,
    ) -> PerDatasetMetrics | None:
        """Build from the ``dataset_metrics`` section, or None when ``cfg.enabled`` is false or
        there is no mixture (``sampler`` None). ``log_interval`` is the logging section's."""
        if not cfg.enabled or sampler is None:
            return None
        mixture = sampler.mixture if isinstance(sampler, MixtureSampler) else sampler
        if not getattr(mixture, "tag_source", True):  # the samples do not say where they came from
            return None
        return cls(sampler, log_interval)

    def attach(self, trainer: Any) -> PerDatasetMetrics:
        trainer.add_event_handler(Events.TRAIN_START, self._reset, priority=DATASET_METRICS)
        trainer.add_event_handler(Events.MICROBATCH, self._on_microbatch, priority=DATASET_METRICS)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=DATASET_METRICS)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=DATASET_METRICS_END)
        return super().attach(trainer)

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
        state = self.trainer.state
        logits, targets = state.microbatch_output, state.microbatch_targets
        if logits is None or targets is None:  # e.g. a pipeline stage that holds no outputs
            return
        if not getattr(self.trainer, "count_share", 1):  # another rank of its tensor-parallel group counts
            return
        if not isinstance(logits, torch.Tensor) and hasattr(logits, "logits"):  # a Hugging Face output
            logits = logits.logits
        if self.trainer.loss_fn is None:  # the model's own loss: labels unshifted (Hugging Face)
            logits, targets = logits[..., :-1, :], targets[..., 1:]
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
        state = self.trainer.state
        self._steps += 1
        if every(self.log_interval, state.step) or self.trainer.at_last_step:
            self._publish()

    def _on_train_end(self) -> None:
        if self._steps:
            self._publish()

    def _publish(self) -> None:
        sums = self._sums if self._sums is not None else torch.zeros(2, len(self.names), dtype=torch.float64)
        totals = parallel.all_reduce_sum(sums.clone()).cpu()
        metrics = self.trainer.state.metrics
        for i, name in enumerate(self.names):
            tokens = float(totals[1, i])
            metrics[f"tokens/{name}"] = int(tokens)
            if tokens > 0:
                metrics[f"loss/{name}"] = float(totals[0, i]) / tokens
            else:
                metrics.pop(f"loss/{name}", None)
        self._reset()
