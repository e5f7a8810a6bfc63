"""Process exit codes, so a job script can tell a finished run, a crash and a stop apart.

=====  ======================  ==============================================================
code   name                    meaning
=====  ======================  ==============================================================
0      SUCCESS                 the run reached its end (max steps / epochs / data)
1      ERROR                   an unexpected exception (a crash)
2      (not a member)          invalid configuration: the example scripts print one line
                               naming the field and exit before any process group, model or
                               file is created. Fix the config; do not requeue.
75     STOPPED                 stopped early on purpose and resumable: a stop signal (SIGTERM,
                               SIGUSR1), ``exit_duration_in_mins``, ``exit_interval`` or a first
                               Ctrl-C; a final checkpoint was requested. Requeue the job.
76     NAN_ABORT               the NaN detector gave up (action="raise", rollbacks exhausted, or
                               no checkpoint old enough to roll back to)
77     HEALTH_CHECK_FAILED     a rank hung or a peer was lost: a failed or timed-out health check,
                               the progress watchdog, or a collective that failed on a dead peer
78     STRAGGLER_ABORT         a rank was slower than the straggler threshold
79     REQUEUE_WITHOUT_NODE    a node computes wrong (its replica's weights silently differ from
                               the others'): requeue without the node(s) ``exit_status.json``
                               names in ``"nodes"``
130    (not a member)          a second Ctrl-C interrupted the run at once (``KeyboardInterrupt``)
=====  ======================  ==============================================================

torchrun exits 1 whenever any worker fails, so these codes do not reach a job script through it:
rank 0 of a trainer with a ``run_dir`` also records how the run ended in
``run_dir/exit_status.json`` (:mod:`engine.exit_status`; for exit 2 only when a setting is found
wrong while the run exists, e.g. ``checkpoint.max_index_mb``). ``docs/requeue.md`` has what a job
script should do with each code.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    SUCCESS = 0
    ERROR = 1
    STOPPED = 75
    NAN_ABORT = 76
    HEALTH_CHECK_FAILED = 77
    STRAGGLER_ABORT = 78
    REQUEUE_WITHOUT_NODE = 79
