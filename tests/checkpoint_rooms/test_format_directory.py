"""The directory format: ``step_N`` names, complete and torn checkpoints, ``latest``, and what a
path a user gave names (or a one-line error saying what it is and what to pass)."""

from __future__ import annotations

import os

import pytest

from hookloop.engine.checkpoint_format.directory import (
    LATEST,
    MARKER,
    complete_checkpoints,
    parse_step,
    read_latest,
    resolve_checkpoint,
    step_dir_name,
    write_latest,
)
from hookloop.engine.checkpoint_format.errors import CheckpointError


def checkpoint(directory, step: int, complete: bool = True) -> str:
    path = directory / step_dir_name(step)
    path.mkdir(parents=True)
    if complete:
        (path / MARKER).write_text("{}")
    return str(path)


def test_step_names_round_trip_and_nothing_else_parses():
    assert step_dir_name(100) == "step_00000100" and parse_step("step_00000100") == 100
    for name in ("step_00000100.partial-0000abcd", "latest", "step_", "step_1x", "xstep_1"):
        assert parse_step(name) is None


def test_complete_checkpoints_newest_first_and_torn_ones_apart(tmp_path):
    assert complete_checkpoints(tmp_path / "missing") == ([], [])
    for step in (2, 10, 1):
        checkpoint(tmp_path, step)
    torn = checkpoint(tmp_path, 11, complete=False)
    (tmp_path / step_dir_name(12)).write_text("a file, not a checkpoint")
    (tmp_path / f"{step_dir_name(13)}.partial-0000abcd").mkdir()
    complete, torn_found = complete_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [10, 2, 1] and torn_found == [torn]


def test_latest_round_trips_and_is_none_when_missing_or_empty(tmp_path):
    assert read_latest(tmp_path) is None
    write_latest(tmp_path, step_dir_name(3))
    assert read_latest(tmp_path) == step_dir_name(3)
    (tmp_path / LATEST).write_text("\n")
    assert read_latest(tmp_path) is None


def test_a_path_resolves_to_a_complete_checkpoint(tmp_path):
    one = checkpoint(tmp_path / "ckpt", 1)
    two = checkpoint(tmp_path / "ckpt", 2)
    checkpoint(tmp_path / "ckpt", 3, complete=False)
    assert resolve_checkpoint(one) == (one, False)
    assert resolve_checkpoint(tmp_path / "ckpt") == (two, True)  # the newest complete one in it


def not_a_checkpoint(directory, kind: str):
    """A path a user might give that names no complete checkpoint."""
    if kind == "missing":
        return directory / "nowhere"
    if kind == "file":
        (directory / "file").write_text("x")
        return directory / "file"
    if kind == "torn":
        return checkpoint(directory, 4, complete=False)
    if kind == "partial":
        (directory / f"{step_dir_name(5)}.partial-0000abcd").mkdir()
        return directory / f"{step_dir_name(5)}.partial-0000abcd"
    if kind == "only-torn":
        checkpoint(directory / "torn", 6, complete=False)
        return directory / "torn"
    (directory / "run" / "checkpoints").mkdir(parents=True)  # a run directory
    return directory / "run"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "does not exist"),
        ("file", "is not a directory"),
        ("torn", "is incomplete"),
        ("partial", "is incomplete"),
        ("only-torn", "holds no complete checkpoint"),
        ("run-dir", "did you mean .*checkpoints"),
    ],
)
def test_anything_else_is_one_line_saying_what_it_is_and_what_to_pass(tmp_path, kind, message):
    path = not_a_checkpoint(tmp_path, kind)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match=message) as e:
        resolve_checkpoint(path)
    assert "pass a complete step_N directory" in str(e.value) and "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == before  # nothing created or changed
