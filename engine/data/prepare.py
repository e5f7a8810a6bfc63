"""Turn text into a token file that :class:`engine.data.TokenDataset` reads: byte-level, or with a
Hugging Face tokenizer (``hookloop prepare``).

Byte-level (:func:`prepare_tokens`, no ``--tokenizer``): tokens are the UTF-8 bytes of each
document; documents are joined with one separator token (default ``0``, the NUL byte, which does
not occur in ordinary text). With ``--tokenizer`` (or ``--train-tokenizer``) each document's ids are
followed by the tokenizer's end-of-document id (:mod:`engine.data.tokenized`). Every machine with
Python has two corpora for smoke runs and benchmarks without any download: the bundled documentation
(:func:`stdlib_docs_text`) and the standard library's source (:func:`stdlib_source_files`).

Command line (also ``python -m hookloop.engine.data prepare ...``)::

    hookloop prepare OUT --from-stdlib-docs | --from-stdlib-source [--limit N] | --files F ...
        [--text-field FIELD]  [--dtype uint16]                            byte-level
        --tokenizer PATH [--eos-token TOKEN] [--num-proc N]               a tokenizer of yours
        --train-tokenizer DIR --vocab-size N [--num-proc N]               a BPE trained on the input
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hookloop.engine.data.token_dataset import (
    BYTE_VOCAB_SIZE,
    SUPPORTED_TOKEN_DTYPES,
    check_output,
    writing_token_file,
)
from hookloop.engine.errors import ConfigError

__all__ = [
    "DOC_SEPARATOR",
    "main",
    "prepare_command",
    "prepare_tokens",
    "stdlib_docs_text",
    "stdlib_docs_topics",
    "stdlib_source_files",
]

DOC_SEPARATOR = 0
"""Token written between two documents by default (the NUL byte)."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

Document = str | bytes | os.PathLike


def _document_bytes(doc: Any, position: int) -> bytes:
    if isinstance(doc, str):
        return doc.encode("utf-8")
    if isinstance(doc, bytes | bytearray | memoryview):
        return bytes(doc)
    if isinstance(doc, os.PathLike):
        path = Path(doc)
        if not path.is_file():
            raise FileNotFoundError(f"sources[{position}]: file {str(path)!r} does not exist")
        return path.read_bytes()
    raise TypeError(
        f"sources[{position}]: expected text (str), raw bytes or a pathlib.Path to a text file, "
        f"got {type(doc).__name__}"
    )


def prepare_tokens(
    sources: Iterable[Document] | Document,
    out_path: str | os.PathLike[str],
    *,
    dtype: str = "uint8",
    separator: int = DOC_SEPARATOR,
) -> dict[str, Any]:
    """Write the byte tokens of ``sources`` to ``out_path`` plus the ``<out_path>.json`` sidecar.

    Each element of ``sources`` is one document: a ``str`` is the document's text, ``bytes`` are
    its raw bytes, and a ``pathlib.Path`` (any ``os.PathLike``) names a file whose bytes are used
    as they are. Plain strings are never treated as file names, so wrap paths in ``Path``.
    ``separator`` is written between consecutive documents (not after the last); separator bytes
    already inside a document are kept, so splitting on the separator recovers the documents only
    when the text has none. ``dtype`` widens the storage (``uint16``/``uint32``) for token files that
    will later be mixed with a larger vocabulary. A crash never leaves a half-written token file
    behind (:func:`~engine.data.token_dataset.writing_token_file`).

    Returns the metadata written to the sidecar.
    """
    if isinstance(dtype, str) and dtype in SUPPORTED_TOKEN_DTYPES:
        np_dtype = np.dtype(dtype).newbyteorder("<")
    else:
        raise ConfigError("dtype", f"unsupported dtype {dtype!r}; use one of {list(SUPPORTED_TOKEN_DTYPES)}")
    max_token = np.iinfo(np_dtype).max
    if isinstance(separator, bool) or not isinstance(separator, int) or not 0 <= separator <= max_token:
        raise ConfigError(
            "separator", f"must be an integer in [0, {max_token}] for dtype {dtype}, got {separator!r}"
        )
    if isinstance(sources, str | bytes | bytearray | os.PathLike):
        sources = [sources]
    sep = np.array([separator], dtype=np_dtype)
    num_tokens = 0
    num_documents = 0
    with writing_token_file(out_path) as (fh, meta):
        for position, doc in enumerate(sources):
            data = _document_bytes(doc, position)
            if num_documents:
                sep.tofile(fh)
                num_tokens += 1
            np.frombuffer(data, dtype=np.uint8).astype(np_dtype).tofile(fh)
            num_tokens += len(data)
            num_documents += 1
        if num_documents == 0:
            raise ConfigError("sources", "is empty; pass at least one document (text, bytes or Path)")
        meta.update(
            format="hookloop-tokens",
            version=1,
            tokenizer="utf8-bytes",
            dtype=np_dtype.name,
            vocab_size=max(BYTE_VOCAB_SIZE, separator + 1),
            num_tokens=num_tokens,
            num_documents=num_documents,
            separator=separator,
        )
    return meta


