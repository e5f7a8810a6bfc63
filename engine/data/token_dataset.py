"""Fixed-length training windows over a flat file of token ids.

The file is a raw little-endian array of ``uint8``/``uint16``/``uint32`` ids (what
``hookloop prepare`` writes) read through ``numpy.memmap``, so a corpus much larger than RAM costs
only the pages a batch touches. The dtype comes from the ``<path>.json`` sidecar written next to the
file, or from the ``dtype`` argument when there is no sidecar.

Two sidecar versions are read. Version 1, byte-level (:func:`engine.data.prepare_tokens`):
``tokenizer: "utf8-bytes"``, ``dtype``, ``num_tokens``, ``num_documents``, ``separator`` (between
documents) and, in files written since tokenizers came, ``vocab_size``. Version 2, tokenized
(:mod:`engine.data.tokenized`): ``dtype``, ``vocab_size``, ``eos_id`` (after every document),
``documents``, ``tokens`` and ``tokenizer`` (what was used). :func:`token_file_vocab_size` gives the
ids a model needs for either.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from hookloop.engine.errors import ConfigError
from hookloop.engine.files import atomic_write, fsync_file

__all__ = [
    "BYTE_VOCAB_SIZE",
    "SUPPORTED_TOKEN_DTYPES",
    "TokenDataset",
    "read_token_metadata",
    "sidecar_path",
    "token_file_vocab_size",
]

SUPPORTED_TOKEN_DTYPES: tuple[str, ...] = ("uint8", "uint16", "uint32")
BYTE_VOCAB_SIZE = 256
"""The vocabulary of a byte-level token file: one id per byte value."""


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where the metadata of token file ``path`` lives: ``<path>.json``."""
    p = Path(path)
    return p.with_name(p.name + ".json")


def check_output(out_path: str | os.PathLike[str], field: str = "out_path") -> None:
    """A token file can be written to ``out_path``: neither it nor its sidecar (``<out_path>.json``)
    is a directory. A :class:`ConfigError` naming ``field`` otherwise, before any input is read."""
    out = Path(out_path)
    side = sidecar_path(out)
    if out.is_dir():
        raise ConfigError(field, f"{out} is a directory; name the token file to write (its sidecar: {side})")
    if side.is_dir():
        raise ConfigError(field, f"its sidecar {side} is a directory; move it or name another token file")


