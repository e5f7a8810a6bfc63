"""Console logging for a training script: :func:`setup_logging` shows hookloop's lifecycle lines.

    from engine import setup_logging
    setup_logging()                 # at the start of main(): "[hookloop] resumed from ... (step 6)"

The library's modules only create loggers (``engine.*``, ``handlers.*``) and never configure
them; the script that owns the process calls this once. Without it, Python prints only warnings.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOGGER_NAMES", "setup_logging"]

LOGGER_NAMES = ("engine", "handlers")
# ignite's Engine logs every run's start and end at INFO under the trainer's logger (not lifecycle),
# and every error at ERROR before the trainer's own error path reports it: only its CRITICAL lines.
_QUIET = {"engine.trainer.ignite": logging.CRITICAL}


class _Formatter(logging.Formatter):
    """``[hookloop] message``; warnings and worse name their level: ``[hookloop] WARNING: ...``."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"[hookloop] {record.levelname}: {message}"
        return f"[hookloop] {message}"


class _HookloopHandler(logging.StreamHandler):
    """The one stderr handler :func:`setup_logging` installs (its type marks it as ours)."""


def _rank() -> int:
    """This process's rank: torchrun's ``RANK`` (set before any process group exists), else the
    process group's."""
    env = os.environ.get("RANK")
    if env is not None:
        try:
            return int(env)
        except ValueError:
            pass
    from engine import parallel

    return parallel.rank()


def setup_logging(level: int | str = "INFO", rank_zero_only: bool = True) -> logging.Handler:
    """Print the ``engine`` and ``handlers`` loggers' records at ``level`` and above to stderr.

    With ``rank_zero_only`` the ranks other than 0 print only warnings and errors, so a multi-rank
    run says each lifecycle line once. Calling it again changes the level, never adds a handler.
    Records still propagate to the root logger, so an application's own handlers see them too.
    Returns the stderr handler."""
    resolved = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(resolved, int):
        raise ValueError(f"setup_logging: level {level!r} is not a logging level; use e.g. 'INFO' or 'DEBUG'")
    if rank_zero_only and _rank() != 0:
        resolved = max(resolved, logging.WARNING)
    handler = None
    for name in LOGGER_NAMES:
        log = logging.getLogger(name)
        log.setLevel(resolved)
        ours = [h for h in log.handlers if isinstance(h, _HookloopHandler)]
        if handler is None and ours:
            handler = ours[0]
    if handler is None:
        handler = _HookloopHandler(sys.stderr)
        handler.setFormatter(_Formatter("%(message)s"))
    for name in LOGGER_NAMES:
        log = logging.getLogger(name)
        if handler not in log.handlers:
            log.addHandler(handler)
    for name, quiet in _QUIET.items():
        logging.getLogger(name).setLevel(max(resolved, quiet))
    return handler
