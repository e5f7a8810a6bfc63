"""An endless, resumable, rank-disjoint stream of indices into a :class:`MixtureDataset`.

The stream
    One global sequence of *draws*, shared by all ranks. Draw ``g`` picks a source by comparing a
    uniform number ``u_g`` with the cumulative probabilities, then takes that source's next
    position. ``u_g`` depends only on ``(seed, g)``: the uniforms come in fixed blocks of
    ``2**16`` draws, block ``b`` generated from ``SeedSequence([seed, tag, b])``. Weights only
    change how ``u_g`` maps to a source, so a weight change never disturbs the uniforms and any
    position is reachable without replaying earlier draws.

Sources
    Source ``s`` keeps a count of the positions all draws have taken from it. Position ``k`` is
    element ``k % len`` of the permutation of epoch ``k // len``, seeded by ``(seed, name, len,
    epoch)``, so each source walks through its own epochs in order whatever the weights do: within
    an epoch no item repeats or is skipped. (Sources shorter than 4096 items draw the permutations of
    several consecutive epochs from one generator, which keeps tiny sources cheap.)

Ranks
    Draws are dealt round-robin: rank ``r`` of ``W`` yields draws ``r, r + W, r + 2W, ...``. Every
    rank computes the source of every draw (a few comparisons, no data access) to keep the shared
    counts, so no two ranks ever receive the same (source, epoch, position), and the union of the
    ranks' streams is exactly the single-rank stream.

Weights as a function of the draw
    The weights in force are a piecewise-constant function of the global draw index: a list of
    segments, each ``(first draw, weights, temperature)``. :meth:`update_weights` starts a new
    segment at the next draw; :meth:`set_schedule` lays out future changes at given draw indices in
    advance. Because draw ``g``'s source depends only on ``u_g`` and the segment containing ``g``,
    the stream is a pure function of the seed and the schedule, whenever the indices are pulled.

Consumption and resume
    An index counts as consumed the moment the iterator yields it. :meth:`state_dict` describes the
    position right after the last index yielded (for ``W > 1``: after the whole round of ``W`` draws
    containing it), and :meth:`load_state_dict` restores it in O(1). What "consumed" means to training
    depends on the ``DataLoader``: with ``num_workers=0`` it takes a batch's indices only when that
    batch is requested, so a snapshot after step ``k`` covers exactly the batches of steps ``1..k``
    and a weight change reaches the very next batch. With workers it hands out the indices of
    ``num_workers * prefetch_factor`` batches ahead, so the sampler's own position runs that many
    batches ahead of the model and an :meth:`update_weights` call lands that late. Both have an exact
    answer that does not depend on prefetching: :meth:`set_schedule` fixes weight changes at draw
    indices before they are drawn, and :meth:`state_dict_at` gives the state at any draw index near
    the current one (for example the end of the last optimizer step), computed from the uniforms
    without touching data. A curriculum handler uses both to tie phases and
    checkpoints to optimizer steps. The sampler is the stream's only state: ``iter()`` again
    continues where the previous iterator stopped (that iterator ends); it does not restart.

The stream is infinite: ``len()`` raises ``TypeError``; bound the run by steps (ignite's
``epoch_length`` / ``max_steps``), not by epochs of the sampler.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from hookloop.engine.data.mixture import MixtureDataset
from hookloop.engine.errors import ConfigError

__all__ = ["MixtureSampler"]

_STATE_FORMAT = "hookloop-mixture-sampler"
_STATE_VERSION = 1
_CHOICE_TAG = 0x43484F49  # domain-separates the source-choice uniforms from the permutations
_PERM_TAG = 0x5045524D
_UNIFORM_BLOCK = 1 << 16  # draws per block of the uniform stream; part of the stream's definition
_PERM_GROUP = 4096  # sources shorter than this share one generator across several epochs
_MIN_CHUNK_DRAWS = 1024  # first chunk after a start, resume or weight change: cheap to throw away
_MAX_CHUNK_DRAWS = 1 << 16
_CACHED_BLOCKS = 2
_CACHED_GROUPS = 2
_KEPT_PAST_SEGMENTS = 64  # weight segments kept behind the position, so state_dict_at can rewind
_COUNT_BLOCK = 1 << 16  # draws per pass when state_dict_at counts sources between two positions


class _Segment:
    """Weights in force from global draw ``start`` until the next segment starts."""

    __slots__ = ("probs", "start", "temperature", "thresholds", "weights")

    def __init__(self, start: int, weights: np.ndarray, temperature: float) -> None:
        self.start = start
        self.weights = weights
        self.temperature = temperature
        probs = _tempered_probabilities(weights, temperature)
        cdf = np.cumsum(probs)
        # pin the total to exactly 1 from the last positive source on, so rounding can neither pick
        # a zero-weight source at the end nor fall off the table
        cdf[np.flatnonzero(probs > 0)[-1] :] = 1.0
        self.probs = probs
        self.thresholds = cdf[:-1].copy()


def _tempered_probabilities(weights: np.ndarray, temperature: float) -> np.ndarray:
    """``p_i = w_i**(1/T) / sum_j w_j**(1/T)``; a zero weight gives exactly zero at any ``T``.

    Positive weights are raised to ``1/T`` relative to the largest one, in log space, so neither the
    ratio nor the power can overflow or underflow early whatever the temperature; zero weights are
    never touched by the arithmetic (no epsilon), so they stay exactly zero.
    """
    positive = weights > 0
    if temperature == 1.0:
        scaled = weights / weights.max()
    else:
        scaled = np.zeros_like(weights)
        logs = np.log(weights[positive])
        scaled[positive] = np.exp((logs - logs.max()) / temperature)
    return scaled / scaled.sum()


@dataclasses.dataclass(slots=True, eq=False)
class _Chunk:
    """Indices precomputed for the next rounds, and how many of them were yielded."""

    start: int
    sources: np.ndarray
    own_sources: np.ndarray
    indices: list[int]
    consumed: int = 0


class MixtureSampler(Sampler[int]):
    """Endless weighted sampler over the sources of a :class:`MixtureDataset`.

    ``weights`` maps every source name to a finite weight ``>= 0`` (not all zero); the probability
    of drawing source ``i`` is ``w_i**(1/temperature)`` normalised, so ``temperature > 1`` flattens
    the mixture, ``< 1`` sharpens it, and a zero weight always stays exactly zero.
    ``rank``/``world_size`` split one global stream disjointly between data-parallel ranks; every
    rank must be built with the same mixture, seed and weights. See the module documentation for
    the stream, resume and prefetch semantics.
    """

    def __init__(
        self,
        mixture: MixtureDataset,
        weights: Mapping[str, float],
        *,
        temperature: float = 1.0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not isinstance(mixture, MixtureDataset):
            raise TypeError(f"mixture: expected a MixtureDataset, got {type(mixture).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ConfigError("seed", f"must be an integer >= 0, got {seed!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int | np.integer) or world_size < 1:
            raise ConfigError("world_size", f"must be an integer >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < world_size:
            raise ConfigError("rank", f"must be an integer in [0, world_size={world_size}), got {rank!r}")
        super().__init__()
        self._mixture = mixture
        self._names = mixture.names
        self._lengths = np.asarray(mixture.lengths, dtype=np.int64)
        self._offsets = np.asarray(mixture.offsets, dtype=np.int64)
        self._keys = [zlib.crc32(name.encode("utf-8")) for name in self._names]
        self._rank = int(rank)
        self._world_size = int(world_size)
        self._seed = int(seed)
        self._segments = [_Segment(0, self._check_weights(weights), self._check_temperature(temperature))]
        self._source_dtype = np.int16 if len(self._names) <= 17 else np.int32
        self._draws = 0
        self._loads = 0  # bumped by load_state_dict, so a wrapper can tell a jump from prefetching
        self._taken = np.zeros(len(self._names), dtype=np.int64)
        self._yielded = np.zeros(len(self._names), dtype=np.int64)
        self._chunk: _Chunk | None = None
        self._chunk_draws = _MIN_CHUNK_DRAWS
        self._iter_token: object | None = None
        # while logging: the chunks whose yielded indices are not all taken yet, and how many of the
        # first one's were taken
        self._index_log: collections.deque[_Chunk] | None = None
        self._log_taken = 0
        self._block_cache: dict[int, np.ndarray] = {}
        self._group_cache: list[dict[int, np.ndarray]] = [{} for _ in self._names]

    # ------------------------------------------------------------------ validation

    def _check_weights(self, weights: Mapping[str, float]) -> np.ndarray:
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights: expected a mapping name -> weight, got {type(weights).__name__}")
        unknown = [name for name in weights if name not in self._names]
        if unknown:
            raise ConfigError(
                "weights", f"unknown dataset name(s) {unknown}; the mixture's names are {list(self._names)}"
            )
        missing = [name for name in self._names if name not in weights]
        if missing:
            raise ConfigError(
                "weights",
                f"no weight for dataset(s) {missing}; give every source a weight (0 to leave it out)",
            )
        values = np.zeros(len(self._names), dtype=np.float64)
        for i, name in enumerate(self._names):
            raw = weights[name]
            field = f"weights[{name!r}]"
            if isinstance(raw, str | bytes | bool):
                raise TypeError(f"{field}: expected a number, got {type(raw).__name__} {raw!r}")
            try:
                value = float(raw)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{field}: expected a number, got {type(raw).__name__} {raw!r}") from exc
            if not math.isfinite(value):
                raise ConfigError(field, f"must be finite, got {value}")
            if value < 0:
                raise ConfigError(field, f"must be >= 0, got {value}")
            if value > 0 and self._lengths[i] == 0:
                raise ConfigError(field, f"is {value} but dataset {name!r} is empty; give it weight 0")
            values[i] = value
        if not values.any():
            raise ConfigError("weights", "are all zero; give at least one dataset a positive weight")
        return values

    @staticmethod
    def _check_temperature(temperature: float) -> float:
        if isinstance(temperature, str | bytes | bool) or not isinstance(
            temperature, int | float | np.number
        ):
            raise TypeError(f"temperature: expected a number, got {type(temperature).__name__}")
        value = float(temperature)
        if not math.isfinite(value) or value <= 0:
            raise ConfigError("temperature", f"must be finite and > 0, got {temperature!r}")
        return value

    def _check_changes(
        self, changes: Sequence[Sequence[Any]], after: int, field: str, temperature: float
    ) -> list[_Segment]:
        """``[(draw, weights[, temperature]), ...]`` -> segments with draws strictly increasing from
        ``after`` on; a change without a temperature keeps the previous one (first: ``temperature``)."""
        if isinstance(changes, str | bytes | Mapping) or not isinstance(changes, Sequence):
            raise TypeError(f"{field}: expected a list of (draw, weights[, temperature]) entries")
        segments: list[_Segment] = []
        for i, change in enumerate(changes):
            entry = f"{field}[{i}]"
            if (
                isinstance(change, str | bytes | Mapping)
                or not isinstance(change, Sequence)
                or not (2 <= len(change) <= 3)
            ):
                raise TypeError(
                    f"{entry}: expected (draw, weights) or (draw, weights, temperature), got {change!r}"
                )
            draw = change[0]
            if isinstance(draw, bool) or not isinstance(draw, int | np.integer):
                raise TypeError(f"{entry}: the draw index must be an integer, got {draw!r}")
            draw = int(draw)
            if draw < after:
                raise ConfigError(
                    entry,
                    f"starts at draw {draw}, but draws up to {after} are already taken; schedule changes "
                    "before the loader draws them (e.g. at TRAIN_START)",
                )
            if segments and draw <= segments[-1].start:
                raise ConfigError(
                    entry, f"draw {draw} must be after the previous change's draw {segments[-1].start}"
                )
            if len(change) == 3 and change[2] is not None:
                temperature = self._check_temperature(change[2])
            segments.append(_Segment(draw, self._check_weights(change[1]), temperature))
        return segments

    def _segment_at(self, draw: int) -> _Segment:
        segments = self._segments
        if len(segments) == 1 or draw < segments[1].start:
            return segments[0]
        return segments[bisect.bisect_right([seg.start for seg in segments], draw) - 1]

    def _replace_future(self, segments: list[_Segment]) -> None:
        """Drop every segment starting at or after ``segments[0].start``, then append ``segments``."""
        start = segments[0].start
        kept = [seg for seg in self._segments if seg.start < start]
        if not kept:  # the new first segment also covers the draws back to the old floor
            segments[0] = _Segment(self._segments[0].start, segments[0].weights, segments[0].temperature)
        merged = kept + segments
        past = bisect.bisect_right([seg.start for seg in merged], self._draw_position()) - 1
        if past > _KEPT_PAST_SEGMENTS:  # bound the history; state_dict_at cannot rewind before it
            merged = merged[past - _KEPT_PAST_SEGMENTS :]
        self._segments = merged

    # ------------------------------------------------------------------ public API

    @property
    def mixture(self) -> MixtureDataset:
        """The dataset whose global indices this sampler yields."""
        return self._mixture

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def temperature(self) -> float:
        """The temperature in force for the next draw."""
        return self._segment_at(self._draw_position()).temperature

    @property
    def weights(self) -> dict[str, float]:
        """The raw weights (before the temperature) in force for the next draw."""
        segment = self._segment_at(self._draw_position())
        return {name: float(w) for name, w in zip(self._names, segment.weights)}

    @property
    def probabilities(self) -> dict[str, float]:
        """Probability of each source for the next draw: weights tempered and normalised."""
        return {name: float(p) for name, p in zip(self._names, self._segment_at(self._draw_position()).probs)}

    @property
    def schedule(self) -> list[tuple[int, dict[str, float], float]]:
        """``(first draw, weights, temperature)`` of the segment in force and of every later one."""
        position = self._draw_position()
        return [
            (seg.start, {name: float(w) for name, w in zip(self._names, seg.weights)}, seg.temperature)
            for seg in self._segments
            if seg is self._segment_at(position) or seg.start > position
        ]

    @property
    def draws(self) -> int:
        """Global draws (all ranks) consumed so far; ``world_size`` times this rank's yields since 0."""
        return self._position()[0]

    def consumed_per_source(self, *, all_ranks: bool = False) -> dict[str, int]:
        """Indices yielded per source by this rank, or with ``all_ranks`` taken by all ranks' draws."""
        _, taken, yielded = self._position()
        counts = taken if all_ranks else yielded
        return {name: int(c) for name, c in zip(self._names, counts)}

    def log_indices(self) -> None:
        """From now on keep every index this sampler yields, in order, until :meth:`take_logged`
        takes it (what ``data.trace_samples`` reads). A :meth:`load_state_dict` (a jump) drops the
        indices not yet taken. Logging changes nothing in the stream."""
        if self._index_log is None:
            self._index_log = collections.deque()
            self._invalidate()  # the next index comes from a chunk that logs

    def take_logged(self, count: int | None = None) -> list[int]:
        """The oldest ``count`` logged indices (all of them when None), removed from the log."""
        log = self._index_log
        if log is None:
            raise RuntimeError("this sampler does not log its indices: call log_indices() first")
        available = sum(chunk.consumed for chunk in log) - self._log_taken
        if count is None:
            count = available
        elif count > available:
            raise RuntimeError(
                f"{count} logged indices asked for, {available} were yielded since the last take"
            )
        out: list[int] = []
        while len(out) < count:
            chunk = log[0]
            take = min(chunk.consumed - self._log_taken, count - len(out))
            out.extend(chunk.indices[self._log_taken : self._log_taken + take])
            self._log_taken += take
            if self._log_taken == chunk.consumed and chunk is not self._chunk:  # done yielding
                log.popleft()
                self._log_taken = 0
        return out

    def update_weights(self, weights: Mapping[str, float], temperature: float | None = None) -> None:
        """Set new weights (and optionally temperature), effective from the very next index yielded.

        On several ranks the change applies from the next round of ``world_size`` draws, so every
        rank must call this after the same number of yielded indices. Changes scheduled for later
        draws (:meth:`set_schedule`) are dropped. Invalid input leaves the sampler unchanged.
        """
        self._schedule([(self._draw_position(), weights, temperature)], "weights")

    def set_schedule(self, changes: Sequence[Sequence[Any]]) -> None:
        """Lay out weight changes at future global draw indices, replacing any scheduled before.

        ``changes`` is ``[(draw, weights), ...]`` or ``[(draw, weights, temperature), ...]`` with
        strictly increasing ``draw >= self.draws``: ``weights`` apply from global draw ``draw`` on
        (the temperature carries over when not given). Draws before the first change keep the
        weights in force now. Every rank must set the same schedule. Invalid input leaves the
        sampler unchanged.
        """
        self._schedule(changes, "changes")

    def _schedule(self, changes: Sequence[Sequence[Any]], field: str) -> None:
        position = self._draw_position()
        current = self._segment_at(position).temperature
        segments = self._check_changes(changes, position, field, current)
        if segments:
            self._invalidate()
            self._replace_future(segments)

    def __len__(self) -> int:
        raise TypeError(
            "MixtureSampler is an endless stream and has no length; bound the run by steps "
            "(e.g. ignite's epoch_length or max_steps)"
        )

    def __iter__(self) -> Iterator[int]:
        token = object()
        self._invalidate()  # an older iterator stops here; this one continues its stream
        self._iter_token = token
        while self._iter_token is token:
            chunk = self._build_chunk()
            self._chunk = chunk
            if self._index_log is not None:  # logged by chunk: no cost per index
                self._index_log.append(chunk)
            for consumed, index in enumerate(chunk.indices, 1):
                chunk.consumed = consumed
                yield index
                if self._chunk is not chunk:  # weights changed, state loaded or a new iterator started
                    break
            else:
                self._commit()
                self._chunk_draws = min(2 * self._chunk_draws, _MAX_CHUNK_DRAWS)

    def state_dict(self) -> dict[str, Any]:
        """The position right after the last index yielded, as plain Python values (JSON-safe)."""
        return self._state(*self._position())

    def state_dict_at(self, draws: int) -> dict[str, Any]:
        """The :meth:`state_dict` the sampler has (or will have) when its position is global draw ``draws``.

        Recomputes the sources of the draws in between (no data access; cost proportional to the
        distance). ``draws`` must differ from the current position by whole rounds of
        ``world_size`` draws and must not lie before the weight history the sampler keeps (the last
        64 weight changes, back to its creation or last :meth:`load_state_dict`).
        """
        if isinstance(draws, bool) or not isinstance(draws, int | np.integer):
            raise TypeError(f"draws: expected an integer, got {draws!r}")
        draws = int(draws)
        current, taken, yielded = self._position()
        if (draws - current) % self._world_size:
            raise ConfigError(
                "draws",
                f"{draws} is not a whole number of rounds of world_size={self._world_size} draws away from "
                f"the current position {current}",
            )
        if draws < self._segments[0].start:
            raise ConfigError(
                "draws",
                f"{draws} is before draw {self._segments[0].start}, the oldest position whose weights this "
                "sampler still knows",
            )
        lo, hi, sign = (current, draws, 1) if draws >= current else (draws, current, -1)
        n = len(self._names)
        start = lo
        while start < hi:
            count = min(_COUNT_BLOCK * self._world_size, hi - start)
            sources = self._sources(start, count)
            taken = taken + sign * np.bincount(sources, minlength=n)
            yielded = yielded + sign * np.bincount(sources[self._rank :: self._world_size], minlength=n)
            start += count
        return self._state(draws, taken, yielded)

    def _state(self, draws: int, taken: np.ndarray, yielded: np.ndarray) -> dict[str, Any]:
        segment = self._segment_at(draws)
        sources = {}
        for name, length, count, own in zip(self._names, self._lengths, taken, yielded):
            epoch, cursor = divmod(int(count), int(length)) if length else (0, 0)
            sources[name] = {"length": int(length), "epoch": epoch, "cursor": cursor, "yielded": int(own)}
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "seed": self._seed,
            "draws": draws,
            "temperature": segment.temperature,
            "weights": {name: float(w) for name, w in zip(self._names, segment.weights)},
            "schedule": [
                [seg.start, {name: float(w) for name, w in zip(self._names, seg.weights)}, seg.temperature]
                for seg in self._segments
                if seg.start > draws
            ],
            "sources": sources,
            "rank": self._rank,
            "world_size": self._world_size,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` in O(1); the next index is the one the saved run yields next.

        The seed, weights, temperature, scheduled changes and position come from ``state_dict``;
        ``rank`` and ``world_size`` stay this sampler's, so a run may resume on a different number of
        ranks (all ranks must load the same ``draws``; the per-rank ``yielded`` counts of
        :meth:`consumed_per_source` then continue from the loaded state's rank's). Raises
        ``ConfigError`` when the state does not belong to this mixture.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
        if state_dict.get("format") != _STATE_FORMAT or state_dict.get("version") != _STATE_VERSION:
            raise ConfigError(
                "state_dict",
                f"expected format {_STATE_FORMAT!r} version {_STATE_VERSION}, got "
                f"{state_dict.get('format')!r} version {state_dict.get('version')!r}",
            )
        sources = state_dict.get("sources")
        if not isinstance(sources, Mapping) or list(sources) != list(self._names):
            got = list(sources) if isinstance(sources, Mapping) else sources
            raise ConfigError(
                "state_dict",
                f"was saved for sources {got}, this mixture has {list(self._names)}; build the same mixture",
            )
        taken = np.zeros(len(self._names), dtype=np.int64)
        yielded = np.zeros(len(self._names), dtype=np.int64)
        for i, name in enumerate(self._names):
            entry = sources[name]
            length = int(self._lengths[i])
            if entry.get("length") != length:
                raise ConfigError(
                    f"state_dict['sources'][{name!r}]",
                    f"was saved for a dataset of length {entry.get('length')}, this one has {length}; "
                    "the permutations would differ, so rebuild the dataset exactly",
                )
            epoch, cursor, own = int(entry["epoch"]), int(entry["cursor"]), int(entry["yielded"])
            if epoch < 0 or own < 0 or not (0 <= cursor < length or cursor == length == 0):
                raise ConfigError(
                    f"state_dict['sources'][{name!r}]", f"has an invalid position {dict(entry)}"
                )
            taken[i] = epoch * length + cursor
            yielded[i] = own
        draws = int(state_dict["draws"])
        if draws != int(taken.sum()):
            raise ConfigError(
                "state_dict['draws']",
                f"is {draws} but the sources' positions add up to {int(taken.sum())} draws; "
                "the state is corrupted or was edited by hand",
            )
        seed = int(state_dict["seed"])
        if seed < 0:
            raise ConfigError("state_dict['seed']", f"must be >= 0, got {seed}")
        weights = self._check_weights(state_dict["weights"])
        first = _Segment(draws, weights, self._check_temperature(state_dict["temperature"]))
        later = self._check_changes(
            state_dict.get("schedule", []), draws + 1, "state_dict['schedule']", first.temperature
        )

        self._invalidate()
        if seed != self._seed:
            self._block_cache.clear()
            for cache in self._group_cache:
                cache.clear()
        self._seed = seed
        self._segments = [first, *later]
        self._loads += 1
        if self._index_log is not None:  # indices yielded before the jump are not the new position's
            self._index_log.clear()
            self._log_taken = 0
        self._draws = draws
        self._taken = taken
        self._yielded = yielded

    # ------------------------------------------------------------------ stream mechanics

    def _draw_position(self) -> int:
        """Global draws consumed, right after the last index yielded (cheap form of ``_position()[0]``)."""
        chunk = self._chunk
        if chunk is None or chunk.consumed == 0:
            return self._draws
        return chunk.start + chunk.consumed * self._world_size

    def _position(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(draws, taken per source, yielded per source) right after the last index yielded."""
        chunk = self._chunk
        if chunk is None or chunk.consumed == 0:
            return self._draws, self._taken.copy(), self._yielded.copy()
        n = len(self._names)
        done = chunk.consumed * self._world_size
        taken = self._taken + np.bincount(chunk.sources[:done], minlength=n)
        yielded = self._yielded + np.bincount(chunk.own_sources[: chunk.consumed], minlength=n)
        return chunk.start + done, taken, yielded

    def _commit(self) -> None:
        """Fold the yielded part of the current chunk into the counters and drop the rest."""
        if self._chunk is not None:
            self._draws, self._taken, self._yielded = self._position()
            self._chunk = None

    def _invalidate(self) -> None:
        self._commit()
        self._chunk_draws = _MIN_CHUNK_DRAWS

    def _uniform_block(self, block: int) -> np.ndarray:
        cached = self._block_cache.get(block)
        if cached is None:
            rng = np.random.default_rng(np.random.SeedSequence([self._seed, _CHOICE_TAG, block]))
            cached = rng.random(_UNIFORM_BLOCK)
            if len(self._block_cache) >= _CACHED_BLOCKS:
                del self._block_cache[min(self._block_cache)]
            self._block_cache[block] = cached
        return cached

    def _uniforms(self, start: int, count: int) -> np.ndarray:
        parts = []
        first, last = start // _UNIFORM_BLOCK, (start + count - 1) // _UNIFORM_BLOCK
        for block in range(first, last + 1):
            base = block * _UNIFORM_BLOCK
            lo, hi = max(start, base) - base, min(start + count, base + _UNIFORM_BLOCK) - base
            parts.append(self._uniform_block(block)[lo:hi])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _choose_sources(self, uniforms: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        if self._source_dtype == np.int16:
            sources = np.zeros(len(uniforms), dtype=np.int16)
            for threshold in thresholds:
                sources += uniforms >= threshold
            return sources
        return np.searchsorted(thresholds, uniforms, side="right").astype(np.int32)

    def _sources(self, start: int, count: int) -> np.ndarray:
        """Source of each global draw in ``[start, start + count)``, each under its own segment's weights."""
        uniforms = self._uniforms(start, count)
        segments = self._segments
        end = start + count
        i = bisect.bisect_right([seg.start for seg in segments], start) - 1
        next_start = segments[i + 1].start if i + 1 < len(segments) else end
        if next_start >= end:  # the common case: one segment covers the whole range
            return self._choose_sources(uniforms, segments[i].thresholds)
        out = np.empty(count, dtype=self._source_dtype)
        pos = start
        while pos < end:
            hi = min(segments[i + 1].start if i + 1 < len(segments) else end, end)
            part = slice(pos - start, hi - start)
            out[part] = self._choose_sources(uniforms[part], segments[i].thresholds)
            pos, i = hi, i + 1
        return out

    def _group_size(self, source: int) -> int:
        return max(1, _PERM_GROUP // int(self._lengths[source]))

    def _permutation_group(self, source: int, group: int) -> np.ndarray:
        """Permutations of epochs ``[group*G, (group+1)*G)`` of ``source``, concatenated."""
        cache = self._group_cache[source]
        perms = cache.get(group)
        if perms is None:
            length = int(self._lengths[source])
            size = self._group_size(source)
            seq = np.random.SeedSequence([self._seed, _PERM_TAG, self._keys[source], length, group])
            rng = np.random.default_rng(seq)
            if size == 1:
                perms = rng.permutation(length)
            else:
                perms = rng.permuted(np.broadcast_to(np.arange(length), (size, length)), axis=1).ravel()
            if len(cache) >= _CACHED_GROUPS:
                del cache[min(cache)]
            cache[group] = perms
        return perms

    def _local_indices(self, source: int, positions: np.ndarray) -> np.ndarray:
        """Item of ``source`` at each absolute position (ascending) of its epoch sequence."""
        span = self._group_size(source) * int(self._lengths[source])
        first, last = int(positions[0]) // span, int(positions[-1]) // span
        if first == last:
            return self._permutation_group(source, first)[positions - first * span]
        out = np.empty_like(positions)
        bounds = np.searchsorted(positions, np.arange(first + 1, last + 1, dtype=np.int64) * span).tolist()
        lo = 0
        for group, hi in zip(range(first, last + 1), [*bounds, len(positions)]):
            if hi > lo:
                out[lo:hi] = self._permutation_group(source, group)[positions[lo:hi] - group * span]
            lo = hi
        return out

    def _build_chunk(self) -> _Chunk:
        world = self._world_size
        rounds = max(1, self._chunk_draws // world)
        count = rounds * world
        sources = self._sources(self._draws, count)
        num_sources = len(self._names)
        # occurrence number of each draw within its source: the draw's offset from the source's cursor
        per_source = np.bincount(sources, minlength=num_sources)
        order = np.argsort(sources, kind="stable")
        occurrence = np.empty(count, dtype=np.int64)
        occurrence[order] = np.arange(count, dtype=np.int64) - np.repeat(
            np.cumsum(per_source) - per_source, per_source
        )
        own = slice(self._rank, count, world)
        own_sources = sources[own]
        positions = self._taken[own_sources] + occurrence[own]
        indices = np.empty(rounds, dtype=np.int64)
        for source in np.flatnonzero(np.bincount(own_sources, minlength=num_sources)).tolist():
            mine = np.flatnonzero(own_sources == source)
            indices[mine] = self._offsets[source] + self._local_indices(source, positions[mine])
        return _Chunk(self._draws, sources, own_sources, indices.tolist())

    def __repr__(self) -> str:
        probs = ", ".join(f"{name}={p:.4g}" for name, p in self.probabilities.items())
        return (
            f"MixtureSampler({probs}; temperature={self.temperature:g}, seed={self._seed}, "
            f"rank={self._rank}/{self._world_size}, draws={self.draws})"
        )
