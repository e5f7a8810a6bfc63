"""The data a run config names: token files, the built-in corpora, or a factory of your own.

``data.datasets`` names token files (``hookloop prepare``) or ``stdlib_docs`` / ``stdlib_source``;
``data.target`` (with ``data.args``) names a factory returning one map-style ``Dataset`` or a dict
of named ones. Either way the datasets are mixed by ``data.weights`` (and the phase curriculum) by a
:class:`~engine.data.MixtureSampler`, so the run keeps the shipped data's guarantees: exact resume,
elastic resume across data-parallel sizes, sample traces, and a validation set (the tail
``data.val_fraction`` of each dataset, the first ``data.val_samples`` of it shared evenly among the
data-parallel ranks) that is the same whatever the world size.

``data.args`` are the factory's keyword arguments (``seq_len``, when it takes one and the config
leaves it out, is ``train.seq_len``). A factory's samples reach the model recipe's ``collate_fn``
exactly as its datasets return them (token files give ``(input_ids, labels, source_idx)``). It is
called before any process group exists, with the global seed set: once by the check every run
makes first (``hookloop check``, :mod:`hookloop.first_step`), once to build the data; it must
return the same samples in the same order every time (resume and every rank rely on it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hookloop.engine.data import (
    DOC_SEPARATOR,
    MixtureDataset,
    MixtureLoader,
    MixtureSampler,
    TokenDataset,
    prepare_tokens,
    stdlib_docs_text,
    stdlib_source_files,
)
from hookloop.engine.data.loader import read_quarantine
from hookloop.engine.errors import ConfigError
from hookloop.engine.targets import accepted_names, bind_arguments, resolve_target

__all__ = ["RunData", "build_data", "check_data", "validation_indices"]

BUILTIN_SOURCES = {"stdlib_docs", "stdlib_source"}


def check_data(cfg: Any) -> None:
    """What can be checked before anything is built: every token file exists (the built-in corpora
    are made on first use), or ``data.target`` resolves and ``data.args`` fit its signature."""
    data = cfg.data
    if data.target is not None:
        factory = resolve_target(data.target, "data.target")
        if not callable(factory):
            raise ConfigError(
                "data.target",
                f"{data.target} is a {type(factory).__name__}: name a factory returning datasets",
            )
        bind_arguments(factory, _data_args(cfg, factory), prefix="data.args", target=data.target)
        return
    for name, source in data.datasets.items():
        if source not in BUILTIN_SOURCES and not Path(source).is_file():
            raise ConfigError(
                f"data.datasets.{name}",
                f"{source} is not a file; give a token file (hookloop prepare OUT --files ...) "
                f"or one of {', '.join(sorted(BUILTIN_SOURCES))}",
            )


def _data_args(cfg: Any, factory: Any) -> dict[str, Any]:
    """``data.args``, with ``seq_len`` from ``train.seq_len`` when the factory takes it and the
    config leaves it out (as for the model)."""
    args = dict(cfg.data.args)
    if "seq_len" not in args and "seq_len" in (accepted_names(factory) or ()):
        args["seq_len"] = cfg.train.seq_len
    return args


def token_file(source: str, cache_dir: Path) -> Path:
    """The token file for a dataset entry: a built-in corpus (tokenized once) or a path."""
    if source not in BUILTIN_SOURCES:
        return Path(source)
    path = cache_dir / f"{source}.u8"
    if not path.exists():  # every rank writes the same bytes; the write is an atomic rename
        cache_dir.mkdir(parents=True, exist_ok=True)
        docs = [stdlib_docs_text()] if source == "stdlib_docs" else stdlib_source_files()
        prepare_tokens(docs, path)
    return path


def builtin_tokens(source: str) -> np.ndarray:
    """The byte tokens of a built-in corpus, in memory: what :func:`token_file` writes for it."""
    if source == "stdlib_docs":
        docs = [stdlib_docs_text().encode("utf-8")]
    else:
        docs = [path.read_bytes() for path in stdlib_source_files()]
    return np.frombuffer(bytes([DOC_SEPARATOR]).join(docs), dtype=np.uint8)


def _token_dataset(name: str, source: str, cfg: Any, write_cache: bool) -> TokenDataset:
    cache, seq_len = Path(cfg.data.cache_dir), cfg.train.seq_len
    try:
        if source in BUILTIN_SOURCES and not write_cache and not (cache / f"{source}.u8").exists():
            return TokenDataset.from_tokens(builtin_tokens(source), seq_len, name=source)
        return TokenDataset(token_file(source, cache), seq_len)
    except ConfigError as e:  # the dataset's own argument names, as the config's fields
        field = "train.seq_len" if e.field == "seq_len" else f"data.datasets.{name}"
        raise ConfigError(field, str(e).partition(": ")[2]) from None


def named_datasets(cfg: Any, *, write_cache: bool = True) -> dict[str, Any]:
    """Name -> map-style dataset: the token files of ``data.datasets`` (windows of
    ``train.seq_len`` tokens), or what ``data.target`` returns. Weights and phases are checked
    against the names a target returned. A built-in corpus is tokenized into ``data.cache_dir`` on
    first use; with ``write_cache=False`` one not made yet is tokenized in memory instead."""
    data = cfg.data
    if data.target is None:
        return {
            name: _token_dataset(name, source, cfg, write_cache) for name, source in data.datasets.items()
        }
    factory = resolve_target(data.target, "data.target")
    try:
        made = factory(**_data_args(cfg, factory))
    except ConfigError:
        raise
    except Exception as e:  # one line for the command; the cause stays chained for Python callers
        raise ConfigError.caused_by("data.target", f"{data.target} fails", e) from e
    if isinstance(made, Mapping):
        if not made:
            raise ConfigError(
                "data.target", f"{data.target} returned an empty dict; return at least one dataset"
            )
        datasets = dict(made)
    else:
        datasets = {data.target.rsplit(":", 1)[1]: made}
    for name, dataset in datasets.items():
        where = f"data.target ({data.target}, dataset {name!r})"
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(
                "data.target",
                f"{data.target} returned a dataset named {name!r}; use non-empty names without ':'",
            )
        if not (
            callable(getattr(dataset, "__getitem__", None)) and callable(getattr(dataset, "__len__", None))
        ):
            raise ConfigError(
                where,
                f"is a {type(dataset).__name__}, not a map-style Dataset (with __len__ and __getitem__); "
                "an iterable stream cannot resume exactly: index your samples",
            )
        if len(dataset) == 0:
            raise ConfigError(where, "is empty")
    data.check_names(list(datasets))
    return datasets


def validation_indices(total: int, n_samples: int, rank: int, world: int) -> range:
    """This data-parallel rank's share of the first ``n_samples`` of ``total`` validation samples:
    an equal contiguous shard, so every world size validates the same samples (the last
    ``n_samples % world`` are left out when the world size does not divide it)."""
    per_rank = min(n_samples, total) // world
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass
class RunData:
    """The training loader (an endless, resumable mixture), the validation loader (None without
    validation samples) and the mixture's sampler."""

    train: MixtureLoader
    val: Any
    sampler: MixtureSampler


