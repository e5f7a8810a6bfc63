"""Data primitives of the phase-curriculum mixer.

* :class:`TokenDataset` -- fixed-length next-token windows over a memory-mapped token file.
* :func:`prepare_tokens` -- write byte-level token files; :func:`stdlib_docs_text` and
  :func:`stdlib_source_files` give text every Python install has, for runs without downloads.
  ``hookloop prepare`` (:mod:`engine.data.prepare`) also writes token files with a Hugging Face
  tokenizer (:mod:`engine.data.tokenizer`, :mod:`engine.data.text_files`,
  :mod:`engine.data.tokenized`); those modules import ``datasets`` and ``tokenizers`` only when used.
* :func:`check_model_vocab` -- a config's model must have as many token ids as its data uses.
* :class:`MixtureDataset` -- named datasets in one index space, items tagged with their source.
* :class:`MixtureSampler` -- endless weighted, resumable, rank-disjoint index stream over a mixture.
* :class:`MixtureLoader` -- a ``DataLoader`` over a ``MixtureSampler`` whose state is exactly the
  batches it returned, however far its workers prefetch.
"""

from hookloop.engine.data.loader import MixtureLoader
from hookloop.engine.data.mixture import MixtureDataset
from hookloop.engine.data.prepare import (
    DOC_SEPARATOR,
    prepare_tokens,
    stdlib_docs_text,
    stdlib_docs_topics,
    stdlib_source_files,
)
from hookloop.engine.data.sampler import MixtureSampler
from hookloop.engine.data.token_dataset import (
    BYTE_VOCAB_SIZE,
    SUPPORTED_TOKEN_DTYPES,
    TokenDataset,
    read_token_metadata,
    token_file_vocab_size,
)
from hookloop.engine.data.trace import SampleTrace, read_sample_traces
from hookloop.engine.data.vocab import check_model_vocab

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DOC_SEPARATOR",
    "SUPPORTED_TOKEN_DTYPES",
    "MixtureDataset",
    "MixtureLoader",
    "MixtureSampler",
    "SampleTrace",
    "TokenDataset",
    "check_model_vocab",
    "prepare_tokens",
    "read_sample_traces",
    "read_token_metadata",
    "stdlib_docs_text",
    "stdlib_docs_topics",
    "stdlib_source_files",
    "token_file_vocab_size",
]
