"""Process exit codes, so a job script can tell a finished run, a crash and a stop apart.

=====  ======================  ==============================================================
code   name                    meaning
=====  ======================  ==============================================================
0      SUCCESS                 the run reached its end (max steps / epochs / data)
1      ERROR                   an unexpected exception (a crash)
75     STOPPED                 stopped early on purpose and resumable: a stop signal (SIGTERM,
                               SIGUSR1), ``exit_duration_in_mins`` or ``exit_interval``; a
                               final checkpoint was requested. Requeue the job.
76     NAN_ABORT               the NaN detector gave up (rollbacks exhausted or action="raise")
77     HEALTH_CHECK_FAILED     a collective health check failed or timed out (hung peer)
78     STRAGGLER_ABORT         a rank was slower than the straggler threshold
=====  ======================  ==============================================================
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
