"""The CPU threads hookloop trains with: waiting threads that sleep, so a run keeps its share of a
machine other jobs use too.

torch runs its intra-op work on an OpenMP team of one thread per core, and GNU OpenMP (the runtime
torch's wheels use) keeps a waiting team thread spinning for ~300,000 rounds (a few milliseconds)
before it sleeps. Alone on an idle machine that costs nothing; beside any other busy process it
is ruinous: each of the thousands of barriers in a step waits for a team thread the scheduler gave
to the other process, while its partner spins through the slice that thread needed. Measured here
(``benchmarks/threads.py``, figures in docs/performance.md): beside a competing torch job torch's
default kept 0.11-0.15 of its idle throughput; with passive waits (``OMP_WAIT_POLICY=passive``)
the same team kept 0.54-0.69 and lost nothing to 12% of idle speed; one thread kept 0.85-1.0 and
lost 30% of idle speed.

So the ``hookloop`` command sets ``OMP_WAIT_POLICY=passive`` before torch is imported
(:func:`apply_environment`; the runtime reads it as it loads) and keeps torch's thread count. A
process that imported torch before hookloop could set it (a script calling
:func:`hookloop.train.build`) trains with one intra-op thread instead, the choice that keeps its
share with spinning waits. ``train.num_threads`` and ``OMP_NUM_THREADS`` (and ``OMP_WAIT_POLICY``)
override; torchrun sets ``OMP_NUM_THREADS=1`` for its workers. The start-up summary
(:func:`describe`) says what the run got and why.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["FALLBACK_THREADS", "WAIT_POLICY", "apply_environment", "chosen", "describe"]

WAIT_POLICY = "passive"  # OMP_WAIT_POLICY the command sets when the environment names none
FALLBACK_THREADS = 1  # intra-op threads when torch loaded with spinning waits and nothing says a count
_THREADS, _WAITS = "OMP_NUM_THREADS", "OMP_WAIT_POLICY"
_set_here = False  # apply_environment set the wait policy in this process


def apply_environment(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``OMP_WAIT_POLICY`` to :data:`WAIT_POLICY` when ``environ`` (``os.environ``) names none
    and torch is not imported yet (its OpenMP runtime reads the variable as it loads); return
    whether it was set."""
    global _set_here
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or _WAITS in environ:
        return False
    environ[_WAITS] = WAIT_POLICY
    if environ is os.environ:
        _set_here = True
    return True


def _waits_told(environ: MutableMapping[str, str]) -> bool:
    """Whether the runtime was told how to wait before it loaded (by hookloop or the environment)."""
    return _set_here or _WAITS in environ


def chosen(configured: int | None, environ: MutableMapping[str, str] | None = None) -> int | None:
    """The count to pass to ``torch.set_num_threads`` for a run whose ``train.num_threads`` is
    ``configured``: that; else None (keep what torch has) when ``OMP_NUM_THREADS`` or the wait
    policy was set before torch loaded; else :data:`FALLBACK_THREADS`."""
    environ = os.environ if environ is None else environ
    if configured:
        return configured
    if _THREADS in environ or _waits_told(environ):
        return None
    return FALLBACK_THREADS


def describe(num_threads: int, configured: int | None) -> str:
    """The start-up summary's words for the intra-op threads, how they wait, and why."""
    environ = os.environ
    if configured:
        count = "train.num_threads"
    elif _THREADS in environ:
        count = f"{_THREADS}={environ[_THREADS]} in the environment"
    elif _waits_told(environ):
        count = "torch's default, one per core"
    else:
        count = "hookloop's default when torch was imported first, its waiting threads spinning"
    if _set_here:
        waits = f"{WAIT_POLICY} (hookloop's default)"
    elif _WAITS in environ:
        waits = f"{_WAITS}={environ[_WAITS]} in the environment"
    else:
        waits = "spinning (the OpenMP runtime's default: torch was imported first)"
    return f"{num_threads} intra-op ({count}); waits: {waits}"
