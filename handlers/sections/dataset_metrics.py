"""The ``dataset_metrics`` section: :class:`DatasetMetricsConfig`, read by
:class:`~hookloop.handlers.dataset_metrics.PerDatasetMetrics`. Imports no torch: a config is checked
without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookloop.engine.checks import check_bool, dotted

__all__ = ["DatasetMetricsConfig"]


@dataclass
class DatasetMetricsConfig:
    """The ``dataset_metrics`` section: per-dataset loss and tokens of a data mixture (see
    :class:`PerDatasetMetrics`), published every ``logging.log_interval`` steps (the one log
    cadence); the handler is built only when the training data is a mixture whose samples carry
    their source (a ``MixtureSampler`` over a token-file ``MixtureDataset``; a ``data.target``'s
    samples are left as they are, so there it is not built)."""

    enabled: bool = True

    def validate(self, prefix: str = "dataset_metrics") -> None:
        check_bool(dotted(prefix, "enabled"), self.enabled)

    def produces(self, cfg: Any) -> set[str]:
        """``loss/<dataset>`` for every dataset of a mixture of token files."""
        if self.enabled and cfg.data.target is None:
            return {f"loss/{name}" for name in cfg.data.datasets}
        return set()
