"""``exit_status.json``: how a run ended, for the job script that starts the next one.

Under torchrun the launcher exits 1 whenever a worker exits non-zero, so a resumable stop (75)
never reaches the job script through the exit status. Rank 0 therefore writes
``<run_dir>/exit_status.json`` atomically on every exit path (and on a lost peer or a hang, 77,
the first rank of every other node too, unless rank 0 has recorded the run's end already: the
node that is lost may be the one that holds rank 0)::

    {"code": 75, "meaning": "STOPPED", "reason": "SIGTERM received", "step": 1200,
     "checkpoint": "runs/gpt/checkpoints/step_00001200", "time": "2026-11-23T10:01:02+00:00"}

A requeue script reads ``code`` (75: requeue; 0: done; anything else: look at the logs). A run
ended by an error of one rank (an exception: code 1) also says ``"rank"``, the rank that failed,
whose error ``reason`` names; a peer that vanished or went silent is 77. A run that asks to be
requeued without some nodes (79) names their hosts in ``"nodes"``.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.files import atomic_write

__all__ = [
    "EXIT_STATUS_FILE",
    "exit_status_identity",
    "nothing_left_to_train",
    "read_exit_status",
    "write_exit_status",
]

EXIT_STATUS_FILE = "exit_status.json"


def write_exit_status(
    run_dir: str | os.PathLike,
    *,
    code: int,
    reason: str,
    step: int | None = None,
    checkpoint: str | None = None,
    rank: int | None = None,
    nodes: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write ``run_dir/exit_status.json`` atomically (temporary file, fsync, rename); ``rank``: the
    rank whose error ended the run (a crash), else left out; ``nodes``: the hosts to requeue
    without (left out when none)."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        meaning = ExitCode(code).name
    except ValueError:
        meaning = {2: "CONFIG_ERROR", 130: "INTERRUPTED"}.get(code, "ERROR")
    record: dict[str, Any] = {
        "code": int(code),
        "meaning": meaning,
        "reason": reason,
        "step": step,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if rank is not None:
        record["rank"] = int(rank)
    if nodes:
        record["nodes"] = list(nodes)
    path = directory / EXIT_STATUS_FILE
    atomic_write(path, json.dumps(record, indent=1) + "\n")
    return path


def exit_status_identity(run_dir: str | os.PathLike) -> tuple[int, int, int] | None:
    """Which version of ``run_dir/exit_status.json`` is there now (each write renames a new file
    into place, so any write changes it), or None without one: lets a rank tell whether another
    rank has recorded the end of this run since it looked, without comparing clocks of nodes."""
    try:
        st = os.stat(Path(run_dir) / EXIT_STATUS_FILE)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def read_exit_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The recorded exit status, or None when the run directory has none."""
    path = Path(run_dir) / EXIT_STATUS_FILE
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def nothing_left_to_train(checkpoint: str | os.PathLike, step: int, max_steps: int) -> str:
    """The reason a run resumed from ``checkpoint`` at ``step >= max_steps`` stops at once (exit 0)."""
    return (
        f"the checkpoint {checkpoint} is at step {step} >= max_steps ({max_steps}): nothing left to "
        "train, this run is finished; to start another, pass train.run_dir=<new dir> (or "
        "checkpoint.resume=null to train again from step 0)"
    )
