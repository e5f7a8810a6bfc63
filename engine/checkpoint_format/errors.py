"""The errors every checkpoint reader and writer raises: :class:`CheckpointError` and its two kinds
that are also a setting to change (another model layout, an index over ``checkpoint.max_index_mb``).
The project's code imports them from here; :mod:`hookloop.handlers.checkpoint` names them for
users beside the handler that raises them."""

from __future__ import annotations

import math
import os
from typing import Any

from hookloop.engine.errors import ConfigError, HookloopError

__all__ = ["CheckpointError", "CheckpointIndexBoundError", "CheckpointLayoutError", "index_mb"]


class CheckpointError(HookloopError, RuntimeError):
    """A checkpoint could not be written or read (missing, incomplete, from another model, unsafe)."""


class CheckpointLayoutError(CheckpointError, ConfigError):
    """The checkpoint to load holds another model layout (other layers, widths or pipeline split).

    Also a :class:`ConfigError` naming the field that chose the checkpoint (``checkpoint.resume``),
    since the fix is a setting: resume with the layout that wrote it or start fresh. Raised before
    anything is loaded, so the running model and the saved checkpoints are untouched.
    ``difference`` says how the layouts differ, in a few words."""

    difference: str = ""


class CheckpointIndexBoundError(CheckpointError, ConfigError):
    """An intact checkpoint's DCP index (``.metadata``) of ``size`` bytes is larger than the
    ``limit`` that ``checkpoint.max_index_mb`` lets a run read: a setting to raise, not damage.

    ``needed`` is the smallest ``checkpoint.max_index_mb`` that reads it; ``then`` ends the message
    (what happened and what the new value does). Raised where the index is read (nothing of it is
    unpickled) and at the save that wrote it."""

    def __init__(self, path: str | os.PathLike, size: int, limit: int, then: str) -> None:
        self.path, self.size, self.limit, self.then = os.fspath(path), size, limit, then
        self.needed = index_mb(size)
        super().__init__(
            "checkpoint.max_index_mb",
            f"the index {self.path} has {size} bytes, more than the {limit} ({limit / 2**20:.3g} MiB) "
            f"this setting lets a run read; set checkpoint.max_index_mb to at least {self.needed:g} "
            f"{then}",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.size, self.limit, self.then)


def index_mb(size: int) -> float:
    """The smallest ``checkpoint.max_index_mb`` (in tenths of a MiB) that lets an index of ``size``
    bytes be read."""
    return math.ceil(size / 2**20 * 10) / 10
