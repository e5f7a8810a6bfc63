"""Write one token file from documents and a tokenizer: each document's ids, then ``eos_id``.

The sidecar ``<out>.json`` (version 2) holds ``dtype`` (``uint16`` when every id fits, else
``uint32``), ``vocab_size``, ``eos_id``, ``documents``, ``tokens`` and ``tokenizer`` (path, sha256
of its serialisation, eos token, and how it was trained when it was), written as
:func:`engine.data.prepare_tokens` writes its files.

``num_proc > 1`` tokenizes batches of documents in that many worker processes (one tokenizer thread
each) while this process reads ahead and writes the results in document order, so the file is
byte-identical to ``num_proc=1``, which tokenizes here (the tokenizer may use several threads).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hookloop.engine.data.text_files import text_batches
from hookloop.engine.data.token_dataset import writing_token_file
from hookloop.engine.data.tokenizer import TextTokenizer, encode_documents

__all__ = ["TOKENIZED_VERSION", "write_token_file"]

TOKENIZED_VERSION = 2

# A worker process's tokenizer, set once by _start_worker.
_worker: dict[str, Any] = {}


def _start_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it ends the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: num_proc is the parallelism
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_str(tokenizer_json), eos_id=eos_id, dtype=dtype)


def _encode_in_worker(texts: Sequence[str]) -> np.ndarray:
    return encode_documents(_worker["tokenizer"], texts, _worker["eos_id"], _worker["dtype"])


def _progress_bar(total: int, enabled: bool | None) -> Any:
    from tqdm import tqdm

    enabled = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, unit="doc", desc="tokenizing", disable=not enabled, dynamic_ncols=True)


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork: workers start at once with this interpreter's imports; spawn where fork is unsafe
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    return multiprocessing.get_context(method)


def write_token_file(
    documents: Any,
    out_path: str | os.PathLike[str],
    tokenizer: TextTokenizer,
    *,
    num_proc: int = 1,
    progress: bool | None = None,
    sources: Sequence[str] = (),
    text_field: str | None = None,
) -> dict[str, Any]:
    """Tokenize ``documents`` (a ``datasets.Dataset`` with a ``text`` column) into ``out_path`` and
    its sidecar; returns the sidecar's metadata. ``progress``: a tqdm bar on stderr (None: when
    stderr is a terminal). ``sources`` and ``text_field`` are recorded in the sidecar. ``num_proc``
    is an integer >= 1 (``hookloop prepare`` checks its ``--num-proc``)."""
    dtype = tokenizer.dtype
    num_tokens = 0
    with writing_token_file(out_path) as (fh, meta), _progress_bar(len(documents), progress) as bar:

        def write(ids: np.ndarray, docs: int) -> None:
            nonlocal num_tokens
            ids.tofile(fh)
            num_tokens += len(ids)
            bar.update(docs)

        batches = text_batches(documents)
        if num_proc == 1:
            for texts in batches:
                write(tokenizer.encode_documents(texts), len(texts))
        else:
            _tokenize_in_workers(batches, tokenizer, dtype, num_proc, write)
        meta.update(
            format="hookloop-tokens",
            version=TOKENIZED_VERSION,
            dtype=dtype,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            documents=len(documents),
            tokens=num_tokens,
            tokenizer=tokenizer.describe(),
            sources=list(sources),
        )
        if text_field is not None:
            meta["text_field"] = text_field
    return meta


def _tokenize_in_workers(
    batches: Any, tokenizer: TextTokenizer, dtype: str, num_proc: int, write: Any
) -> None:
    """Batches go to ``num_proc`` workers, at most two per worker in flight (bounded memory however
    large the corpus); results are written in submission order."""
    # A fork after the tokenizer used its thread pool (a BPE trained in this process) makes
    # tokenizers warn and turn parallelism off in the child; saying so up front keeps it quiet.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # While the workers are forked a Ctrl-C is only noted (a worker would otherwise print a
    # traceback before its initializer makes it ignore Ctrl-C), then raised once the pool stands:
    # the main process ends the pool on Ctrl-C, and one pressed during the start is not lost.
    # The workers are forked with SIGTERM's default action, whatever this process handles it with:
    # the pool ends them with SIGTERM, and a handler run by Python never runs in a worker stuck in C
    # (a fork of a process with threads can leave one waiting on a lock forever).
    main = threading.current_thread() is threading.main_thread()
    caught: list[int] = []
    if main:
        previous_sigint = signal.signal(signal.SIGINT, lambda signum, _: caught.append(signum))
        previous_sigterm = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        pool = _pool_context().Pool(
            num_proc,
            initializer=_start_worker,
            initargs=(tokenizer.tokenizer.to_str(), tokenizer.eos_id, dtype),
        )
    finally:
        if main:
            signal.signal(signal.SIGINT, previous_sigint)
            signal.signal(signal.SIGTERM, previous_sigterm)
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    with pool:
        if caught:
            raise KeyboardInterrupt
        pending: collections.deque = collections.deque()
        for texts in batches:
            pending.append((len(texts), pool.apply_async(_encode_in_worker, (texts,))))
            if len(pending) >= 2 * num_proc:
                docs, result = pending.popleft()
                write(result.get(), docs)
        while pending:
            docs, result = pending.popleft()
            write(result.get(), docs)