def stdlib_docs_topics() -> list[str]:
    """Python's bundled reference documentation (``pydoc_data.topics``), one text per topic, sorted
    by topic name."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip pydoc_data
        raise RuntimeError(
            "this Python has no pydoc_data package (stripped by the distribution); "
            "use stdlib_source_files() as the text source instead"
        ) from exc
    return [topics[name] for name in sorted(topics)]


def stdlib_docs_text() -> str:
    """Python's bundled reference documentation (``pydoc_data.topics``) as one text, topics sorted by name."""
    return "\n\n".join(stdlib_docs_topics())


def stdlib_source_files(limit: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path; at most ``limit`` of them.

    Third-party packages (``site-packages``/``dist-packages``), test suites (``test``, ``tests``,
    ``idle_test``) and caches are skipped, so the list is the same on any install of the same
    Python version regardless of what else is installed.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConfigError("limit", f"must be None or an integer >= 0, got {limit!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"standard library directory {str(root)!r} (sysconfig 'stdlib') does not exist"
        )
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    files = [path for _, path in found]
    return files if limit is None else files[:limit]


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="token file to write; the sidecar goes to OUT.json")
    source = parser.add_argument_group("text (one of)").add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from-stdlib-docs",
        action="store_true",
        help="Python's bundled documentation (one document; one per topic with a tokenizer)",
    )
    source.add_argument(
        "--from-stdlib-source",
        action="store_true",
        help="the standard library's .py files, one document each",
    )
    source.add_argument(
        "--files",
        nargs="+",
        type=Path,
        metavar="FILE",
        help=".txt (one document per file), .jsonl (one per line), .parquet (one per row); "
        "byte-level also takes any other file as one document",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="with --from-stdlib-source: first N files only"
    )
    parser.add_argument(
        "--text-field",
        default="text",
        metavar="FIELD",
        help="the text of a .jsonl line or .parquet row (default: text)",
    )
    tok = parser.add_argument_group("tokenizer (default: byte-level, one token per UTF-8 byte)")
    which = tok.add_mutually_exclusive_group()
    which.add_argument(
        "--tokenizer", type=Path, metavar="PATH", help="a tokenizer.json or a tokenizer directory"
    )
    which.add_argument(
        "--train-tokenizer",
        type=Path,
        metavar="DIR",
        help="train a byte-level BPE on the input first and save it to DIR (a new directory)",
    )
    tok.add_argument(
        "--vocab-size", type=int, metavar="N", help="with --train-tokenizer: ids in the BPE (>= 257)"
    )
    tok.add_argument(
        "--eos-token", metavar="TOKEN", help="with --tokenizer: the end-of-document token, if it names none"
    )
    tok.add_argument(
        "--num-proc",
        type=int,
        default=1,
        metavar="N",
        help="tokenize in N processes (same output; default 1)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=SUPPORTED_TOKEN_DTYPES,
        help="byte-level only: storage width (default uint8); with a tokenizer it follows the vocabulary",
    )


def _check_arguments(args: argparse.Namespace) -> None:
    """Argument combinations, before anything is read."""
    tokenized = args.tokenizer is not None or args.train_tokenizer is not None
    if args.train_tokenizer is not None and args.vocab_size is None:
        raise ConfigError("--vocab-size", "is required with --train-tokenizer: the number of ids of the BPE")
    if args.vocab_size is not None and args.train_tokenizer is None:
        raise ConfigError("--vocab-size", "only applies with --train-tokenizer DIR")
    if args.eos_token is not None and args.tokenizer is None:
        raise ConfigError(
            "--eos-token", "only applies with --tokenizer (a trained BPE ends documents with <|endoftext|>)"
        )
    if args.dtype is not None and tokenized:
        raise ConfigError(
            "--dtype", "only applies to byte-level files; with a tokenizer the vocabulary decides it"
        )
    if isinstance(args.num_proc, bool) or args.num_proc < 1:
        raise ConfigError("--num-proc", f"must be an integer >= 1, got {args.num_proc}")
    if args.num_proc > 1 and not tokenized:
        raise ConfigError("--num-proc", "parallelises tokenization: give --tokenizer or --train-tokenizer")
    if args.limit is not None and not args.from_stdlib_source:
        raise ConfigError("--limit", "only applies with --from-stdlib-source")
    if args.limit is not None and args.limit < 0:
        raise ConfigError("--limit", f"must be a number of files >= 0, got {args.limit}")


