"""A directory of checkpoints: ``step_N`` names, completion markers, ``latest``, finding the
complete checkpoints and resolving a path a user gave. The whole picture is in
:mod:`hookloop.engine.checkpoint_format`."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.files import atomic_write

__all__ = [
    "LATEST",
    "MARKER",
    "complete_checkpoints",
    "is_complete",
    "parse_step",
    "read_json",
    "read_latest",
    "resolve_checkpoint",
    "step_dir_name",
    "write_json_atomic",
    "write_latest",
]

MARKER = ".complete"
LATEST = "latest"
#: Inside a checkpoint directory: the data files of the last pruned checkpoint, which the next save
#: writes over instead of making new files (see ``durable_files``); never read.
REUSE = ".reuse"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a complete-checkpoint directory name (``step_00000100`` -> 100), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(directory: str | os.PathLike) -> tuple[list[tuple[int, str]], list[str]]:
    """``([(step, path), ...] newest first, [torn step directories])`` found in ``directory``."""
    complete, torn = [], []
    if not os.path.isdir(directory):
        return complete, torn
    for name in os.listdir(directory):
        step = parse_step(name)
        path = os.path.join(directory, name)
        if step is None or not os.path.isdir(path):
            continue
        (complete.append((step, path)) if is_complete(path) else torn.append(path))
    complete.sort(reverse=True)
    return complete, sorted(torn)


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, bool]:
    """``(checkpoint, from_directory)``: the complete checkpoint a path a user gave names. A
    complete ``step_N`` directory is itself; a directory of checkpoints (the ``checkpoints`` folder
    of a run, holding ``step_N`` directories) names its newest complete one (``from_directory``
    True; verifying it on load may still fall back to an older one beside it). Anything else is a
    CheckpointError in one line saying what the path is and what to pass instead; nothing is
    created or changed."""
    path = os.path.abspath(path)
    what = "pass a complete step_N directory or the directory that holds them (its newest complete one loads)"
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; {what}")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is not a directory; {what}")
    if is_complete(path):
        return path, False
    name = os.path.basename(path)
    if parse_step(name) is not None or ".partial-" in name:
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker: it was being written when the run "
            f"stopped, or it is being pruned); {what}"
        )
    try:
        complete, torn = complete_checkpoints(path)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be listed ({e.strerror or e}); {what}") from None
    if complete:
        return complete[0][1], True
    if torn:
        raise CheckpointError(
            f"checkpoint directory {path} holds no complete checkpoint (only incomplete ones, e.g. "
            f"{os.path.basename(torn[-1])}); {what}"
        )
    hint = ""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        hint = f" (did you mean {os.path.join(path, 'checkpoints')}?)"
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {MARKER} marker) nor a directory of checkpoints (no "
        f"step_N directories in it){hint}; {what}"
    )


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so a reader sees the old file or the whole new one."""
    atomic_write(path, json.dumps(obj))


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_latest(directory: str | os.PathLike) -> str | None:
    """The directory name ``latest`` points to, or None."""
    path = os.path.join(directory, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_latest(directory: str | os.PathLike, name: str) -> None:
    atomic_write(os.path.join(directory, LATEST), name + "\n")
