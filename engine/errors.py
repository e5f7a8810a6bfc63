"""Exception types. Each message names the field or argument at fault and how to fix it."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "HookloopError",
    "PeerCrashed",
    "PeerFailure",
    "StartRefused",
    "TrainingAborted",
    "exit_code_of",
]


class HookloopError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(HookloopError, ValueError):
    """Invalid configuration or argument; raised before any process group or model is built.

    ``field`` is the dotted name of the offending field (``train.max_steps``) or argument.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")

    @classmethod
    def caused_by(cls, field: str, what: str, error: BaseException, hint: str = "") -> ConfigError:
        """``error``, raised by the user's code, as one line: ``<field>: <what>: <Type>: <its first
        line><hint>``."""
        line = next((s.strip() for s in str(error).splitlines() if s.strip()), "")
        return cls(field, f"{what}: {type(error).__name__}{': ' if line else ''}{line}{hint}")


class TrainingAborted(HookloopError, RuntimeError):
    """The run was stopped on purpose (e.g. NaN rollbacks exhausted, failed health check).

    ``exit_code`` is one of :class:`engine.ExitCode`; a launcher script exits with it.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        self.exit_code = int(exit_code)
        super().__init__(message)


class PeerFailure(TrainingAborted):
    """A collective failed because another rank is gone or hung; ``exit_code`` is 77."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 77)


class PeerCrashed(TrainingAborted):
    """Another rank failed with an error of its own (named in the message), which ended this rank's
    run too; ``exit_code`` is that rank's (1 for an exception), ``rank`` the rank that failed."""

    def __init__(self, message: str, rank: int, exit_code: int = 1) -> None:
        self.rank = int(rank)
        super().__init__(message, exit_code)


class StartRefused(HookloopError):
    """Another rank refused the run's start (a :class:`ConfigError` or another error at TRAIN_START,
    before anything was written), so this rank does not start either and ends with the same
    ``exit_code``. ``error`` is that error's one line (``config error: <field>: ...`` for a
    config error), which rank 0 says once; ``rank`` is the rank that raised it."""

    def __init__(self, error: str, exit_code: int, rank: int) -> None:
        self.error, self.exit_code, self.rank = error, int(exit_code), int(rank)
        super().__init__(f"the start was refused on rank {rank}: {error}")


def exit_code_of(error: BaseException) -> int:
    """The process exit code an error stands for: its own ``exit_code`` (TrainingAborted),
    130 for Ctrl-C, 2 for a configuration error, else 1."""
    if isinstance(error, TrainingAborted | StartRefused):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return 130
    if isinstance(error, ConfigError):
        return 2
    return 1
