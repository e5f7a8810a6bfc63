"""Intra-op threads of the threads hookloop runs in the background.

With ATen's OpenMP backend (torch's Linux builds), every thread that runs a parallel torch op (a copy
or an elementwise op on more than 32768 elements) leads an OpenMP team of its own, sized by that
thread's own OpenMP setting. ``torch.set_num_threads`` sets it for the calling thread and seeds it for
threads that have not run a parallel op yet, so a background thread starts with the training
thread's count, and its team's worker threads live as long as the thread does. The checkpoint
writer, copying the state to host memory, left such a team behind at its first save. From then on
GNU OpenMP counted more threads than cores and stopped spinning in the training thread's barriers:
its worker slept and was woken at every parallel region (about 1000 context switches per step of a
small model), and every later training step took 1.5-2.5 times as long on 2 cores.

:func:`use_one_intra_op_thread` makes the calling thread run its torch ops on itself alone, so it
never starts a team. Only this thread's OpenMP setting changes: ``torch.set_num_threads(1)`` would
also overwrite the process-wide value later threads start with, resize the XNNPACK thread pool every
thread shares and clear oneDNN's cache.

:func:`lower_priority` gives a thread whose work runs without the interpreter lock (checksums, the
kernel's writeback, the NaN/Inf check's reductions) the lowest CPU priority (Linux: the thread's own
nice value, :data:`BACKGROUND_NICE`): that work then takes the cores only when training leaves them
idle, instead of taking turns with training's threads. A thread that runs Python between its system
calls (the checkpoint writer, planning and serializing a save) keeps training's priority: lowered,
it would hold the interpreter lock while it waits for a core, and training's thread, needing the
lock, would wait with it for as long as other processes keep the cores. Beside a competing torch
job, a tiny Llama saving every 10 steps kept 0.825-0.888 of its throughput (read locally) with the
writer at the lowest priority and 0.950-0.965 with it at training's, its helpers at the lowest
(three interleaved rounds each, 2026-12-03); quiet, 0.922-0.957 and 0.942-0.967.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
import threading
from typing import Any

import torch

__all__ = ["lower_priority", "openmp_backend", "prepare", "use_one_intra_op_thread"]

logger = logging.getLogger(__name__)

_SETTER: Any = None  # omp_set_num_threads of the OpenMP runtime torch uses; False: none found


def openmp_backend() -> bool:
    """Whether ATen runs intra-op work on OpenMP (per-thread teams) rather than its own shared pool."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _omp_set_num_threads() -> Any:
    """``omp_set_num_threads`` as torch's own library resolves it (so the same runtime), or False."""
    global _SETTER
    if _SETTER is not None:
        return _SETTER
    _SETTER = False
    if not openmp_backend():
        return _SETTER
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = sorted(glob.glob(os.path.join(libdir, "libtorch_cpu.*"))) + [None]
    for path in candidates:  # None: the symbols the process already has (a build without libtorch_cpu)
        try:
            setter = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], None
        _SETTER = setter
        break
    else:
        logger.debug("no omp_set_num_threads found: background threads keep torch's thread count")
    return _SETTER


def prepare() -> None:
    """Find the OpenMP runtime now (once per process; it reads torch's build information), so that
    :func:`use_one_intra_op_thread` on a thread starting beside training takes microseconds."""
    try:
        _omp_set_num_threads()
    except Exception as e:  # noqa: BLE001 - use_one_intra_op_thread reports it
        logger.debug("no OpenMP runtime found: %s", e)


#: The nice value of threads working beside training without the interpreter lock (19: the lowest
#: priority).
BACKGROUND_NICE = 19


def use_one_intra_op_thread() -> bool:
    """Run the calling thread's torch ops on this thread alone (for threads working beside
    training; see the module docstring).

    Returns whether the thread now has one intra-op thread. Never raises: a thread pool's initializer
    that raised would break the pool, and a thread that keeps torch's count still works, only slower
    for the others."""
    try:
        setter = _omp_set_num_threads()
        if not setter:
            return torch.get_num_threads() == 1
        # ATen applies the process-wide count to a thread at its first parallel op: let it happen now,
        # or it would undo the setting below there.
        torch.get_num_threads()
        setter(1)
        return torch.get_num_threads() == 1
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.debug("could not limit this thread to one intra-op thread: %s", e)
        return False


def lower_priority() -> None:
    """The calling thread's nice value to :data:`BACKGROUND_NICE` (Linux threads have their own),
    for a thread whose work runs without the interpreter lock (see the module docstring). Never
    raises."""
    if not sys.platform.startswith("linux"):  # elsewhere a process has one nice value for all threads
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))
    except OSError as e:
        logger.debug("could not lower this thread's priority: %s", e)
