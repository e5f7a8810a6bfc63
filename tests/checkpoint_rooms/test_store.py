"""The store: publishing a durable save, pruning what keep_last / keep_best no longer keep (never
``latest`` nor the newest known-good checkpoint, nothing outside the directory), the ranking metric,
the candidates to load, the sweep of a dead run's leftovers and the index bound."""

from __future__ import annotations

import logging
import math
import os

import pytest

from hookloop.engine.checkpoint_format.directory import (
    MARKER,
    REUSE,
    complete_checkpoints,
    read_json,
    read_latest,
    step_dir_name,
    write_latest,
)
from hookloop.engine.checkpoint_format.errors import CheckpointIndexBoundError
from hookloop.engine.checkpoint_format.manifest import checksum_files
from hookloop.engine.checkpoint_format.safe_read import verify_checkpoint
from hookloop.handlers.checkpoint.store import delete_tree, not_finite
from tests.checkpoint_rooms import fakes

LOGGER = "hookloop.handlers.checkpoint"


def publish(st, step: int, *, metrics=None, finite=None, payload: bytes = b"weights") -> bool:
    """A save of ``step`` as the writer hands it over: a partial directory of this session with its
    durable files, published."""
    partial = os.path.join(st.directory, f"{step_dir_name(step)}.partial-{fakes.SESSION_ID}")
    os.makedirs(partial)
    with open(os.path.join(partial, "__0_0.distcp"), "wb") as f:
        f.write(payload + str(step).encode())
    files = checksum_files(partial, ["__0_0.distcp"], 0)
    final = os.path.join(st.directory, step_dir_name(step))
    ok = st.publish(step, partial, final, mode="sync", metrics=metrics or {}, files=files, finite=finite)
    st.wait_pruned()
    return ok


def steps(directory) -> list[int]:
    return [s for s, _ in complete_checkpoints(directory)[0]]


def test_publish_writes_the_marker_with_the_manifest_then_renames_and_moves_latest(tmp_path, sess):
    st = fakes.store(tmp_path, sess)
    assert publish(st, 7, metrics={"val_loss": 1.5}, finite=True)
    final = tmp_path / step_dir_name(7)
    marker = read_json(final / MARKER)
    assert marker["step"] == 7 and marker["world_size"] == 1 and marker["mode"] == "sync"
    assert marker["metrics"] == {"val_loss": 1.5} and marker["finite"] is True
    assert set(marker["manifest"]["files"]) == {"__0_0.distcp"}
    assert verify_checkpoint(final) == ([], True)  # the manifest matches what is on disk
    assert read_latest(tmp_path) == step_dir_name(7)
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir_name(7)]  # the partial is gone


def test_publishing_a_step_again_replaces_the_old_checkpoint_and_leaves_nothing_behind(tmp_path, sess):
    st = fakes.store(tmp_path, sess)
    publish(st, 4, payload=b"before a rollback")
    publish(st, 4, payload=b"after a rollback")
    assert (tmp_path / step_dir_name(4) / "__0_0.distcp").read_bytes() == b"after a rollback4"
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir_name(4)]


def test_a_publish_the_file_system_refuses_is_false_and_leaves_latest(tmp_path, sess, caplog):
    st = fakes.store(tmp_path, sess)
    publish(st, 1)
    gone = os.path.join(tmp_path, f"{step_dir_name(2)}.partial-{fakes.SESSION_ID}")  # never made
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        ok = st.publish(2, gone, str(tmp_path / step_dir_name(2)), mode="sync", metrics={}, files={})
    assert ok is False
    assert read_latest(tmp_path) == step_dir_name(1) and steps(tmp_path) == [1]
    assert "could not publish checkpoint" in caplog.text


def test_pruning_keeps_the_last_keep_last_and_the_data_files_of_the_last_pruned_for_reuse(tmp_path, sess):
    st = fakes.store(tmp_path, sess, keep_last=2)
    for step in range(1, 6):
        publish(st, step)
    assert steps(tmp_path) == [5, 4]
    assert sorted(os.listdir(tmp_path)) == [REUSE, "latest", step_dir_name(4), step_dir_name(5)]
    assert os.listdir(tmp_path / REUSE) == ["__0_0.distcp"]  # step 3's, for the next save to write over
    assert (tmp_path / REUSE / "__0_0.distcp").read_bytes() == b"weights3"
    st.remove_reused()  # at the end of a run
    assert sorted(os.listdir(tmp_path)) == ["latest", step_dir_name(4), step_dir_name(5)]


