"""The save in flight: starting it in the chosen :class:`AsyncMode`, staging (the copy to host
memory on the writer thread, and waiting for it), waiting until every rank's write is durable, and
publishing it through the store. Only one save is in flight at a time."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hookloop.engine import parallel
from hookloop.engine.checkpoint_format.directory import REUSE, step_dir_name
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.manifest import RecordingWriter
from hookloop.handlers.checkpoint import optim_layout
from hookloop.handlers.checkpoint.dcp_calls import (
    SavePlanner,
    copy_buffers,
    last_line,
    quiet_single_process,
    reraise_interrupt,
    trained_entries,
)
from hookloop.handlers.checkpoint.handler_tensors import HANDLERS
from hookloop.handlers.checkpoint.host_copy import HostCopy, stage_then_save
from hookloop.handlers.checkpoint.save import Save, all_of, done_future, write_rank_file
from hookloop.handlers.checkpoint.session import CheckpointSession
from hookloop.handlers.checkpoint.state_dicts import StateDicts
from hookloop.handlers.checkpoint.store import CheckpointStore
from hookloop.handlers.sections.checkpoint import AsyncMode

__all__ = ["CheckpointWriter", "Save"]

logger = logging.getLogger("hookloop.handlers.checkpoint")


class CheckpointWriter:
    """Starts, stages, waits for and publishes the save in flight (``inflight``, None when there
    is none).

    Args:
        directory: the checkpoint directory the save's partial directory goes in.
        mode: how the save runs beside training.
        session: the checkpoint process group, the session id and the writer and file threads.
        store: publishes a save once every rank's write is durable.
    """

    def __init__(
        self,
        directory: str,
        mode: AsyncMode,
        session: CheckpointSession,
        store: CheckpointStore,
        *,
        wait_timeout_s: float,
        long_wait: Callable[[], Any],
    ) -> None:
        self.directory = directory
        self.mode = mode
        self._session = session
        self._store = store
        self.wait_timeout_s = wait_timeout_s
        self._long_wait = long_wait
        self.inflight: Save | None = None
        self._state_slot: tuple[str, str, Future] | None = None  # a rank state JSON still to come
        #: DCP's stager, made at the first background save; its host buffers are reused.
        self.stager: Any = None
        self._own_stager: Any = None
        self._host_copy = HostCopy()  # mode="async": written live, copied only on demand
        self._state_dicts = StateDicts()  # get_state_dict's naming, learned once per layout
        #: the save in flight's publishing on the writer thread, once released (:meth:`release`):
        #: True once published, False when a hold deferred it
        self._publishing: Future | None = None

    @property
    def staging(self) -> bool:
        save = self.inflight
        return save is not None and save.staged is not None and not save.staged.done()

    @property
    def pending(self) -> bool:
        """This rank's save in flight is not yet durable, or its publishing (released) not over."""
        save = self.inflight
        if save is None:
            return False
        return not save.done.done() or (self._publishing is not None and not self._publishing.done())

    @property
    def released(self) -> bool:
        """The save in flight was handed to the writer thread to publish (:meth:`release`)."""
        return self._publishing is not None

    # ------------------------------------------------------------------------------ starting
    def start(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        extra: dict[str, Any] | None,
        metrics: dict[str, float],
        handler_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Start saving ``step`` (no save may be in flight): this rank's state JSON ``extra`` and
        the model, optimizer and ``handler_tensors`` (:mod:`.handler_tensors`) through DCP;
        ``metrics`` go into the marker. ``extra`` None: the state JSON comes later, through
        :meth:`write_state` (the save is not done before it)."""
        name = step_dir_name(step)
        partial = os.path.join(self.directory, f"{name}.partial-{self._session.id}")
        own_state = f"rank_{parallel.rank():05d}.json"
        try:
            os.makedirs(partial, exist_ok=True)
            if extra is None:
                rank_file: Future = Future()
                self._state_slot = (partial, own_state, rank_file)
            elif self.mode is AsyncMode.SYNC:
                with self._long_wait():
                    rank_file = done_future(write_rank_file(partial, own_state, extra))
            else:  # an fsync that training need not wait for: beside the DCP write
                rank_file = self._session.io_thread().submit(write_rank_file, partial, own_state, extra)
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoint for step {step} to {partial}: {e}; free space or fix permissions "
                f"of checkpoint.directory ({self.directory}); the previous checkpoint is untouched"
            ) from e
        model_sd, optim_sd = self._state_dicts.get(model, optimizer)
        optim_sd = optim_layout.compact(optim_sd)  # hyperparameters once per group of parameters
        checked = trained_entries(model_sd, optim_sd, model)  # finite or not: the writer says
        if self.mode is AsyncMode.ASYNC:  # staged later, while the next forward may change buffers
            model_sd = copy_buffers(model_sd, model)
        state_dict = {"model": model_sd, "optim": optim_sd}
        if handler_tensors:
            state_dict[HANDLERS] = handler_tensors
        # checksums the DCP files as it makes them durable, and checks the saved state for NaN/Inf
        reuse = os.path.join(self.directory, REUSE)  # a pruned checkpoint's files, written over
        # beside training (async modes), the pages of large tensors go to the disk directly: the
        # writer's copy into the page cache would take CPU from training
        direct = self.mode is not AsyncMode.SYNC
        writer = RecordingWriter(partial, parallel.rank(), checked=checked, reuse=reuse, direct=direct)
        group = self._session.group
        kwargs: dict[str, Any] = {
            "checkpoint_id": partial,
            "storage_writer": writer,
            "process_group": group,
            "no_dist": group is None,
        }
        staged: Future | None = None
        try:
            with quiet_single_process():
                if self.mode is AsyncMode.SYNC:
                    with self._long_wait():
                        dcp.save(state_dict, planner=SavePlanner(), **kwargs)
                    done = done_future()
                elif self.mode is AsyncMode.ASYNC_COPY:
                    done = dcp.async_save(state_dict, planner=SavePlanner(), **kwargs)
                else:  # written from the live state in the background: the call returns at once
                    staged = Future()
                    # a stager put in place of ours (tests hold the copy with one) copies all first
                    live = (
                        self._host_copy.begin(state_dict, staged) if self.stager is self._own_stager else None
                    )
                    if live is not None:
                        done = self._session.write_thread().submit(self._host_copy.save, live, kwargs)
                    else:
                        stage = self._get_stager().stage
                        done = self._session.write_thread().submit(
                            stage_then_save, stage, state_dict, staged, {**kwargs, "planner": SavePlanner()}
                        )
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if self._state_slot is not None:
                self._state_slot = None
            else:  # nothing may write into partial later; the error that matters is raised below
                with contextlib.suppress(Exception):
                    rank_file.result(timeout=self.wait_timeout_s)
            reraise_interrupt(e)
            raise CheckpointError(
                f"saving step {step} to {partial} failed: {last_line(e)}; free space or fix permissions of "
                f"checkpoint.directory ({self.directory}); the previous complete checkpoint and `latest` "
                "are unchanged"
            ) from e
        final = os.path.join(self.directory, name)
        done = all_of([done, rank_file])
        self.inflight = Save(
            step, partial, final, done, staged, writer=writer, rank_file=rank_file, metrics=dict(metrics)
        )

    @property
    def state_due(self) -> bool:
        """The save in flight waits for this rank's state JSON (:meth:`write_state`)."""
        return self._state_slot is not None

    def write_state(self, extra: dict[str, Any] | None) -> None:
        """Write the save in flight's rank state JSON ``extra`` (in the background unless
        ``mode="sync"``); None abandons the save: it fails, and nothing publishes it."""
        partial, name, future = self._state_slot
        self._state_slot = None
        if extra is None:
            future.set_exception(RuntimeError("the step ended before its state was captured"))
        elif self.mode is AsyncMode.SYNC:
            with self._long_wait():
                _fill(future, write_rank_file, partial, name, extra)
        else:
            self._session.io_thread().submit(_fill, future, write_rank_file, partial, name, extra)

    def _get_stager(self) -> Any:
        """DCP's stager, used on the writer thread only: it keeps the host buffers of the first save
        and copies into them at every later one (pinned with CUDA, for fast device-to-host copies)."""
        if self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self.stager = self._own_stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,  # it runs on our writer thread already
                    use_non_blocking_copy=cuda,
                )
            )
        return self.stager

    # ------------------------------------------------------------------------------ waiting
    def wait_staged(self) -> None:
        """Wait until the save in flight reads the live state no more: copied to host memory, or
        (``mode="async"``) written or copied now (nothing to wait for otherwise)."""
        save = self.inflight
        if save is None or save.staged is None or save.staged.done():
            return
        with self._long_wait():
            with contextlib.suppress(Exception):  # a failure is in ``staged``, reported just below
                self._host_copy.freeze(self.wait_timeout_s)  # copy what is not written yet
            self.result(save.staged, "staging")

    def release(self, unheld: Callable[[], Any]) -> None:
        """Training thread, at a step end at which every rank agreed its write is durable and no
        judge holds saves (on every rank alike): publish the save in flight on the writer thread
        (collective on the checkpoint group). ``unheld``: the save policy's, checked again as rank
        0 makes the checkpoint visible, so a hold that comes meanwhile still keeps it unpublished.
        :meth:`collect` takes the outcome once every rank's publishing is over."""
        save = self.inflight
        self._publishing = self._session.write_thread().submit(self._publish, save, False, unheld)

    def collect(self) -> Save | None:
        """The released save's publishing, over on every rank (their agreement said so): the save
        once published (no save is in flight any more), None when a hold deferred it (it stays in
        flight, durable, to be released again). A failure is a :class:`CheckpointError`, on every
        rank alike."""
        publishing, self._publishing = self._publishing, None
        try:
            published = self.result(publishing, "publishing")
        except BaseException:
            self.inflight = None
            raise
        if not published:
            return None
        save, self.inflight = self.inflight, None
        return save

    def finish(self, wait: bool) -> Save:
        """Publish the save in flight once every rank's write is durable (collective), whatever the
        save policy says (a drain); the save, published. ``wait=False``: every rank reported its
        save done, nothing to wait for. A publishing released earlier is waited for first."""
        save = self.inflight
        publishing, self._publishing = self._publishing, None
        try:
            if publishing is not None:
                with self._long_wait():
                    published = self.result(publishing, "publishing")
                if published:
                    return save
            self._publish(save, wait, None)
            return save
        finally:
            self.inflight = None

    def _publish(self, save: Save, wait: bool, unheld: Callable[[], Any] | None) -> bool:
        """Publish ``save`` once every rank's write is durable (collective on the checkpoint group):
        True once published; False when ``unheld`` (None: publish whatever the policy says) found
        saves held as rank 0 was about to make it visible. On the training thread (a drain, or
        ``mode="sync"``) or on the writer thread (:meth:`release`, ``unheld`` given)."""
        # the progress watchdog watches the training thread: only its waits lift it
        long_wait = contextlib.nullcontext if unheld is not None else self._long_wait
        error: BaseException | None = None
        entries: dict[str, Any] = {}
        try:
            if wait:
                with long_wait():
                    save.done.result(timeout=self.wait_timeout_s)
            else:
                save.done.result(timeout=0)
            entries = save.entries
        except FutureTimeout:
            error = TimeoutError(f"not durable within {self.wait_timeout_s:.0f}s (wait_timeout_s)")
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            reraise_interrupt(e)
            error = e
        failed = self._session.agree_failed(error is not None)
        if failed:
            where = f": {last_line(error)}" if error is not None else " on another rank"
            raise CheckpointError(
                f"writing the checkpoint of step {save.step} to {save.partial} failed{where}; the previous "
                f"complete checkpoint and `latest` are unchanged; free space or fix permissions of "
                f"checkpoint.directory ({self.directory})"
            ) from error
        files, finite = self._collect_entries(entries, save.finite if error is None else None)
        outcome: bool | None = True
        index = 0  # the size of the index rank 0 published, agreed below
        if parallel.rank() == 0:
            try:
                with long_wait():  # file system work only: marker, renames, fsyncs, pruning
                    outcome = self._store.publish(
                        save.step,
                        save.partial,
                        save.final,
                        mode=self.mode.value,
                        metrics=save.metrics,
                        files=files,
                        finite=finite,
                        unheld=unheld,
                    )
            except Exception:  # every rank must hear the outcome: a failure here is one too
                logger.exception("could not publish checkpoint %s", save.final)
                outcome = False
            index = files.get(".metadata", {}).get("size", 0) if outcome else 0
        held = outcome is None
        ok = outcome is not False
        if parallel.world_size() > 1:
            failed, held, index = self._session.agree_max([int(not ok), int(held), index])
            ok, held = not failed, bool(held)
        save.index_size = index
        if not ok:
            raise CheckpointError(
                f"publishing the checkpoint of step {save.step} at {save.final} failed (see the error "
                f"logged by rank 0); the previous complete checkpoint and `latest` are unchanged"
            )
        return not held

    def _collect_entries(
        self, entries: dict[str, Any], finite: bool | None
    ) -> tuple[dict[str, Any] | None, bool | None]:
        """Rank 0 gets every rank's manifest entries and whether all ranks' saved state is finite
        (None: a rank could not tell) in one gather on the checkpoint group, which no write uses any
        more (every rank's save is done); the other ranks get ``(None, None)``."""
        group = self._session.group
        if group is None:
            return dict(entries), finite
        parts: list[Any] | None = [None] * parallel.world_size() if parallel.rank() == 0 else None
        dist.gather_object((entries, finite), parts, dst=0, group=group)
        if parts is None:
            return None, None
        merged: dict[str, Any] = {}
        for part, _ in parts:
            merged.update(part)
        verdicts = [verdict for _, verdict in parts]
        return merged, (None if None in verdicts else all(verdicts))

    def wait_local(self) -> bool:
        """Wait for this rank's own write only (no collective: a peer may be gone). True when the
        save is durable and this is the only rank: :meth:`finish` (``wait=False``) publishes it."""
        save = self.inflight
        if save is None:
            return False
        try:
            with self._long_wait():
                save.done.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            logger.error(
                "checkpoint of step %d did not finish writing within %.0fs", save.step, self.wait_timeout_s
            )
            return False
        except BaseException as e:  # noqa: BLE001 - already failing; report and go on
            logger.error("checkpoint of step %d failed: %r", save.step, e)
            self.inflight = None
            return False
        if parallel.world_size() == 1:  # no peer to agree with: this save is complete
            return True
        self.inflight = None
        logger.warning(
            "checkpoint of step %d stays incomplete (%s): the ranks could not agree it finished",
            save.step,
            save.partial,
        )
        return False

    def result(self, future: Future, what: str) -> Any:
        try:
            return future.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"checkpoint {what} did not finish within {self.wait_timeout_s:.0f}s (wait_timeout_s)"
            ) from None
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            reraise_interrupt(e)
            raise CheckpointError(
                f"checkpoint {what} failed: {last_line(e)}; free space or fix permissions of "
                f"checkpoint.directory ({self.directory})"
            ) from e

    def close(self) -> None:
        """Release the stager's host buffers (no save may be in flight)."""
        if self.stager is not None:
            self.stager.close()
            self.stager = self._own_stager = None
        self._host_copy.close()
        self._state_dicts = StateDicts()


def _fill(future: Future, fn: Callable[..., Any], *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - the save's owner reports it when it finishes the save
        future.set_exception(e)