def _byte_documents(files: list[Path], text_field: str, cache_dir: Path) -> Iterable[Document]:
    """Byte-level documents: a .jsonl/.parquet file's records as text, any other file's raw bytes."""
    from hookloop.engine.data.text_files import load_documents, text_batches

    for path in files:
        if path.suffix.lower() in (".jsonl", ".parquet"):
            for texts in text_batches(load_documents([path], cache_dir, text_field=text_field)):
                yield from texts
        else:
            yield path


def _prepare(args: argparse.Namespace) -> str:
    """Run the prepare command; returns the line that says what was written."""
    from hookloop.engine.data.text_files import check_text_files, documents_cache

    _check_arguments(args)
    check_output(args.out, "OUT")
    tokenized = args.tokenizer is not None or args.train_tokenizer is not None
    files = check_text_files(args.files, any_extension=not tokenized) if args.files else []
    if args.from_stdlib_source:
        stdlib = stdlib_source_files(args.limit)
        sources = [f"stdlib source: {len(stdlib)} files under {sysconfig.get_paths()['stdlib']}"]
    elif args.from_stdlib_docs:
        sources = ["stdlib docs: pydoc_data.topics"]
    else:
        sources = [str(f) for f in files]
    if not tokenized:
        if args.from_stdlib_docs:
            meta = prepare_tokens([stdlib_docs_text()], args.out, dtype=args.dtype or "uint8")
        elif args.from_stdlib_source:
            meta = prepare_tokens(stdlib, args.out, dtype=args.dtype or "uint8")
        else:
            with documents_cache(args.out) as cache:
                docs = _byte_documents(files, args.text_field, cache)
                meta = prepare_tokens(docs, args.out, dtype=args.dtype or "uint8")
        counts = f"{meta['num_tokens']} tokens ({meta['num_documents']} documents, {meta['dtype']})"
        return f"wrote {counts} to {args.out}"

    from hookloop.engine.data.text_files import documents_from_texts, load_documents, text_batches
    from hookloop.engine.data.tokenized import write_token_file
    from hookloop.engine.data.tokenizer import check_bpe_target, load_tokenizer, train_bpe_tokenizer

    tokenizer = None
    if args.tokenizer is not None:  # a bad tokenizer is refused before any text is read
        tokenizer = load_tokenizer(args.tokenizer, args.eos_token)
    else:
        check_bpe_target(args.train_tokenizer, args.vocab_size)
    interactive = sys.stderr.isatty()
    with documents_cache(args.out) as cache:
        if args.from_stdlib_docs:
            documents = documents_from_texts(stdlib_docs_topics())
        elif args.from_stdlib_source:
            documents = load_documents(stdlib, cache)
        else:
            documents = load_documents(files, cache, text_field=args.text_field)
        trained = ""
        if tokenizer is None:
            tokenizer = train_bpe_tokenizer(
                text_batches(documents),
                args.train_tokenizer,
                args.vocab_size,
                length=len(documents),
                show_progress=interactive,
                sources=sources,
            )
            trained = f"; trained a {tokenizer.vocab_size}-id BPE, saved to {args.train_tokenizer}"
        has_fields = any(f.suffix.lower() in (".jsonl", ".parquet") for f in files)
        meta = write_token_file(
            documents,
            args.out,
            tokenizer,
            num_proc=args.num_proc,
            progress=interactive,
            sources=sources,
            text_field=args.text_field if has_fields else None,
        )
    return (
        f"wrote {meta['tokens']} tokens ({meta['documents']} documents, {meta['dtype']}, vocabulary "
        f"{meta['vocab_size']}, eos {meta['eos_id']}) to {args.out}{trained}"
    )


def prepare_command(argv: Sequence[str] | None = None, prog: str = "hookloop prepare") -> int:
    """``hookloop prepare``: parse ``argv``, write the token file, return the exit status (2 and one
    line naming the argument when an argument or the input is wrong)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    _prepare_arguments(parser)
    args = parser.parse_args(argv)
    try:
        print(_prepare(args))
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {args.out} was not written", file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``python -m hookloop.engine.data``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:
        return prepare_command(argv[1:], prog="python -m hookloop.engine.data prepare")
    parser = argparse.ArgumentParser(
        prog="python -m hookloop.engine.data", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="write a token file and its .json sidecar (hookloop prepare)")
    parser.parse_args(argv)  # explains, and exits
    return 2
