"""Documents from local text files, read with Hugging Face ``datasets`` (nothing is downloaded).

=============  ==========================================================================
``.txt``       one document per file (UTF-8; line endings become ``\\n``, as Python's text mode)
``.jsonl``     one document per line: the string in the line's ``text_field``
``.parquet``   one document per row: the string in its ``text_field`` column
=============  ==========================================================================

``datasets`` converts the files to Arrow in a cache directory. :func:`documents_cache` makes a fresh
temporary one beside the output and removes it when the work ends, also on failure: nothing lands
in ``~/.cache/huggingface``, a read-only or missing home cache does not matter, and the Arrow copy
(about the size of the text) sits on the output's file system, which has to hold the tokens anyway.
``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` default to ``1`` when this module is the first to
import ``datasets``. Errors are :class:`ConfigError` naming ``--files`` or ``--text-field``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hookloop.engine.errors import ConfigError

__all__ = [
    "TEXT_FORMATS",
    "check_text_files",
    "documents_cache",
    "documents_from_texts",
    "load_documents",
    "text_batches",
]

#: Extension -> how a file of it splits into documents.
TEXT_FORMATS = {
    ".txt": "one document per file",
    ".jsonl": "one document per line, its text in --text-field",
    ".parquet": "one document per row, its text in --text-field",
}
# Formats with one document per record, and the ``datasets`` builder that reads them.
_ROW_BUILDERS = {".jsonl": "json", ".parquet": "parquet"}
_FORMATS_HINT = "; ".join(f"{ext}: {what}" for ext, what in TEXT_FORMATS.items())


def check_text_files(files: Sequence[str | os.PathLike[str]], *, any_extension: bool = False) -> list[Path]:
    """``files`` as paths, each an existing file with a known extension (with ``any_extension``,
    an unknown one is read as one document per file). Cheap: nothing is read."""
    out = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError("--files", f"{path} {what}; give existing text files ({_FORMATS_HINT})")
        if not any_extension and path.suffix.lower() not in TEXT_FORMATS:
            raise ConfigError(
                "--files",
                f"{path} has an unknown extension {path.suffix or '(none)'!r}; use {_FORMATS_HINT} "
                "(rename a plain text file to .txt)",
            )
        out.append(path)
    if not out:
        raise ConfigError("--files", "names no file; give at least one text file")
    return out


@contextlib.contextmanager
def documents_cache(out_path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh directory for ``datasets``' Arrow files beside ``out_path``, removed on exit."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".datasets-cache", dir=out.parent))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _datasets() -> Any:
    if "datasets" not in sys.modules:  # its config reads these once, at import
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "--files",
            "reading .txt/.jsonl/.parquet needs the datasets package: pip install 'hookloop[prepare]'",
        ) from None
    return datasets


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No ``datasets`` progress bars or info logs while it reads (the caller draws its own bar)."""
    was_enabled = datasets.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its read errors come back as ours
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if was_enabled:
            datasets.enable_progress_bars()


def _first_line(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:  # the root cause says most
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _bad_json_line(path: Path) -> str | None:
    """Where ``path`` stops being JSON lines (looked for only after ``datasets`` failed)."""
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        return f"line {number} is not JSON: {e}"
                    if not isinstance(record, dict):
                        return f"line {number} is a JSON {type(record).__name__}, not an object"
    except UnicodeDecodeError as e:
        return f"not UTF-8: {e}"
    return None


def _load(datasets: Any, builder: str, files: Sequence[Path], cache_dir: Path, **kwargs: Any) -> Any:
    try:
        return datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", cache_dir=str(cache_dir), **kwargs
        )
    except Exception as e:  # datasets wraps parse and decode errors in DatasetGenerationError
        culprit, reason = files[0], _first_line(e)
        if builder == "text":  # which file is not UTF-8 (only looked for on failure)
            for f in files:
                try:
                    f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    culprit = f
                    break
        elif builder == "json":
            reason = _bad_json_line(culprit) or reason
        kind = {"text": "UTF-8 text", "json": "JSON lines", "parquet": "Parquet"}[builder]
        message = f"cannot read {culprit} as {kind} ({reason}); fix or drop the file"
        raise ConfigError("--files", message) from None


def _text_column(ds: Any, path: Path, text_field: str) -> Any:
    """``ds`` reduced to its ``text_field`` as a ``text`` column; every record must hold a string."""
    record = "line" if path.suffix.lower() == ".jsonl" else "row"
    if text_field not in ds.column_names:
        fields = ", ".join(ds.column_names) or "none"
        raise ConfigError(
            "--text-field",
            f"no record of {path} has a field {text_field!r} (its fields: {fields}); "
            "pass --text-field NAME with the field that holds the text",
        )
    feature = ds.features[text_field]
    is_string = getattr(feature, "dtype", None) in ("string", "large_string")
    column = ds.data.column(text_field)
    if not is_string or column.null_count:
        values = ds[text_field]
        bad = next(i for i, v in enumerate(values) if not isinstance(v, str))
        found = "nothing" if values[bad] is None else f"{values[bad]!r} ({type(values[bad]).__name__})"
        raise ConfigError(
            "--text-field",
            f"{record} {bad + 1} of {path} holds {found} in {text_field!r}, not a string"
            + (" (blank lines are skipped in the count)" if record == "line" else "")
            + "; every record needs its text there",
        )
    ds = ds.select_columns([text_field])
    return ds if text_field == "text" else ds.rename_column(text_field, "text")


def load_documents(
    files: Sequence[str | os.PathLike[str]], cache_dir: str | os.PathLike[str], *, text_field: str = "text"
) -> Any:
    """The documents of ``files``, in order, as a ``datasets.Dataset`` with one ``text`` column.
    ``.jsonl`` and ``.parquet`` files give one document per record (``text_field``); any other file
    is one document. Arrow files go to ``cache_dir`` (see :func:`documents_cache`)."""
    datasets = _datasets()
    cache = Path(cache_dir)
    parts = []
    with _quiet(datasets):
        for builder, group in itertools.groupby(
            (Path(f) for f in files), key=lambda p: _ROW_BUILDERS.get(p.suffix.lower(), "text")
        ):
            group = list(group)
            if builder == "text":  # consecutive whole-file documents: one Arrow conversion
                parts.append(_load(datasets, "text", group, cache, sample_by="document"))
            else:  # per file, so an error can name the file and the record; an empty file has none
                for f in group:
                    if f.stat().st_size:
                        parts.append(_text_column(_load(datasets, builder, [f], cache), f, text_field))
        ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0] if parts else None
    if ds is None or len(ds) == 0:
        raise ConfigError("--files", "hold no document (empty files); give files with text")
    return ds


def documents_from_texts(texts: Sequence[str]) -> Any:
    """In-memory documents (e.g. Python's bundled documentation) as a ``datasets.Dataset``."""
    datasets = _datasets()
    with _quiet(datasets):
        return datasets.Dataset.from_dict({"text": list(texts)})


def text_batches(ds: Any, target_chars: int = 1 << 18) -> Iterator[list[str]]:
    """``ds``'s documents in order, in lists of about ``target_chars`` characters (at least one
    document each): batches big enough for a tokenizer's threads, small enough to stream."""
    import pyarrow.compute as pc

    chars = pc.sum(pc.utf8_length(ds.data.column("text"))).as_py() or 0
    per_batch = max(1, min(10_000, round(target_chars * len(ds) / max(chars, 1))))
    for batch in ds.iter(batch_size=per_batch):
        yield batch["text"]
