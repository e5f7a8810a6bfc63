"""Named datasets concatenated into one index space, each item tagged with where it came from."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset

from hookloop.engine.errors import ConfigError

__all__ = ["MixtureDataset"]


class MixtureDataset(Dataset):
    """Concatenation of named datasets, in the mapping's order.

    Global index ``offsets[s] + j`` is item ``j`` of source ``s``. An item that is a 2-tuple
    ``(input_ids, labels)`` comes back as ``(input_ids, labels, source_idx)``; any other item as
    ``(item, source_idx)``. The source index lets the training step and the curriculum handler
    attribute losses and token counts to each source without a second lookup. With
    ``tag_source=False`` every item comes back exactly as its dataset returned it (a user's samples
    reach their ``collate_fn`` unchanged; the source of an index is :meth:`locate`'s answer).
    """

    def __init__(self, datasets: Mapping[str, Any], *, tag_source: bool = True) -> None:
        if not isinstance(datasets, Mapping):
            raise TypeError(f"datasets: expected a mapping name -> dataset, got {type(datasets).__name__}")
        if not datasets:
            raise ConfigError("datasets", "is empty; pass at least one named dataset")
        names: list[str] = []
        lengths: list[int] = []
        for name, dataset in datasets.items():
            if not isinstance(name, str) or not name:
                raise ConfigError("datasets", f"names must be non-empty strings, got {name!r}")
            try:
                length = len(dataset)
            except TypeError as exc:
                raise TypeError(
                    f"datasets[{name!r}]: a map-style dataset with __len__ is required, "
                    f"got {type(dataset).__name__}"
                ) from exc
            names.append(name)
            lengths.append(int(length))
        self.datasets: tuple[Any, ...] = tuple(datasets.values())
        self.names: tuple[str, ...] = tuple(names)
        self.lengths: tuple[int, ...] = tuple(lengths)
        self.offsets: tuple[int, ...] = tuple(itertools.accumulate(lengths[:-1], initial=0))
        self._total = sum(lengths)
        self.tag_source = bool(tag_source)

    def __len__(self) -> int:
        return self._total

    def locate(self, index: int) -> tuple[int, int]:
        """``(source_idx, local_idx)`` of global ``index`` (negative indices count from the end)."""
        i = int(index)
        if i < 0:
            i += self._total
        if not 0 <= i < self._total:
            raise IndexError(f"index {index} out of range for a mixture of {self._total} items")
        source = bisect.bisect_right(self.offsets, i) - 1
        # empty sources share their offset with the next one; bisect_right already skips them
        return source, i - self.offsets[source]

    def global_index(self, source_idx: int, local_idx: int) -> int:
        """Global index of item ``local_idx`` of source ``source_idx``."""
        if not 0 <= source_idx < len(self.names):
            raise IndexError(f"source_idx {source_idx} out of range for {len(self.names)} sources")
        if not 0 <= local_idx < self.lengths[source_idx]:
            raise IndexError(
                f"local_idx {local_idx} out of range for source {self.names[source_idx]!r} "
                f"of length {self.lengths[source_idx]}"
            )
        return self.offsets[source_idx] + local_idx

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        source, local = self.locate(index)
        item = self.datasets[source][local]
        if not self.tag_source:
            return item
        if isinstance(item, tuple) and len(item) == 2:
            return item[0], item[1], source
        return item, source

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={length}" for n, length in zip(self.names, self.lengths))
        return f"MixtureDataset({parts})"
