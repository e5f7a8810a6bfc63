"""How the checkpoint wing calls ``torch.distributed.checkpoint`` (DCP): the state-dict options
every save and load uses, its single-process warning silenced, its errors in one line, and a
Ctrl-C or exit that reached it kept what it is."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["STATE_DICT_OPTIONS", "last_line", "quiet_single_process", "reraise_interrupt"]

# Optimizer state and hyper-parameters keyed by parameter name, so ranks that hold different
# parameters (pipeline stages) never write the same key.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextmanager
def quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns on every save/load (also from its writer thread) that it
    # assumes one process, which is what we mean: silence exactly that message.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    yield


def last_line(error: BaseException) -> str:
    """The gist of an error: DCP's CheckpointException carries every rank's traceback, last line last."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else repr(error)


def reraise_interrupt(error: BaseException) -> None:
    """A Ctrl-C or exit that reached DCP stays what it is: never a CheckpointError."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        raise error
    failures = getattr(error, "failures", None) if isinstance(error, CheckpointException) else None
    for failure in (failures or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            raise type(inner)() from error
