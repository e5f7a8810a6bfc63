"""The tokenizer of a token file: a Hugging Face tokenizer from local files
(:func:`load_tokenizer`), or a byte-level BPE trained here on the input text
(:func:`train_bpe_tokenizer`). Nothing is ever downloaded.

``tokenizers`` (and ``transformers``, for directories without ``tokenizer.json``) are imported only
when a function here runs, so ``import hookloop`` stays free of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hookloop.engine.errors import ConfigError
from hookloop.engine.files import atomic_write

__all__ = [
    "EOS_CANDIDATES",
    "MIN_BPE_VOCAB",
    "TRAINED_EOS",
    "TextTokenizer",
    "load_tokenizer",
    "token_dtype",
    "train_bpe_tokenizer",
]

#: End-of-document tokens looked for, in this order, when the tokenizer's config names none.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eos|>")
#: The end-of-document token of a BPE trained by :func:`train_bpe_tokenizer` (id 0).
TRAINED_EOS = "<|endoftext|>"
#: 256 byte symbols and the end-of-document token.
MIN_BPE_VOCAB = 257
INSTALL_HINT = "pip install 'hookloop[prepare]'"


def token_dtype(vocab_size: int, arg: str = "--tokenizer") -> str:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits (<= 65,536 ids), else ``uint32``;
    a :class:`ConfigError` naming ``arg`` beyond 2**32 ids."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ConfigError(
        arg,
        f"has {vocab_size} token ids, more than uint32 holds (2**32); token files store ids as uint16 "
        "or uint32: use a tokenizer with at most 4,294,967,296 ids",
    )


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("--tokenizer", f"needs the tokenizers package: {INSTALL_HINT}") from None
    return tokenizers


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer and what a token file records about it.

    ``vocab_size`` is the largest id plus one (added tokens included), the embedding rows a model
    needs; ``eos_id`` follows every document in a token file.
    """

    tokenizer: Any  # tokenizers.Tokenizer
    eos_id: int
    eos_token: str
    vocab_size: int
    path: Path
    trained: dict[str, Any] | None = field(default=None)

    @property
    def dtype(self) -> str:
        return token_dtype(self.vocab_size)

    def describe(self) -> dict[str, Any]:
        """The sidecar's ``tokenizer`` entry: where it came from and a hash of its serialisation."""
        serialised = self.tokenizer.to_str()
        out: dict[str, Any] = {
            "kind": "huggingface",
            "path": str(self.path.resolve()),
            "sha256": hashlib.sha256(serialised.encode("utf-8")).hexdigest(),
            "eos_token": self.eos_token,
        }
        if self.trained is not None:
            out["trained"] = self.trained
        return out

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """The ids of ``texts``, each document followed by ``eos_id``, as one array of
        :attr:`dtype`. The tokenizer's post-processor (BOS/CLS tokens) is not applied."""
        return encode_documents(self.tokenizer, texts, self.eos_id, self.dtype)


def encode_documents(tokenizer: Any, texts: Sequence[str], eos_id: int, dtype: str) -> np.ndarray:
    """``texts`` encoded with ``tokenizer`` (a ``tokenizers.Tokenizer``), ``eos_id`` after each."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster
    ids = [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]
    total = sum(len(doc) for doc in ids) + len(ids)
    flat = itertools.chain.from_iterable(itertools.chain(doc, (eos_id,)) for doc in ids)
    return np.fromiter(flat, dtype=np.dtype(dtype).newbyteorder("<"), count=total)


def _vocab_size(tokenizer: Any) -> int:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def _config_eos(directory: Path) -> str | None:
    """``eos_token`` of ``directory/tokenizer_config.json`` (a string or ``{"content": ...}``)."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _resolve_eos(
    tokenizer: Any, path: Path, eos_token: str | None, configured: str | None
) -> tuple[str, int]:
    if eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ConfigError(
                "--eos-token",
                f"{eos_token!r} is not a token of {path}'s vocabulary; name one of its tokens "
                "(a special token such as <|endoftext|> or </s>)",
            )
        return eos_token, eos_id
    for candidate in (configured, *EOS_CANDIDATES):
        if candidate is not None and (eos_id := tokenizer.token_to_id(candidate)) is not None:
            return candidate, eos_id
    raise ConfigError(
        "--tokenizer",
        f"{path} names no end-of-document token (no eos_token in a tokenizer_config.json, none of "
        f"{', '.join(EOS_CANDIDATES)} in its vocabulary); pass --eos-token TOKEN with a token of "
        "its vocabulary",
    )


