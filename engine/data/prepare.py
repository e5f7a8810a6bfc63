"""Turn text into a byte-level token file that :class:`engine.data.TokenDataset` reads.

Tokens are the UTF-8 bytes of each document; documents are joined with one separator token
(default ``0``, the NUL byte, which does not occur in ordinary text). Every machine with Python
has two corpora for smoke runs and benchmarks without any download: the bundled documentation
(:func:`stdlib_docs_text`) and the standard library's source (:func:`stdlib_source_files`).

Command line::

    python -m hookloop.engine.data prepare OUT --from-stdlib-docs
    python -m hookloop.engine.data prepare OUT --from-stdlib-source [--limit N]
    python -m hookloop.engine.data prepare OUT --files a.txt b.txt [--dtype uint16]
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hookloop.engine.data.token_dataset import SUPPORTED_TOKEN_DTYPES, sidecar_path
from hookloop.engine.errors import ConfigError
from hookloop.engine.files import atomic_write

__all__ = ["DOC_SEPARATOR", "main", "prepare_tokens", "stdlib_docs_text", "stdlib_source_files"]

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
    will later be mixed with a larger vocabulary. The file is written to a temporary name and
    renamed, so a crash never leaves a half-written token file behind.

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
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per writer: several ranks, on several nodes whose pids may be the same
    # (containers), may prepare the same file in a shared directory at once.
    tag = uuid.uuid4().hex
    tmp = out.with_name(f"{out.name}.{tag}.tmp")
    sep = np.array([separator], dtype=np_dtype)
    num_tokens = 0
    num_documents = 0
    try:
        with open(tmp, "wb") as fh:
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
        meta: dict[str, Any] = {
            "format": "hookloop-tokens",
            "version": 1,
            "tokenizer": "utf8-bytes",
            "dtype": np_dtype.name,
            "num_tokens": num_tokens,
            "num_documents": num_documents,
            "separator": separator,
        }
        # The sidecar lands first and the token file last, so a reader that sees the token file
        # always finds its sidecar.
        side = sidecar_path(out)
        atomic_write(side, json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return meta


def stdlib_docs_text() -> str:
    """Python's bundled reference documentation (``pydoc_data.topics``) as one text, topics sorted by name."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip pydoc_data
        raise RuntimeError(
            "this Python has no pydoc_data package (stripped by the distribution); "
            "use stdlib_source_files() as the text source instead"
        ) from exc
    return "\n\n".join(topics[name] for name in sorted(topics))


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


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``python -m hookloop.engine.data``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m hookloop.engine.data", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write a byte-level token file and its .json sidecar")
    prep.add_argument("out", type=Path, help="token file to write; the sidecar goes to OUT.json")
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-stdlib-docs", action="store_true", help="Python's bundled documentation")
    source.add_argument("--from-stdlib-source", action="store_true", help="the standard library's .py files")
    source.add_argument("--files", nargs="+", type=Path, metavar="FILE", help="text files, one document each")
    prep.add_argument("--limit", type=int, default=None, help="with --from-stdlib-source: first N files only")
    prep.add_argument("--dtype", default="uint8", choices=SUPPORTED_TOKEN_DTYPES)
    args = parser.parse_args(argv)

    if args.from_stdlib_docs:
        documents: list[Document] = [stdlib_docs_text()]
    elif args.from_stdlib_source:
        documents = list(stdlib_source_files(args.limit))
    else:
        documents = list(args.files)
    meta = prepare_tokens(documents, args.out, dtype=args.dtype)
    print(
        f"wrote {meta['num_tokens']} tokens ({meta['num_documents']} documents, {meta['dtype']}) to "
        f"{args.out}"
    )
    return 0