@contextlib.contextmanager
def writing_token_file(out_path: str | os.PathLike[str]) -> Iterator[tuple[BinaryIO, dict[str, Any]]]:
    """``(file, meta)``: write the tokens to ``file`` and fill ``meta``. On a clean exit the file is
    fsynced and becomes ``out_path``, with ``meta`` as its sidecar; otherwise nothing is left behind.

    The file is written under a temporary name of its own: several ranks, on several nodes whose
    pids may be the same (containers), may prepare the same file in a shared directory at once. The
    sidecar lands first and the token file last, so a reader that sees the token file finds its
    sidecar; when the token file cannot follow, the sidecar is put back as it was (a sidecar of
    someone else's is never left describing a file that is not there)."""
    check_output(out_path)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex}.tmp")
    meta: dict[str, Any] = {}
    try:
        with open(tmp, "wb") as fh:
            yield fh, meta
        fsync_file(tmp)
        side = sidecar_path(out)
        try:
            before: bytes | None = side.read_bytes()
        except FileNotFoundError:
            before = None
        atomic_write(side, json.dumps(meta, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except BaseException:
            if before is None:
                side.unlink(missing_ok=True)
            else:
                atomic_write(side, before)
            raise
    finally:
        if tmp.exists():
            tmp.unlink()


def read_token_metadata(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The sidecar metadata of token file ``path``, or None when there is no sidecar."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            "path", f"sidecar {str(side)!r} is not readable JSON ({exc}); rewrite it with prepare_tokens"
        ) from exc
    if not isinstance(meta, dict):
        raise ConfigError("path", f"sidecar {str(side)!r} must hold a JSON object, got {type(meta).__name__}")
    return meta


def _vocab_size(meta: dict[str, Any]) -> int | None:
    size = meta.get("vocab_size")
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    if meta.get("tokenizer") == "utf8-bytes":  # a byte-level sidecar written before vocab_size existed
        separator = meta.get("separator", 0)
        return max(BYTE_VOCAB_SIZE, separator + 1 if isinstance(separator, int) else 0)
    return None


def token_file_vocab_size(path: str | os.PathLike[str]) -> int | None:
    """The ids a model needs for token file ``path`` (largest id + 1), from its sidecar: its
    ``vocab_size``, or for a byte-level sidecar without one 256 (``separator + 1`` when larger).
    None when there is no sidecar or it does not say."""
    meta = read_token_metadata(path)
    return None if meta is None else _vocab_size(meta)


def _check_dtype(dtype: Any, field: str) -> np.dtype:
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in SUPPORTED_TOKEN_DTYPES:
        raise ConfigError(field, f"unsupported dtype {dtype!r}; use one of {list(SUPPORTED_TOKEN_DTYPES)}")
    return resolved.newbyteorder("<")


class TokenDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens with next-token labels.

    Item ``i`` reads tokens ``[i*seq_len, i*seq_len + seq_len + 1)`` and returns
    ``(input_ids, labels)``, two int64 tensors of length ``seq_len`` where ``labels`` is
    ``input_ids`` shifted left by one. ``len()`` is the number of full windows; the tail that does
    not fill one is never read. Windows share their boundary token (the last label of window ``i``
    is the first input of window ``i + 1``), so every token except the very first is a label once.

    The memory map is opened lazily and dropped on pickling, so the dataset is cheap to send to
    DataLoader worker processes.
    """

    def __init__(
        self, path: str | os.PathLike[str], seq_len: int, *, dtype: str | np.dtype | None = None
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 1:
            raise ConfigError("seq_len", f"must be an integer >= 1, got {seq_len!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"path: token file {str(self.path)!r} does not exist; create it with `hookloop prepare` "
                "or prepare_tokens"
            )
        meta = read_token_metadata(self.path)
        meta_dtype = None if meta is None else meta.get("dtype")
        if dtype is None and meta_dtype is None:
            raise ConfigError(
                "dtype",
                f"no sidecar {str(sidecar_path(self.path))!r} with a 'dtype' entry; pass dtype= "
                f"(one of {list(SUPPORTED_TOKEN_DTYPES)})",
            )
        self.dtype = _check_dtype(meta_dtype if dtype is None else dtype, "dtype")
        if dtype is not None and meta_dtype is not None and self.dtype.name != meta_dtype:
            raise ConfigError(
                "dtype",
                f"{dtype!r} contradicts the sidecar's {meta_dtype!r}; "
                "drop the dtype argument or fix the sidecar",
            )
        self.seq_len = int(seq_len)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ConfigError(
                "dtype",
                f"file size {size} bytes is not a multiple of {self.dtype.name}'s "
                f"{self.dtype.itemsize} bytes; the dtype does not match how the file was written",
            )
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens < self.seq_len + 1:
            raise ConfigError(
                "seq_len",
                f"{str(self.path)!r} holds {self.num_tokens} tokens but one window needs seq_len + 1 = "
                f"{self.seq_len + 1}; use a smaller seq_len or a longer token file",
            )
        expected = None if meta is None else meta.get("tokens", meta.get("num_tokens"))
        if isinstance(expected, int) and expected != self.num_tokens:
            raise ConfigError(
                "path",
                f"{str(self.path)!r} holds {self.num_tokens} tokens but its sidecar says {expected}: the "
                "file is truncated or not the one the sidecar describes; prepare it again (hookloop prepare)",
            )
        #: ids a model needs (largest id + 1) and the end-of-document id, when the sidecar says
        self.vocab_size: int | None = None if meta is None else _vocab_size(meta)
        self.eos_id: int | None = None if meta is None else meta.get("eos_id")
        self._num_windows = (self.num_tokens - 1) // self.seq_len
        self._tokens: np.ndarray | None = None

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, seq_len: int, *, name: str = "<memory>") -> TokenDataset:
        """The same windows over ``tokens`` held in memory (nothing read from or written to disk);
        ``name`` stands for the path in messages. For one process: it does not pickle its ids."""
        if tokens.ndim != 1 or tokens.size < seq_len + 1:
            raise ConfigError("seq_len", f"{name} holds {tokens.size} tokens; one window needs {seq_len + 1}")
        dataset = cls.__new__(cls)
        dataset.path, dataset.dtype, dataset.seq_len = Path(name), tokens.dtype, int(seq_len)
        dataset.num_tokens, dataset.vocab_size, dataset.eos_id = int(tokens.size), None, None
        dataset._num_windows = (dataset.num_tokens - 1) // dataset.seq_len
        dataset._tokens = tokens
        return dataset

    def __len__(self) -> int:
        return self._num_windows

    @property
    def tokens(self) -> np.ndarray:
        """The whole token file as a read-only memory-mapped array."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(index)
        if i < 0:
            i += self._num_windows
        if not 0 <= i < self._num_windows:
            raise IndexError(f"index {index} out of range for {self._num_windows} windows")
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        # inputs get their own storage so in-place edits (masking, noise) never reach the labels
        return window[:-1].clone(), window[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, seq_len={self.seq_len}, dtype={self.dtype.name!r}, "
            f"windows={self._num_windows})"
        )
