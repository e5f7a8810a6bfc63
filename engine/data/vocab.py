"""Does the model's vocabulary cover the data's? Checked before any run starts.

The data's vocabulary is the largest over ``data.datasets``: a token file's from its sidecar
(``vocab_size``; a byte-level file 256), the built-in ``stdlib_docs`` / ``stdlib_source`` corpora
256 (they are tokenized byte-level). The model's is its ``vocab_size`` argument: set in the config's
``model`` section, else the default of the factory's ``vocab_size`` parameter. A model factory
without a ``vocab_size`` parameter is not checked, nor is a token file without a sidecar.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from hookloop.engine.data.token_dataset import BYTE_VOCAB_SIZE, token_file_vocab_size
from hookloop.engine.errors import ConfigError

__all__ = ["BUILTIN_CORPORA", "check_model_vocab", "data_vocab_size"]

#: Dataset sources ``hookloop train`` tokenizes itself, byte-level.
BUILTIN_CORPORA = ("stdlib_docs", "stdlib_source")


def data_vocab_size(datasets: Mapping[str, str]) -> tuple[int, str] | None:
    """The largest vocabulary among ``datasets`` (name -> token file or built-in corpus) and the
    name of a dataset that has it; None when no dataset says."""
    best: tuple[int, str] | None = None
    for name, source in datasets.items():
        size = BYTE_VOCAB_SIZE if source in BUILTIN_CORPORA else token_file_vocab_size(source)
        if size is not None and (best is None or size > best[0]):
            best = (size, name)
    return best


def _model_vocab_size(build: Callable[..., Any], args: Mapping[str, Any]) -> tuple[Any, bool]:
    """``(vocab_size, from_default)``; ``(None, False)`` when the factory takes no ``vocab_size``."""
    if "vocab_size" in args:
        return args["vocab_size"], False
    try:
        parameter = inspect.signature(build).parameters.get("vocab_size")
    except (TypeError, ValueError):  # no signature (a builtin or C callable)
        return None, False
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None, False
    return parameter.default, True


def check_model_vocab(
    build: Callable[..., Any], args: Mapping[str, Any], datasets: Mapping[str, str]
) -> None:
    """Raise :class:`ConfigError` on ``model.vocab_size`` when the model built by ``build(**args)``
    has fewer token ids than the data in ``datasets`` uses."""
    vocab, from_default = _model_vocab_size(build, args)
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        return
    found = data_vocab_size(datasets)
    if found is None or found[0] <= vocab:
        return
    size, name = found
    source = datasets[name]
    origin = "a built-in byte-level corpus" if source in BUILTIN_CORPORA else "its sidecar's vocab_size"
    default = " (the factory's default)" if from_default else ""
    raise ConfigError(
        "model.vocab_size",
        f"{vocab}{default} is smaller than the data's vocabulary: data.datasets.{name} ({source}) has "
        f"{size} token ids ({origin}); set model.vocab_size={size} or more",
    )
