"""A ``DataLoader`` over a :class:`MixtureSampler` whose state is the batches it handed out.

A ``DataLoader`` with workers pulls ``num_workers * prefetch_factor`` batches of indices ahead of
the consumer, so the sampler's own position runs ahead of training. :class:`MixtureLoader` counts
the batches it has actually returned and reports the sampler state at exactly that point
(:meth:`MixtureSampler.state_dict_at`), so a checkpoint taken after optimizer step ``k`` holds the
position right after step ``k``'s data, whatever the workers prefetched. A new iterator (a new
``run()``, a rollback) first gives the prefetched-but-unused indices back to the sampler, so no
sample is lost between runs. With a trainer, every ``grad_accum_steps`` batches are one step, so the
position after step ``k`` is ``k * grad_accum_steps * batch_size * world_size`` draws past the start.

Quarantine: :meth:`MixtureLoader.quarantine` names global indices never to be trained on again (bad
samples). Each batch of ``batch_size`` draws comes back without them, one sample shorter per
quarantined index, so the stream, the position and every other rank's batches stay exactly where
they were, on any number of ranks. A batch whose every sample is quarantined is left out and this
rank reads its next batch instead (counted in the position; the only case where a quarantine moves a
rank's data: use batches of more than one sample). With ``full_batches`` (a consumer that takes one
batch size only: a pipeline's microbatches) a batch a quarantine leaves short is filled back to
``batch_size`` with copies of its kept samples, in order (a kept sample then weighs more in that one
batch), so the stream and the position stay as they are there too.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader

from hookloop.engine.data.sampler import MixtureSampler
from hookloop.engine.errors import ConfigError

__all__ = ["MixtureLoader", "read_quarantine"]

_SAME_POSITION_KEYS = ("format", "version", "seed", "draws", "sources")


class MixtureLoader(DataLoader):
    """``DataLoader(sampler.mixture, batch_size, sampler=sampler, **kwargs)`` with an exact position
    (see the module docs): its state is O(prefetch depth) to compute, O(1) to restore. The stream
    is endless; bound the run by steps. ``full_batches``: a batch a quarantine leaves short is filled
    back with copies of its kept samples (see the module docs)."""

    def __init__(
        self, sampler: MixtureSampler, batch_size: int, *, full_batches: bool = False, **kwargs: Any
    ) -> None:
        if not isinstance(sampler, MixtureSampler):
            raise TypeError(f"sampler: expected a MixtureSampler, got {type(sampler).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        for name in ("sampler", "batch_sampler", "shuffle", "dataset"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: MixtureLoader sets it from the MixtureSampler; leave it out")
        #: Global indices never fetched again (:meth:`quarantine`).
        self.quarantined: set[int] = set()
        self.full_batches = full_batches
        self._spans: collections.deque[tuple[int, list[int]]] = collections.deque()  # (batches, kept)
        super().__init__(sampler.mixture, batch_size=batch_size, sampler=sampler, **kwargs)
        self.mixture_sampler = sampler
        self._position: int | None = None  # global draws after the last batch returned
        self._loads = sampler._loads
        self._returned: list[list[int]] | None = None  # indices of the batches returned, while logging

    def quarantine(self, ids: Iterable[str]) -> None:
        """Never fetch these samples again (ids ``"<dataset>:<index>"``, as the sample trace writes
        them), from the next batch not yet drawn (batches prefetched by workers keep theirs); a
        ``ConfigError`` names an id the mixture does not hold."""
        mixture = self.mixture_sampler.mixture
        for sid in ids:
            name, _, index = str(sid).rpartition(":")
            source = mixture.names.index(name) if name in mixture.names else -1
            if source < 0 or not index.isdigit() or int(index) >= mixture.lengths[source]:
                raise ConfigError(
                    "data.quarantine", f"names sample {sid!r}, which the training data does not hold"
                )
            self.quarantined.add(mixture.global_index(source, int(index)))

    @property
    def _index_sampler(self) -> Any:
        # torch's DataLoader draws each batch's indices from here: its batches without quarantined ones
        return _KeptBatches(self.batch_sampler, self.quarantined, self._spans, self.full_batches)

    @property
    def position(self) -> int:
        """Global draw position right after the last batch this loader returned."""
        self._sync()
        assert self._position is not None
        return self._position

    def _sync(self) -> None:
        """Adopt the sampler's position if nothing was returned yet or someone loaded a state into it."""
        sampler = self.mixture_sampler
        if self._position is None or sampler._loads != self._loads:
            self._position = sampler.draws
            self._loads = sampler._loads

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._sync()
        sampler = self.mixture_sampler
        if sampler.draws != self._position:  # an earlier iterator prefetched past what it returned
            sampler.load_state_dict(sampler.state_dict_at(self._position))
            self._loads = sampler._loads
        step = self.batch_size * sampler.world_size  # global draws (all ranks) of one batch of this rank
        logging = self._returned is not None
        if logging:
            sampler.take_logged()  # whatever an earlier iterator read ahead is back in the stream
        self._spans.clear()
        iterator = super().__iter__()
        try:
            for batch in iterator:
                self._sync()
                span, kept = self._spans.popleft()  # batches come back in the order they were drawn
                self._position += step * span
                if logging:
                    sampler.take_logged(self.batch_size * span)
                    self._returned.append(kept)
                yield batch
        finally:
            del iterator  # shut the workers down now, not at garbage collection

    def log_batches(self) -> None:
        """From now on keep the sampler indices of every batch this loader returns, until
        :meth:`take_returned` takes them (exact with workers too: only returned batches count)."""
        if self._returned is None:
            self.mixture_sampler.log_indices()
            self._returned = []

    def take_returned(self) -> list[list[int]]:
        """The indices of each batch returned since the last call (oldest first), removed."""
        if self._returned is None:
            raise RuntimeError("this loader does not log its batches: call log_batches() first")
        out, self._returned = self._returned, []
        return out

    def state_dict(self) -> dict[str, Any]:
        """The sampler state right after the last batch returned (JSON-safe)."""
        return self.mixture_sampler.state_dict_at(self.position)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue right after the batches ``state_dict`` describes. A state naming the position
        the sampler already has (e.g. restored by a curriculum handler) is not loaded again, so a
        weight schedule set since is kept."""
        current = self.mixture_sampler.state_dict_at(self.position)
        if any(current.get(k) != state_dict.get(k) for k in _SAME_POSITION_KEYS):
            self.mixture_sampler.load_state_dict(state_dict)
        self._sync()


class _KeptBatches:
    """``batches`` (lists of indices) without the ``quarantined`` ones (``full``: filled back to their
    size with copies of the kept ones); a batch left empty is skipped, and ``spans`` records, per
    batch given out, how many drawn batches it stands for and its indices."""

    def __init__(
        self, batches: Iterable[list[int]], quarantined: set[int], spans: collections.deque, full: bool
    ) -> None:
        self.batches, self.quarantined, self.spans, self.full = batches, quarantined, spans, full

    def __iter__(self) -> Iterator[list[int]]:
        span = 0
        for batch in self.batches:
            span += 1
            kept = [i for i in batch if i not in self.quarantined] if self.quarantined else batch
            if kept and self.full and len(kept) < len(batch):
                kept = [kept[k % len(kept)] for k in range(len(batch))]
            if kept:
                self.spans.append((span, list(kept)))
                span = 0
                yield kept

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]


def read_quarantine(path: str | os.PathLike) -> list[str]:
    """The sample ids of a ``quarantine.jsonl`` (``data.quarantine``: rows ``{..., "ids": [...]}``,
    as a run writes it); a line that is not such a row is a ``ConfigError`` naming it."""
    ids = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ids.extend(str(i) for i in json.loads(line)["ids"])
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    "data.quarantine", f'{path} line {number} is not a row {{..., "ids": [...]}}'
                ) from None
    return ids
