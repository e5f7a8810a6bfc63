"""Microbatches grouped into optimizer steps, and the data position that makes resume exact.

:class:`StepBatches` turns one pass over a microbatch iterable into lists of
``grad_accum_steps`` microbatches (the last one may be shorter) and knows where it is:
``consumed`` microbatches and ``steps`` groups taken in the current pass, the RNG states right
before the pass began (python, numpy, torch and the data's own generators, which decide a shuffled
``DataLoader``'s order), and the state of a stateful data source.

:meth:`StepBatches.load_state_dict` positions the next pass: a stateful source (the data itself
with ``state_dict``/``load_state_dict``, or the sampler of a ``DataLoader`` without worker
processes, whose sampler is never read ahead) restores its own position in O(1); any other
iterable is replayed from the pass's start RNG states and the consumed microbatches are skipped,
which costs O(consumed) fetches. Either way the RNG states current at ``load_state_dict`` are
reinstated only after the data has produced its first microbatch, because a ``DataLoader`` (and a
generator wrapping one) draws its base seed from the global RNG at the first ``next()``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

from hookloop.engine.errors import ConfigError
from hookloop.engine.rng import capture_rng, data_generators, restore_rng

__all__ = ["NO_DATA", "NoData", "StepBatches", "data_length", "iter_groups", "steps_in"]

_END = object()


def data_length(data: Any) -> int | None:
    """``len(data)``, or None for data without a length (iterators, iterable datasets' loaders,
    whose ``len()`` raises ``TypeError``, ``NotImplementedError`` or ``RuntimeError``)."""
    try:
        return len(data)
    except (TypeError, NotImplementedError, RuntimeError):
        return None


def steps_in(microbatches: int | None, grad_accum_steps: int) -> int | None:
    """Optimizer steps that ``microbatches`` microbatches make, ``grad_accum_steps`` to a step (a
    shorter last step counts); None when the number of microbatches is unknown."""
    return None if microbatches is None else math.ceil(microbatches / grad_accum_steps)


class NoData:
    """What a run without data (ignite's ``run(None, epoch_length=N)``) steps over: ``None``
    microbatches without end; the step's ``prepare_batch`` (or a STEP_START handler setting
    ``state.batch``) makes the data, and the epoch length ends each epoch."""

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)

    def __repr__(self) -> str:
        return "NO_DATA"


NO_DATA = NoData()


def iter_groups(microbatches: Iterable, size: int) -> Iterator[list]:
    """Lists of ``size`` consecutive microbatches; the last list may be shorter."""
    group: list = []
    for microbatch in microbatches:
        group.append(microbatch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class StepBatches:
    """Groups of ``grad_accum_steps`` microbatches from ``data``, with an exact data position.

    ``grad_accum_steps`` is read at the start of every pass (a callable returning it, so that a
    scheduler attached later can change it). ``skip_next`` drops that many microbatches at the
    start of the next pass.
    """

    def __init__(self, data: Iterable | None, grad_accum_steps: Any) -> None:
        self.data = data
        self._accum = grad_accum_steps if callable(grad_accum_steps) else (lambda: grad_accum_steps)
        self.skip_next = 0
        self.consumed = 0
        self.steps = 0
        self.passes = 0
        self._pass_start_rng: dict | None = None
        self._resume: dict | None = None

    @property
    def grad_accum_steps(self) -> int:
        return self._accum()

    def steps_per_pass(self) -> int | None:
        """Optimizer steps in one pass over the data, or None when the data has no length."""
        return steps_in(data_length(self.data), self.grad_accum_steps)

    def stateful_source(self) -> Any:
        """The object that can save and restore the data position itself, or None."""
        data = self.data
        if _is_stateful(data):
            return data
        if getattr(data, "num_workers", None) == 0:  # a DataLoader that does not read ahead
            batch_sampler = getattr(data, "batch_sampler", None)
            for candidate in (
                batch_sampler,
                getattr(batch_sampler, "sampler", None),
                getattr(data, "sampler", None),
            ):
                if _is_stateful(candidate):
                    return candidate
        return None

    def global_batch(self) -> int | None:
        """Samples per optimizer step over all data-parallel ranks, when the data tells: a loader's
        ``batch_size`` x its sampler's ranks (``world_size`` of a ``MixtureSampler``, ``num_replicas``
        of a ``DistributedSampler``) x ``grad_accum_steps``; else None."""
        data = self.data
        batch_size = getattr(data, "batch_size", None)
        sampler = getattr(data, "mixture_sampler", None)  # (an endless sampler has no truth value)
        if sampler is None:
            sampler = getattr(data, "sampler", None)
        ranks = getattr(sampler, "world_size", None)
        if ranks is None:
            ranks = getattr(sampler, "num_replicas", None)
        if not isinstance(batch_size, int) or not isinstance(ranks, int):
            return None
        return batch_size * ranks * self.grad_accum_steps

    def state_dict(self) -> dict[str, Any]:
        """The data position after the microbatches handed out so far in this pass."""
        state: dict[str, Any] = {
            "microbatches": self.consumed,
            "steps": self.steps,
            "grad_accum_steps": self.grad_accum_steps,
            "global_batch": self.global_batch(),
            "pass_start_rng": self._pass_start_rng,
        }
        source = self.stateful_source()
        if source is not None:
            state["source"] = source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass at ``state``'s position. The RNG states current at this call are
        reinstated once the data is positioned, so set them before calling."""
        generators = data_generators(self.data)
        self._resume = {**state, "rng_after": capture_rng(generators)}

    def _counted(self, it: Iterator, pending: Any) -> Iterator:
        """The microbatches of ``it`` (after ``pending``, one already fetched), each counted in
        ``consumed`` as it is handed out. At the data's last microbatch the source is run to its
        end before that microbatch is handed out, so whatever RNG it draws at its end (a sampler's
        next permutation) is part of the checkpoint of the step it completes."""
        size = data_length(self.data)
        while True:
            microbatch, pending = (pending, _END) if pending is not _END else (next(it, _END), _END)
            if microbatch is _END:
                return
            self.consumed += 1
            ended = False
            if self.consumed == size:
                pending = next(it, _END)
                ended = pending is _END
            yield microbatch
            if ended:
                return

    def __iter__(self) -> Iterator[list]:
        accum = self.grad_accum_steps
        generators = data_generators(self.data)
        resume, self._resume = self._resume, None
        saved_batch = resume.get("global_batch") if resume is not None else None
        current_batch = self.global_batch()
        if saved_batch and current_batch and saved_batch != current_batch:
            raise ConfigError(
                "grad_accum_steps",
                f"the checkpoint's data position was taken with {saved_batch} samples per "
                f"optimizer step over all data-parallel ranks, this run takes {current_batch} "
                "(batch_size x data-parallel ranks x grad_accum_steps); keep the global batch "
                "(step_scheduler.global_batch_size) so that each step takes the samples it would have "
                "taken without the restart",
            )
        skip, self.skip_next = self.skip_next, 0
        first_pass = self.passes == 0
        self.passes += 1
        self.consumed = self.steps = 0
        resumed_at = resume.get("microbatches", 0) if resume is not None else 0
        replay = resumed_at > 0 and "source" not in resume
        saved_accum = resume.get("grad_accum_steps") if resume is not None else None
        if replay and saved_accum not in (None, accum) and resumed_at == resume["steps"] * saved_accum:
            # Another accumulation (a resume on another number of data-parallel ranks with the same
            # global batch): the steps done are what counts, in this run's microbatches.
            resumed_at = resume["steps"] * accum
        if resume is not None and "source" in resume:
            self.stateful_source().load_state_dict(resume["source"])
        if replay and resume.get("pass_start_rng") is not None:
            restore_rng(resume["pass_start_rng"], generators)
        if resumed_at > 0:
            self._pass_start_rng = resume.get("pass_start_rng")
            self.consumed, self.steps = resumed_at, resume["steps"]
        else:
            self._pass_start_rng = capture_rng(generators)
        it = iter(self.data)
        if replay:
            skip += resumed_at
            self.consumed -= resumed_at
        for _ in range(skip):
            if next(it, _END) is _END:
                break
            self.consumed += 1
        pending: Any = _END
        if resume is not None:
            # Fetch the first microbatch before the RNG goes back: whatever the source draws at its
            # first next() (a DataLoader's base seed) must not shift the restored stream.
            pending = next(it, _END)
            restore_rng(resume["rng_after"], generators)
            if pending is _END:
                return
        yielded = False
        for group in iter_groups(self._counted(it, pending), accum):
            yielded = True
            self.steps += 1
            yield group
        if not yielded and first_pass and not skip and resume is None:
            raise ValueError("data yielded no microbatches: pass a non-empty dataset or loader")