def test_reuse_keeps_regular_files_only_and_leaves_a_reuse_entry_it_did_not_make(tmp_path, sess):
    st = fakes.store(tmp_path, sess, keep_last=1)
    publish(st, 1)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.distcp"
    outside.write_bytes(b"someone else's")
    os.symlink(outside, tmp_path / step_dir_name(1) / "__1_0.distcp")  # a link among the files
    publish(st, 2)
    assert os.listdir(tmp_path / REUSE) == ["__0_0.distcp"] and outside.read_bytes() == b"someone else's"
    other = tmp_path.parent / f"{tmp_path.name}-other"
    other.mkdir()
    delete_tree(str(tmp_path / REUSE))
    os.symlink(other, tmp_path / REUSE)  # not a directory of ours: never written into
    publish(st, 3)
    assert os.listdir(other) == [] and steps(tmp_path) == [3]


def test_pruning_never_deletes_latest(tmp_path, sess):
    for step in (1, 2, 3):
        publish(fakes.store(tmp_path, sess, keep_last=5), step)
    write_latest(tmp_path, step_dir_name(1))  # pointed back by hand
    st = fakes.store(tmp_path, sess, keep_last=1)
    st.prune()
    st.wait_pruned()
    assert steps(tmp_path) == [3, 1]


def test_pruning_keeps_the_newest_known_good_checkpoint_that_is_finite(tmp_path, sess):
    st = fakes.store(tmp_path, sess, keep_last=1, known_good=3)
    publish(st, 1, finite=True)
    publish(st, 2, finite=True)
    publish(st, 3, finite=False)  # a detector trusts step 3, but its saved state held NaN
    for step in (4, 5):
        publish(st, step, finite=True)
    assert steps(tmp_path) == [5, 2]  # 2 is the newest finite checkpoint at or before step 3


def test_not_finite_reads_the_marker_and_counts_an_older_marker_as_finite(tmp_path, sess):
    st = fakes.store(tmp_path, sess, keep_last=5)
    publish(st, 1, finite=False)
    publish(st, 2, finite=True)
    publish(st, 3)  # a marker of an earlier version records nothing
    assert [not_finite(str(tmp_path / step_dir_name(s))) for s in (1, 2, 3)] == [True, False, False]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_keeps_the_best_by_the_stored_metric(tmp_path, sess, mode):
    st = fakes.store(tmp_path, sess, keep_last=1, keep_best=2, metric_mode=mode)
    values = {1: 3.0, 2: 1.0, 3: 5.0, 4: 2.0, 5: 4.0}
    for step, value in values.items():
        publish(st, step, metrics={"val_loss": value})
    best = [2, 4] if mode == "min" else [3, 5]
    assert steps(tmp_path) == sorted({5, *best}, reverse=True)
    # the ranking lives in the markers: a new store (a restarted run) keeps the same ones
    again = fakes.store(tmp_path, sess, keep_last=1, keep_best=2, metric_mode=mode)
    publish(again, 6, metrics={"val_loss": 100.0 if mode == "min" else -100.0})
    assert steps(tmp_path) == sorted({6, *best}, reverse=True)


def test_keep_best_ties_go_to_the_older_and_unranked_checkpoints_fall_to_keep_last(tmp_path, sess):
    st = fakes.store(tmp_path, sess, keep_last=1, keep_best=1)
    publish(st, 1, metrics={"val_loss": 1.0})
    publish(st, 2, metrics={"val_loss": 1.0})  # a value carried over from step 1's validation
    publish(st, 3)  # saved without the metric
    publish(st, 4)
    assert steps(tmp_path) == [4, 1]


def test_pruning_removes_torn_checkpoints_older_than_the_newest_only(tmp_path, sess):
    st = fakes.store(tmp_path, sess, keep_last=5)
    (tmp_path / step_dir_name(1)).mkdir()  # a deletion a crash interrupted: marker already gone
    (tmp_path / step_dir_name(9)).mkdir()  # newer than anything complete: not pruning's business
    publish(st, 2)
    assert sorted(os.listdir(tmp_path)) == [REUSE, "latest", step_dir_name(2), step_dir_name(9)]
    assert os.listdir(tmp_path / REUSE) == []  # the torn one held no data file


