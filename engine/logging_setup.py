"""hookloop's lifecycle lines on stderr, without set-up, and the standard ways to change that.

Every module logs under the ``hookloop`` logger (``hookloop.engine.trainer``,
``hookloop.handlers.*``, ...): "resumed from ... (step 6)", "nothing left to train", the
stop reason, the final checkpoint. Importing hookloop gives that logger level INFO and one stderr
handler that prints ``[hookloop] message`` (INFO on rank 0 only, warnings on every rank) *while the
application has configured no logging of its own*: once the root logger has a handler
(``logging.basicConfig(...)``), the records reach it by propagation instead, and ours stays quiet so
nothing prints twice. The standard ``logging`` calls change the rest::

    logging.getLogger("hookloop").setLevel(logging.WARNING)   # only warnings and errors
    logging.getLogger("hookloop").disabled = True             # silent

:func:`setup_logging` makes the stderr handler explicit: it prints at the level given even when the
root logger has handlers of its own.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOGGER_NAME", "setup_logging"]

LOGGER_NAME = "hookloop"
# ignite's Engine logs every run's start and end at INFO under the trainer's logger (not lifecycle),
# and every error at ERROR before the trainer's own error path reports it: only its CRITICAL lines.
_QUIET = {"hookloop.engine.trainer.ignite": logging.CRITICAL}


class _Formatter(logging.Formatter):
    """``[hookloop] message``; warnings and worse name their level: ``[hookloop] WARNING: ...``."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"[hookloop] {record.levelname}: {message}"
        return f"[hookloop] {message}"


class _HookloopHandler(logging.StreamHandler):
    """The ``hookloop`` logger's stderr handler. Until :func:`setup_logging` makes it explicit it
    steps aside when the root logger has handlers (the application configured logging), and on
    ranks other than 0 it prints only warnings and errors."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(_Formatter("%(message)s"))
        self.explicit = False
        self.rank_zero_only = True

    def emit(self, record: logging.LogRecord) -> None:
        if not self.explicit and logging.getLogger().handlers:
            return  # propagation hands the record to the application's handlers
        if self.rank_zero_only and record.levelno < logging.WARNING and _rank() != 0:
            return
        self.stream = sys.stderr  # follow a redirected sys.stderr (pytest's capture, contextlib)
        super().emit(record)


def _rank() -> int:
    """This process's rank: torchrun's ``RANK`` (set before any process group exists), else the
    process group's."""
    env = os.environ.get("RANK")
    if env is not None:
        try:
            return int(env)
        except ValueError:
            pass
    if "torch" not in sys.modules:  # no process group exists without torch (a refusal before it)
        return 0
    from hookloop.engine import parallel

    return parallel.rank()


def _handler() -> _HookloopHandler:
    log = logging.getLogger(LOGGER_NAME)
    for h in log.handlers:
        if isinstance(h, _HookloopHandler):
            return h
    handler = _HookloopHandler()
    log.addHandler(handler)
    return handler


def install_default() -> None:
    """What importing hookloop does: level INFO on the ``hookloop`` logger (unless the application
    set one already) and the stderr handler, once."""
    log = logging.getLogger(LOGGER_NAME)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    _handler()
    for name, quiet in _QUIET.items():
        quiet_log = logging.getLogger(name)
        if quiet_log.level == logging.NOTSET:
            quiet_log.setLevel(quiet)


def setup_logging(level: int | str = "INFO", rank_zero_only: bool = True) -> logging.Handler:
    """Print the ``hookloop`` logger's records at ``level`` and above to stderr, whatever else is
    configured.

    With ``rank_zero_only`` the ranks other than 0 print only warnings and errors, so a multi-rank
    run says each lifecycle line once. Calling it again changes the level, never adds a handler.
    Records still propagate to the root logger, so an application's own handlers see them too.
    Returns the stderr handler."""
    resolved = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(resolved, int):
        raise ValueError(f"setup_logging: level {level!r} is not a logging level; use e.g. 'INFO' or 'DEBUG'")
    logging.getLogger(LOGGER_NAME).setLevel(resolved)
    handler = _handler()
    handler.explicit = True
    handler.rank_zero_only = rank_zero_only
    for name, quiet in _QUIET.items():
        logging.getLogger(name).setLevel(max(resolved, quiet))
    return handler
