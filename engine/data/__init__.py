"""Data primitives of the phase-curriculum mixer.

* :class:`TokenDataset` -- fixed-length next-token windows over a memory-mapped token file.
* :func:`prepare_tokens` -- write byte-level token files; :func:`stdlib_docs_text` and
  :func:`stdlib_source_files` give text every Python install has, for runs without downloads.
* :class:`MixtureDataset` -- named datasets in one index space, items tagged with their source.
* :class:`MixtureSampler` -- endless weighted, resumable, rank-disjoint index stream over a mixture.
* :class:`MixtureLoader` -- a ``DataLoader`` over a ``MixtureSampler`` whose state is exactly the
  batches it returned, however far its workers prefetch.
"""

from hookloop.engine.data.loader import MixtureLoader
from hookloop.engine.data.mixture import MixtureDataset
from hookloop.engine.data.prepare import DOC_SEPARATOR, prepare_tokens, stdlib_docs_text, stdlib_source_files
from hookloop.engine.data.sampler import MixtureSampler
from hookloop.engine.data.token_dataset import SUPPORTED_TOKEN_DTYPES, TokenDataset, read_token_metadata
from hookloop.engine.data.trace import SampleTrace, read_sample_traces

__all__ = [
    "DOC_SEPARATOR",
    "SUPPORTED_TOKEN_DTYPES",
    "MixtureDataset",
    "MixtureLoader",
    "MixtureSampler",
    "SampleTrace",
    "TokenDataset",
    "prepare_tokens",
    "read_sample_traces",
    "read_token_metadata",
    "stdlib_docs_text",
    "stdlib_source_files",
]
