"""When a run has started: the moment from which it may write its record.

A run starts from its resolved state. At TRAIN_START the checkpointer resumes (or finds nothing to
resume) and every handler checks what only the running trainer can check (a changed global batch,
its own settings); any of them may refuse the start by raising, a :class:`ConfigError` naming the
field for a setting. The run has *started* only once every TRAIN_START handler has run on every
rank and every rank agreed that none failed: the trainer then fires ``RUN_STARTED``, and only from
there on does anything write to the run directory (the resolved config, the loggers' files,
progress records, sample traces, checkpoints, ``exit_status.json``). A start refused on any rank
writes nothing there::

    fire(TRAIN_START)        # resume; handlers check; any may raise
      ...                    # the trainer's last TRAIN_START handler:
      agree()                # ONE all-reduce: did any rank fail (and with which exit code)?
      fire(RUN_STARTED)      # the run has started: handlers may write from here on

Every rank takes the same way out of a refused start. A rank whose TRAIN_START handler raised
joins the agreement from the trainer's error path with its failure (and exit code), then raises its
own error as usual; when any rank failed, a second small collective brings the first failing rank's
error to every rank, and the ranks that did not fail end with :class:`StartRefused` carrying it and
the agreed exit code. Rank 0 says the error, once (its own, or the one it was told); the other
ranks end quietly with the same code. Every collective here runs under the process group's timeout.
"""

from __future__ import annotations

from typing import Any

from hookloop.engine import parallel
from hookloop.engine.agreement import agreed_exit_code, exit_code_votes, sum_over_ranks
from hookloop.engine.errors import ConfigError, StartRefused, exit_code_of

__all__ = ["RunStart", "error_line"]


def error_line(error: BaseException) -> str:
    """The one line a refused start says: ``config error: <field>: ...`` for a config error, else
    ``<Type>: <first line of the message>``."""
    if isinstance(error, StartRefused):
        return error.error
    if isinstance(error, ConfigError):
        return f"config error: {error}"
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class RunStart:
    """The start agreement of one trainer (see the module docstring): :meth:`begin` at TRAIN_START's
    first handler, :meth:`agree` at its last, :meth:`fail` from the error path in between."""

    def __init__(self, control: Any) -> None:
        self._control = control
        #: Whether the current run has started (every rank passed TRAIN_START): until then nothing
        #: may be written to the run directory.
        self.started = False
        self._starting = False

    def begin(self) -> None:
        self.started = False
        self._starting = True

    def agree(self) -> bool:
        """Every rank got through TRAIN_START: the run has started. Returns whether a stop asked for
        at TRAIN_START is agreed. Raises :class:`StartRefused` when another rank failed."""
        return self._vote(None)

    def fail(self, error: BaseException) -> None:
        """This rank failed at TRAIN_START with ``error``: vote so (once), so that every rank ends
        the same way instead of waiting for this one; the caller then raises ``error``."""
        if self._starting:
            self._vote(error)

    def _vote(self, error: BaseException | None) -> bool:
        self._starting = False
        code = exit_code_of(error) if error is not None else 0
        votes = sum_over_ranks([self._control.stop, error is not None, *exit_code_votes(code)])
        if votes[1] == 0:
            self.started = True
            return votes[0] > 0
        if parallel.world_size() == 1:
            return False  # the error is this process's own
        mine = None if error is None else (parallel.rank(), error_line(error))
        rank, line = next(item for item in parallel.gather_objects(mine) if item is not None)
        if error is None:  # this rank did not fail: it ends like the one that did, quietly
            raise StartRefused(line, agreed_exit_code(votes[2:]), rank)
        return False
