"""The intra-op thread count hookloop trains with: one per process unless told otherwise.

torch runs its intra-op work on an OpenMP team of one thread per core, and GNU OpenMP (the runtime
torch's wheels use) keeps a waiting thread spinning for ~300,000 rounds before it sleeps. Alone on
an idle machine that is the fastest choice for one process; beside any other busy process it is
the slowest: every barrier waits for a team thread the scheduler gave to the other process, while
its partner spins through the slice that thread needed. Measured here (``benchmarks/threads.py``,
figures in docs/performance.md), one thread per process kept its throughput beside a competing job
where a team of two fell to a tenth of its own, and a shorter spin or passive waits did not close
the gap. torchrun makes the same choice for its workers (``OMP_NUM_THREADS=1``).

So ``hookloop train`` and :func:`hookloop.train.build` use one intra-op thread unless
``train.num_threads`` or ``OMP_NUM_THREADS`` says otherwise (set it to the cores on a machine the
run has to itself). The ``hookloop`` command sets ``OMP_NUM_THREADS`` before torch is imported
(:func:`apply_environment`), so the OpenMP runtime starts with it; a process that imported torch
first gets the count from ``torch.set_num_threads`` when the run is built. The start-up summary
(:func:`describe`) says the count and where it came from.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["DEFAULT_THREADS", "apply_environment", "chosen", "describe"]

DEFAULT_THREADS = 1  # intra-op threads per process when neither the config nor the environment says
_VARIABLE = "OMP_NUM_THREADS"
_set_here = False  # apply_environment set the variable in this process


def apply_environment(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``OMP_NUM_THREADS`` to :data:`DEFAULT_THREADS` when ``environ`` (``os.environ``) does not
    name it and torch is not imported yet (its OpenMP runtime reads the variable as it loads);
    return whether it was set."""
    global _set_here
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or _VARIABLE in environ:
        return False
    environ[_VARIABLE] = str(DEFAULT_THREADS)
    if environ is os.environ:
        _set_here = True
    return True


def chosen(configured: int | None, environ: MutableMapping[str, str] | None = None) -> int | None:
    """The count to pass to ``torch.set_num_threads`` for a run whose ``train.num_threads`` is
    ``configured``: that, else hookloop's default when the environment names none; None: keep the
    count the environment gave."""
    environ = os.environ if environ is None else environ
    if configured:
        return configured
    return None if _VARIABLE in environ else DEFAULT_THREADS


def describe(num_threads: int, configured: int | None) -> str:
    """The start-up summary's words for the intra-op thread count and where it came from."""
    if configured:
        source = "train.num_threads"
    elif _set_here or _VARIABLE not in os.environ:
        source = f"hookloop's default; train.num_threads={os.cpu_count()} for every core"
    else:
        source = f"{_VARIABLE}={os.environ[_VARIABLE]} in the environment"
    return f"{num_threads} intra-op ({source})"