def test_pruning_a_linked_checkpoint_removes_the_link_not_its_target(tmp_path, sess):
    elsewhere = tmp_path / "elsewhere"
    directory = tmp_path / "ckpt"
    directory.mkdir()
    elsewhere.mkdir()
    publish(fakes.store(elsewhere, sess, keep_last=5), 1)
    (directory / step_dir_name(1)).symlink_to(elsewhere / step_dir_name(1))
    st = fakes.store(directory, sess, keep_last=1)
    publish(st, 2)
    assert sorted(os.listdir(directory)) == ["latest", step_dir_name(2)]
    assert (elsewhere / step_dir_name(1) / MARKER).is_file()  # the target, marker included, stays


def test_the_sweep_removes_only_other_sessions_leftovers(tmp_path, sess):
    st = fakes.store(tmp_path, sess)
    publish(st, 1)
    dead = "00001234"  # a crashed run's session (the directory lock says no live run holds it)
    leftovers = [f"{step_dir_name(2)}.partial-{dead}", f"{step_dir_name(1)}.replaced-{dead}"]
    leftovers += [f"{step_dir_name(0)}.pruned-{dead}", REUSE]
    own = f"{step_dir_name(3)}.partial-{fakes.SESSION_ID}"  # this run's save in flight
    for name in (*leftovers, own, "notes"):
        (tmp_path / name).mkdir()
    st.remove_stale_partials()
    assert sorted(os.listdir(tmp_path)) == sorted(["latest", "notes", own, step_dir_name(1)])


def test_candidates_are_complete_checkpoints_newest_first_and_a_torn_newer_one_is_named(
    tmp_path, sess, caplog
):
    st = fakes.store(tmp_path, sess, keep_last=5)
    for step in (1, 2, 3):
        publish(st, step)
    (tmp_path / step_dir_name(4)).mkdir()  # torn: no marker
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        auto = st.candidates("auto")
    assert auto == [str(tmp_path / step_dir_name(s)) for s in (3, 2, 1)]
    assert f"skipping incomplete checkpoint {tmp_path / step_dir_name(4)}" in caplog.text
    # a path: itself, then the older ones beside it
    assert st.candidates(str(tmp_path / step_dir_name(2))) == [
        str(tmp_path / step_dir_name(s)) for s in (2, 1)
    ]


def test_the_ranking_metric_is_stored_only_when_kept_by_and_finite(tmp_path, sess, caplog):
    assert fakes.store(tmp_path, sess).ranking_metric({"val_loss": 1.0}, 5) == {}  # keep_best off
    st = fakes.store(tmp_path, sess, keep_best=1)
    assert st.ranking_metric({"val_loss": 0.25}, 5) == {"val_loss": 0.25}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert st.ranking_metric({}, 5) == {}
        assert st.ranking_metric({"val_loss": math.nan}, 6) == {}
    warnings = [r for r in caplog.records if "no finite value" in r.getMessage()]
    assert len(warnings) == 1 and "checkpoint.metric 'val_loss'" in warnings[0].getMessage()


def test_the_index_bound_refuses_a_larger_index_naming_the_setting(tmp_path, sess):
    st = fakes.store(tmp_path, sess, index_limit=1000)
    st.check_index_bound(str(tmp_path / step_dir_name(1)), 1000)  # at the bound: readable
    with pytest.raises(CheckpointIndexBoundError, match=r"checkpoint\.max_index_mb.*at least 0\.1") as e:
        st.check_index_bound(str(tmp_path / step_dir_name(1)), 1001)
    assert e.value.path.endswith(os.path.join(step_dir_name(1), ".metadata"))


def test_delete_tree_removes_a_link_never_its_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "data").write_text("someone else's")
    (tmp_path / "link").symlink_to(target)
    delete_tree(str(tmp_path / "link"))
    assert not (tmp_path / "link").exists() and (target / "data").read_text() == "someone else's"
    delete_tree(str(target))
    assert not target.exists()
    delete_tree(str(target))  # already gone: nothing to do