def build_data(
    cfg: Any,
    rank: int,
    world: int,
    collate_fn: Callable | None = None,
    *,
    num_workers: int | None = None,
    write_cache: bool = True,
    val_shard: tuple[int, int] | None = None,
) -> RunData:
    """Train loader over the weighted mixture (endless, resumable sampler) and a validation loader
    over ``data.val_samples`` held-out samples shared among the ``world`` data-parallel ranks
    (this process is ``rank``). ``collate_fn`` (default: torch's) turns a list of samples into a
    microbatch. ``num_workers`` overrides ``data.num_workers``; ``write_cache`` is
    :func:`named_datasets`'. ``val_shard``: ``(rank, world)`` of the validation's share when it is
    not the training's (replica groups each validate on the whole set: their ranks within the
    group)."""
    from torch.utils.data import DataLoader, Subset

    datasets = named_datasets(cfg, write_cache=write_cache)
    train_parts, val_parts = {}, {}
    for name, ds in datasets.items():
        n_val = max(1, int(len(ds) * cfg.data.val_fraction)) if cfg.data.val_fraction > 0 else 0
        if n_val >= len(ds):
            raise ConfigError(
                "data.val_fraction",
                f"holds out all {len(ds)} samples of dataset {name!r}; lower it or give more data",
            )
        train_parts[name] = Subset(ds, range(len(ds) - n_val))
        if n_val:
            val_parts[name] = Subset(ds, range(len(ds) - n_val, len(ds)))
    tag = cfg.data.target is None  # token files: samples carry their source; a target's stay as they are
    mixture = MixtureDataset(train_parts, tag_source=tag)
    weights = {name: cfg.data.weights.get(name, 1.0) for name in train_parts}
    sampler = MixtureSampler(
        mixture,
        weights,
        temperature=cfg.data.mix_temperature,
        seed=cfg.train.seed,
        rank=rank,
        world_size=world,
    )
    # The loader's position is the sampler's right after the batches training received, also with
    # worker prefetch, so resume is exact and O(1). Pipeline stages take whole microbatches only: a
    # batch a quarantine leaves short is filled back.
    train = MixtureLoader(
        sampler,
        cfg.train.local_batch_size,
        full_batches=cfg.distributed.pp_size > 1,
        num_workers=cfg.data.num_workers if num_workers is None else num_workers,
        collate_fn=collate_fn,
    )
    if cfg.data.quarantine is not None:  # samples an earlier run found bad: never fetched
        train.quarantine(read_quarantine(cfg.data.quarantine))
    val = None
    if val_parts and cfg.data.val_samples:
        val_set = MixtureDataset(val_parts, tag_source=tag)
        val_rank, val_world = val_shard or (rank, world)
        shard = Subset(val_set, validation_indices(len(val_set), cfg.data.val_samples, val_rank, val_world))
        # Pipeline stages take whole microbatches only: a partial last batch is dropped there.
        val = DataLoader(
            shard,
            batch_size=cfg.train.local_batch_size,
            collate_fn=collate_fn,
            drop_last=cfg.distributed.pp_size > 1,
        )
    return RunData(train, val, sampler)
