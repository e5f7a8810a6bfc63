"""The CPU thread settings hookloop trains with: a fair share of a machine other jobs use too.

torch runs its intra-op work on an OpenMP team of one thread per core, and GNU OpenMP (the runtime
torch's wheels use) keeps a waiting thread spinning for ~300,000 rounds before it sleeps. Alone on
a machine that is the fastest choice; beside another job doing the same it is the slowest: each
barrier waits for a thread the scheduler has given to the other job, while the spinning threads
burn the slices that thread needed (measured in ``benchmarks/threads.py``, figures in
docs/performance.md). The defaults below keep the team but let a waiting thread sleep soon.

The ``hookloop`` command applies them (:func:`apply_environment`) before torch is imported, since
the OpenMP runtime reads them when it loads; a variable already set in the environment is kept.
``hookloop.train`` runs in a process that imported torch already: there only the intra-op count can
still change (``train.num_threads``), and the start-up summary (:func:`describe`) says what the run
got. Users of the bare :class:`~hookloop.engine.Trainer` set the same variables before importing
torch (docs/performance.md).

Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["ENVIRONMENT", "apply_environment", "describe"]

_applied: dict[str, str] = {}  # what apply_environment set in this process

# Variable -> hookloop's default. GOMP_SPINCOUNT: rounds a waiting GNU OpenMP thread spins before it
# sleeps (the runtime's default is 300,000); KMP_BLOCKTIME: the same for Intel's OpenMP, in ms.
ENVIRONMENT: dict[str, str] = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}


def apply_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`ENVIRONMENT` that ``environ`` (``os.environ``) does not name; return the
    ones set. Has an effect only before torch is imported (the OpenMP runtime reads them as it
    loads): returns ``{}`` and changes nothing when torch is imported already."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        return {}
    applied = {k: v for k, v in ENVIRONMENT.items() if k not in environ}
    environ.update(applied)
    if environ is os.environ:
        _applied.update(applied)
    return applied


def describe(num_threads: int) -> str:
    """One line for the start-up summary: the intra-op thread count and where the wait settings came
    from (hookloop's defaults, the environment, or the OpenMP runtime's own)."""
    applied, environ = _applied, os.environ
    waits = []
    for name in ENVIRONMENT:
        if name in applied:
            waits.append(f"{name}={applied[name]} (hookloop's default)")
        elif name in environ:
            waits.append(f"{name}={environ[name]} (environment)")
    said = ", ".join(waits) if waits else "the OpenMP runtime's defaults (torch was imported before hookloop could set them)"
    return f"{num_threads} intra-op thread(s); waits: {said}"