# Files transformers' AutoTokenizer reads a tokenizer from, when there is no tokenizer.json.
_AUTO_FILES = (
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _auto_tokenizer(directory: Path) -> tuple[Any, str | None]:
    """The fast backend and eos token of a directory only ``transformers`` reads."""
    if not any((directory / name).is_file() for name in _AUTO_FILES):
        raise ConfigError(
            "--tokenizer",
            f"{directory} is not a tokenizer directory: it holds no tokenizer.json (nor "
            f"{', '.join(_AUTO_FILES)}); give a tokenizer.json file or a directory holding one",
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            "--tokenizer",
            f"{directory} holds no tokenizer.json; reading its other files needs transformers "
            "(pip install 'hookloop[hf]'), or give a directory with a tokenizer.json",
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a non-tokenizer
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            "--tokenizer",
            f"{directory} is not a tokenizer directory (no tokenizer.json, and transformers' "
            f"AutoTokenizer cannot read it: {reason}); give a tokenizer.json file or a directory "
            "holding one",
        ) from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            "--tokenizer",
            f"{directory} loads as {type(auto).__name__}, which has no fast (tokenizers) backend; "
            "save it as a tokenizer.json with a fast tokenizer and pass that",
        )
    eos = auto.eos_token if isinstance(getattr(auto, "eos_token", None), str) else None
    return backend, eos


def load_tokenizer(path: str | os.PathLike[str], eos_token: str | None = None) -> TextTokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json``, a directory holding one, or one only
    ``transformers``' ``AutoTokenizer`` reads, converted to its fast backend) and its
    end-of-document token: ``eos_token`` when given (it must be in the vocabulary), else the
    directory's ``tokenizer_config.json`` ``eos_token``, else the first of :data:`EOS_CANDIDATES` the
    vocabulary holds. Raises :class:`ConfigError` naming ``--tokenizer`` or ``--eos-token``."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            "--tokenizer",
            f"{path} does not exist; give a tokenizer.json file or a tokenizer directory "
            "(or train one with --train-tokenizer DIR --vocab-size N)",
        )
    tokenizers = _tokenizers()
    configured = None
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        tokenizer, configured = _auto_tokenizer(path)
    else:
        file = path / "tokenizer.json" if path.is_dir() else path
        if path.is_dir():
            configured = _config_eos(path)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                "--tokenizer",
                f"{file} is not a Hugging Face tokenizer.json ({reason}); give a tokenizer.json "
                "file or a tokenizer directory",
            ) from None
    vocab_size = _vocab_size(tokenizer)
    token_dtype(vocab_size)
    eos, eos_id = _resolve_eos(tokenizer, path, eos_token, configured)
    return TextTokenizer(tokenizer, eos_id, eos, vocab_size, path)


def check_bpe_target(directory: str | os.PathLike[str], vocab_size: Any) -> Path:
    """Refuse a training target before any text is read: ``directory`` must not hold a tokenizer
    already, and ``vocab_size`` must leave room for the byte alphabet and the eos token."""
    directory = Path(directory)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(
            "--vocab-size",
            f"must be an integer >= {MIN_BPE_VOCAB} (256 byte symbols and {TRAINED_EOS}), got {vocab_size!r}",
        )
    token_dtype(vocab_size, "--vocab-size")
    if (directory / "tokenizer.json").exists():
        raise ConfigError(
            "--train-tokenizer",
            f"{directory} already holds a tokenizer.json; reuse it with --tokenizer {directory}, "
            "or name a new directory",
        )
    if directory.exists() and not directory.is_dir():
        raise ConfigError(
            "--train-tokenizer", f"{directory} is a file; name a directory to save the tokenizer in"
        )
    return directory


def train_bpe_tokenizer(
    batches: Iterable[Sequence[str]],
    directory: str | os.PathLike[str],
    vocab_size: int,
    *,
    length: int | None = None,
    show_progress: bool = False,
    sources: Sequence[str] = (),
) -> TextTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` ids on ``batches`` (lists of documents) and
    save it to ``directory`` (``tokenizer.json`` + ``tokenizer_config.json``). Every byte is in
    the vocabulary, so any text round-trips through encode and decode; training is deterministic.
    ``length`` (documents) sizes
    the progress bar; ``sources`` are recorded as what it was trained on. A small corpus may stop
    short of ``vocab_size`` (no pair left to merge)."""
    directory = check_bpe_target(directory, vocab_size)
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(batches, trainer, length=length)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "tokenizer.json", tokenizer.to_str(pretty=True))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TRAINED_EOS}
    atomic_write(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    trained = {"type": "byte-level BPE", "vocab_size": vocab_size, "sources": list(sources)}
    # Tokenize with what was saved: exactly what a later run passing --tokenizer DIR gets.
    return dataclasses.replace(load_tokenizer(directory), trained=trained)
