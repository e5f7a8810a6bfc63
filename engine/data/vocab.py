"""Does the model's vocabulary cover the data's? Checked before any run starts.

The data's vocabulary is the largest over ``data.datasets``. The built-in ``stdlib_docs`` /
``stdlib_source`` corpora have 256 (they are tokenized byte-level). A token file has what its
sidecar says (``vocab_size``; a byte-level sidecar 256) and at least its largest id + 1, read from
the file itself with ``numpy.memmap`` in chunks (a few milliseconds per 100 MB once the file is in
the page cache): always when the sidecar does not say, and to verify the sidecar's word when the
file is at most :data:`SCAN_BYTES` long (larger files are taken at the sidecar's word). The model's
vocabulary is its ``vocab_size`` argument: set in the config's ``model`` section, else the default
of the factory's ``vocab_size`` parameter. A factory without a ``vocab_size`` parameter is not
checked here (the first microbatch through the model is, by ``hookloop check``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hookloop.engine.data.token_dataset import (
    BYTE_VOCAB_SIZE,
    SUPPORTED_TOKEN_DTYPES,
    read_token_metadata,
    token_file_vocab_size,
)
from hookloop.engine.errors import ConfigError

__all__ = [
    "BUILTIN_CORPORA",
    "SCAN_BYTES",
    "DataVocab",
    "check_model_vocab",
    "data_vocab",
    "largest_token_id",
    "model_vocab_size",
]

#: Dataset sources ``hookloop train`` tokenizes itself, byte-level.
BUILTIN_CORPORA = ("stdlib_docs", "stdlib_source")
#: Token files up to this size are read whole to verify their sidecar's ``vocab_size``.
SCAN_BYTES = 1 << 30
_CHUNK = 1 << 24  # ids per read: 16 Mi ids, at most 64 MB of memory at a time


@dataclass(frozen=True)
class DataVocab:
    """The ids a dataset needs (largest id + 1), which dataset, and how it is known."""

    size: int
    name: str
    origin: str


def largest_token_id(path: str | Path, dtype: Any) -> int | None:
    """The largest id in token file ``path`` of ``dtype`` (None for an empty file), read in chunks
    so memory stays bounded whatever the file's size."""
    if Path(path).stat().st_size == 0:
        return None
    ids = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    return max(int(ids[i : i + _CHUNK].max()) for i in range(0, ids.size, _CHUNK))


def _file_vocab(name: str, source: str) -> DataVocab | None:
    claim = token_file_vocab_size(source)
    dtype = (read_token_metadata(source) or {}).get("dtype")
    size = Path(source).stat().st_size
    largest = None
    if (
        dtype in SUPPORTED_TOKEN_DTYPES
        and size % np.dtype(dtype).itemsize == 0  # else the dataset refuses the file when built
        and (claim is None or size <= SCAN_BYTES)
    ):
        largest = largest_token_id(source, dtype)
    if largest is not None and (claim is None or largest >= claim):
        said = "" if claim is None else f", above its sidecar's vocab_size {claim}"
        return DataVocab(largest + 1, name, f"its largest token id is {largest}{said}")
    if claim is not None:
        return DataVocab(claim, name, "its sidecar's vocab_size")
    return None


def data_vocab(datasets: Mapping[str, str]) -> DataVocab | None:
    """The largest vocabulary among ``datasets`` (name -> token file or built-in corpus); None when
    no dataset says."""
    best: DataVocab | None = None
    for name, source in datasets.items():
        if source in BUILTIN_CORPORA:
            found = DataVocab(BYTE_VOCAB_SIZE, name, "a built-in byte-level corpus")
        elif Path(source).is_file():
            try:
                found = _file_vocab(name, source)
            except ConfigError as e:  # a sidecar that is not JSON: the dataset's field, as the run reads it
                raise ConfigError(f"data.datasets.{name}", str(e).partition(": ")[2]) from None
        else:
            found = None
        if found is not None and (best is None or found.size > best.size):
            best = found
    return best


def _model_vocab_size(build: Callable[..., Any], args: Mapping[str, Any]) -> tuple[int | None, bool]:
    """``(vocab_size, from_default)``; ``(None, False)`` when the factory takes no integer ``vocab_size``."""
    if "vocab_size" in args:
        vocab, from_default = args["vocab_size"], False
    else:
        try:
            parameter = inspect.signature(build).parameters.get("vocab_size")
        except (TypeError, ValueError):  # no signature (a builtin or C callable)
            parameter = None
        vocab = None if parameter is None else parameter.default
        from_default = True
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        return None, False
    return vocab, from_default


def model_vocab_size(build: Callable[..., Any], args: Mapping[str, Any]) -> int | None:
    """The ``vocab_size`` the model built by ``build(**args)`` gets (set or the factory's default),
    None when it takes none."""
    return _model_vocab_size(build, args)[0]


def check_model_vocab(
    build: Callable[..., Any], args: Mapping[str, Any], datasets: Mapping[str, str]
) -> None:
    """Raise :class:`ConfigError` on ``model.vocab_size`` when the model built by ``build(**args)``
    has fewer token ids than the data in ``datasets`` uses."""
    vocab, from_default = _model_vocab_size(build, args)
    found = None if vocab is None else data_vocab(datasets)
    if found is None or found.size <= vocab:
        return
    default = " (the factory's default)" if from_default else ""
    raise ConfigError(
        "model.vocab_size",
        f"{vocab}{default} is smaller than the data's vocabulary: data.datasets.{found.name} "
        f"({datasets[found.name]}) has {found.size} token ids ({found.origin}); set "
        f"model.vocab_size={found.size} or more",
    )
