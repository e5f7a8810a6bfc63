"""The checkpoint directory as the checkpointer keeps it: publishing a durable save (marker with
the manifest, rename to ``step_N``, ``latest``), pruning what ``keep_last`` / ``keep_best`` no
longer keep (never ``latest`` nor the newest known-good checkpoint), the metric that ranks
checkpoints, listing the candidates to load, and clearing what a crashed run left behind."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.checkpoint_format.directory import (
    MARKER,
    REUSE,
    complete_checkpoints,
    parse_step,
    read_json,
    read_latest,
    write_json_atomic,
    write_latest,
)
from hookloop.engine.checkpoint_format.errors import CheckpointError, CheckpointIndexBoundError
from hookloop.engine.checkpoint_format.manifest import make_manifest, read_marker
from hookloop.engine.record_file import flush_open
from hookloop.handlers.checkpoint.session import CheckpointSession

__all__ = ["CheckpointStore", "delete_tree", "not_finite", "ranked_by_metric"]

logger = logging.getLogger("hookloop.handlers.checkpoint")


class CheckpointStore:
    """Rank 0's side of the directory (publish, prune, list), plus the ranking metric every rank
    stores with its save.

    Args:
        directory: the checkpoint directory (exists and is writable).
        session: names this run's partial, replaced and pruned directories; its file thread deletes
            pruned checkpoints.
        keep_last, keep_best, metric, metric_mode: what pruning keeps (see the checkpointer).
        index_limit: the largest index a resume reads, in bytes (see :meth:`check_index_bound`).
        wait_timeout_s: the longest a wait for a deletion may take before it is left to finish.
        known_good: the newest step a detector trusts (None: none), read when pruning.
    """

    def __init__(
        self,
        directory: str,
        session: CheckpointSession,
        *,
        keep_last: int,
        keep_best: int,
        metric: str,
        metric_mode: str,
        index_limit: int,
        wait_timeout_s: float,
        long_wait: Callable[[], Any],
        known_good: Callable[[], int | None],
    ) -> None:
        self.directory = directory
        self._session = session
        self.keep_last, self.keep_best = keep_last, keep_best
        self.metric, self.metric_mode = metric, metric_mode
        self.index_limit = index_limit
        self.wait_timeout_s = wait_timeout_s
        self._long_wait = long_wait
        self._known_good = known_good
        self._metric_missing_warned = False
        self._pruning: Future | None = None

    # ------------------------------------------------------------------------------ publishing
    def publish(
        self,
        step: int,
        partial: str,
        final: str,
        *,
        mode: str,
        metrics: dict[str, float],
        files: dict[str, Any],
        finite: bool | None = None,
        unheld: Callable[[], Any] | None = None,
    ) -> bool | None:
        """Rank 0: marker (with the manifest of every rank's files and whether the saved parameters
        and optimizer state are finite), rename to ``step_N``, move ``latest``, prune. Every rank's
        data is durable and checksummed. False (logged) when the file system refused. ``unheld``
        (the save policy's :meth:`~engine.save_policy.SavePolicy.unheld`, when publishing off the
        training thread): the renames and ``latest`` happen inside it, and only if no judge holds
        saves; None when one did (nothing visible changed; the save stays ``partial``)."""
        try:
            marker = {
                "step": step,
                "world_size": parallel.world_size(),
                "mode": mode,
                "time": time.time(),
                "metrics": metrics,
                "manifest": make_manifest(files),
            }
            if finite is not None:
                marker["finite"] = finite
            flush_open()  # the run's records so far reach their files before anyone can resume from here
            # Every file is fsynced by its writer; the marker's fsync of ``partial`` makes their
            # names durable with its own, before the rename can show the checkpoint to anyone.
            write_json_atomic(os.path.join(partial, MARKER), marker)
            trash = None
            with unheld() if unheld is not None else contextlib.nullcontext(True) as allowed:
                if not allowed:
                    logger.info("checkpoint of step %d waits: saves are held", step)
                    return None
                if os.path.lexists(final):  # an older checkpoint of this step (e.g. before a rollback)
                    trash = f"{final}.replaced-{self._session.id}"
                    os.replace(final, trash)
                os.replace(partial, final)
                # ``latest``'s own directory fsync makes this rename durable with its own (one fsync)
                write_latest(self.directory, os.path.basename(final))
            if trash is not None:
                delete_tree(trash)
        except OSError as e:
            logger.error("could not publish checkpoint %s: %s", final, e)
            return False
        logger.info("checkpoint of step %d is complete: %s", step, final)
        try:
            self.prune()
        except OSError as e:  # the new checkpoint is complete; old ones stay until the next save
            logger.warning("could not prune old checkpoints in %s (training goes on): %s", self.directory, e)
        return True

    def check_index_bound(self, final: str, size: int) -> None:
        """A published checkpoint whose index has ``size`` bytes, more than ``index_limit``: no
        resume or rollback could read it, so the run stops here with the setting to change
        (CheckpointIndexBoundError, a config error: exit 2). The checkpoint is complete; a run with
        the new value resumes from it."""
        if size > self.index_limit:
            raise CheckpointIndexBoundError(
                os.path.join(final, ".metadata"),
                size,
                self.index_limit,
                "and run again: this checkpoint is complete and the run resumes from it (the run "
                "stops at this save, since no resume or rollback could read it)",
            )

    # ------------------------------------------------------------------------------ pruning
    def prune(self) -> None:
        """Rank 0: delete the checkpoints ``keep_last`` no longer keeps. Each is made incomplete
        (marker removed) and renamed out of the listing here; the files go on a background thread,
        since unlinking hundreds of MB would block training about as long as a save's copy. Nothing
        outside the checkpoint directory is touched: a step directory that is a symbolic link
        loses the link only (its target, marker included, stays as it was)."""
        self.wait_pruned()
        complete, torn = complete_checkpoints(self.directory)
        newest = complete[0][0] if complete else -1
        doomed: list[str] = []
        for path in torn:  # left by a deletion that a crash interrupted (a save in flight is .partial)
            step = parse_step(os.path.basename(path))
            if step is not None and step < newest:
                doomed.append(path)
        keep = {path for _, path in complete[: self.keep_last]}
        if self.keep_best:
            keep.update(ranked_by_metric(complete, self.metric, self.metric_mode)[: self.keep_best])
        latest = read_latest(self.directory)
        if latest:
            keep.add(os.path.join(self.directory, latest))
        good = self._known_good()
        if good is not None:  # a rollback may need it: never prune the newest known-good checkpoint
            known_good = next(
                (path for step, path in complete if step <= good and not not_finite(path)), None
            )
            if known_good is not None:
                keep.add(known_good)
        for _, path in complete[self.keep_last :]:
            if path in keep:
                continue
            if os.path.islink(path):  # a link to a checkpoint elsewhere: only the link goes
                doomed.append(path)
                continue
            try:
                os.remove(os.path.join(path, MARKER))  # incomplete first, so a reader never loads it
            except OSError as e:
                logger.warning("could not delete old checkpoint %s (training goes on): %s", path, e)
                continue
            doomed.append(path)
        trash = []
        for path in doomed:
            target = f"{path}.pruned-{self._session.id}"
            try:
                os.replace(path, target)
            except OSError as e:
                logger.warning("could not delete old checkpoint %s (training goes on): %s", path, e)
                continue
            trash.append(target)
        if trash and not os.path.islink(trash[0]):
            self._keep_for_reuse(trash[0])
        if trash:
            self._pruning = self._session.io_thread().submit(_delete_trees, trash)

    def _keep_for_reuse(self, tree: str) -> None:
        """Move the DCP data files of pruned checkpoint ``tree`` into :data:`REUSE`, for the next save
        to write over (what an earlier prune left there goes with ``tree``). The disk holds no
        more at its peak than without: the next save's files are these."""
        reuse = os.path.join(self.directory, REUSE)
        try:
            if os.path.islink(reuse) or (os.path.exists(reuse) and not os.path.isdir(reuse)):
                return  # not ours: leave it
            os.makedirs(reuse, exist_ok=True)
            for name in os.listdir(reuse):
                os.replace(os.path.join(reuse, name), os.path.join(tree, f"{name}.unused"))
            for name in os.listdir(tree):
                path = os.path.join(tree, name)
                if name.endswith(".distcp") and os.path.isfile(path) and not os.path.islink(path):
                    os.replace(path, os.path.join(reuse, name))
        except OSError as e:  # the next save makes new files
            logger.debug("could not keep %s's files for the next save: %s", tree, e)

    def remove_reused(self) -> None:
        """Delete what :data:`REUSE` holds (the end of a run: the directory keeps its checkpoints only)."""
        delete_tree(os.path.join(self.directory, REUSE))

    def wait_pruned(self) -> None:
        """Wait (locally, at most ``wait_timeout_s``) until the old checkpoints the last publish
        pruned are deleted; a deletion still running then is logged and left to finish."""
        pruning, self._pruning = self._pruning, None
        if pruning is None:
            return
        try:
            with self._long_wait():
                pruning.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            logger.warning(
                "deleting old checkpoints in %s takes longer than %.0fs (wait_timeout_s); it goes on "
                "in the background",
                self.directory,
                self.wait_timeout_s,
            )

    def ranking_metric(self, metrics: dict[str, Any], iteration: int) -> dict[str, float]:
        """``{metric: value}`` to store with the save being started ({} when keep_best is off or
        the run has no finite value of the metric yet)."""
        if not self.keep_best:
            return {}
        value = metrics.get(self.metric)
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            if not self._metric_missing_warned and iteration > 0:
                self._metric_missing_warned = True
                logger.warning(
                    "checkpoint.metric %r has no finite value in state.metrics at step %d: checkpoints "
                    "saved without it are kept by keep_last only (validate on checkpoint steps, or pick "
                    "a metric the run publishes)",
                    self.metric,
                    iteration,
                )
            return {}
        return {self.metric: value}

    def candidates(self, which: str) -> list[str]:
        """Rank 0: the checkpoints to try, newest first (see :meth:`CheckpointReader.agreed_checkpoint`)."""
        if which != "auto":
            step = parse_step(os.path.basename(which))
            parent = os.path.dirname(which)
            older = [path for s, path in complete_checkpoints(parent)[0] if step is not None and s < step]
            return [which, *older]
        complete, torn = complete_checkpoints(self.directory)
        newest = complete[0][0] if complete else -1
        for path in torn:
            step_of = parse_step(os.path.basename(path))
            if step_of is not None and step_of > newest:
                logger.warning("skipping incomplete checkpoint %s (no %s marker)", path, MARKER)
        return [path for _, path in complete]

    def remove_stale_partials(self) -> None:
        for name in os.listdir(self.directory):
            if name == REUSE:
                self.remove_reused()
            elif ".partial-" in name or ".replaced-" in name or ".pruned-" in name:
                if name.endswith(f"-{self._session.id}"):
                    continue
                delete_tree(os.path.join(self.directory, name))


def ranked_by_metric(complete: list[tuple[int, str]], metric: str, metric_mode: str) -> list[str]:
    """The checkpoints of ``complete`` (``(step, path)``) that record a finite ``metric`` in their
    markers, best first. Ties go to the older checkpoint: a value carried over from an earlier
    validation belongs to it."""
    ranked = []
    for step, path in complete:
        try:
            value = read_json(os.path.join(path, MARKER)).get("metrics", {}).get(metric)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            ranked.append((value if metric_mode == "min" else -value, step, path))
    return [path for _, _, path in sorted(ranked)]


def _delete_trees(paths: list[str]) -> None:
    for path in paths:
        delete_tree(path)


def delete_tree(path: str) -> None:
    """Delete ``path`` (inside the checkpoint directory) and nothing outside it: a symbolic link is
    removed itself, never followed (a linked step directory's target belongs to someone else), and
    links inside a directory are removed as links."""
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def not_finite(path: str) -> bool:
    """Whether checkpoint ``path``'s marker records NaN/Inf in its saved parameters or optimizer
    state (markers of earlier versions record nothing: they count as finite)."""
    try:
        return read_marker(path).get("finite", True) is False
    except CheckpointError:
        return False  # verification reports the damaged marker
