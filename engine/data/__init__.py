"""Data primitives of the phase-curriculum mixer: token files (:mod:`.prepare`, read by
:class:`TokenDataset`), named datasets in one index space (:class:`MixtureDataset`), an endless,
resumable, rank-disjoint index stream over them (:class:`MixtureSampler`) and its loader
(:class:`MixtureLoader`), the model-vocabulary check (:mod:`.vocab`) and the sample trace
(:class:`SampleTrace`). The Hugging Face tokenizer path of ``hookloop prepare``
(:mod:`.tokenizer`, :mod:`.text_files`, :mod:`.tokenized`) imports ``datasets`` and ``tokenizers``
only when used.
"""

from typing import TYPE_CHECKING

from hookloop.engine.lazy import homes_of, lazy_exports

if TYPE_CHECKING:  # what editors and type checkers see; at run time, __getattr__ below
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

# Where each public name lives: imported on first use (PEP 562), so the config section
# (:mod:`.config`) loads without torch.
_MODULES = {
    "loader": ("MixtureLoader",),
    "mixture": ("MixtureDataset",),
    "prepare": (
        "DOC_SEPARATOR",
        "prepare_tokens",
        "stdlib_docs_text",
        "stdlib_docs_topics",
        "stdlib_source_files",
    ),
    "sampler": ("MixtureSampler",),
    "token_dataset": (
        "BYTE_VOCAB_SIZE",
        "SUPPORTED_TOKEN_DTYPES",
        "TokenDataset",
        "read_token_metadata",
        "token_file_vocab_size",
    ),
    "trace": ("SampleTrace", "read_sample_traces"),
    "vocab": ("check_model_vocab",),
}
_HOMES = homes_of(__name__, _MODULES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)


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
