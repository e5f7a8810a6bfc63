"""The checkpointer handler: when to save, resume and roll back, wired to the trainer's events.
The work is the rooms': :mod:`.writer` (the save in flight), :mod:`.store` (the directory),
:mod:`.reader` (choosing and loading), :mod:`.rank_state` (the per-rank state JSON)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.exit_status import nothing_left_to_train
from hookloop.engine.files import check_writable_dir
from hookloop.engine.handler import Handler, checked_settings, section_settings
from hookloop.handlers.checkpoint import handler_tensors
from hookloop.handlers.checkpoint.rank_state import RankState
from hookloop.handlers.checkpoint.reader import CheckpointReader, resolve_checkpoint_setting
from hookloop.handlers.checkpoint.resume_settings import Recorded, ResumeSettings
from hookloop.handlers.checkpoint.session import CheckpointSession
from hookloop.handlers.checkpoint.store import CheckpointStore
from hookloop.handlers.checkpoint.writer import CheckpointWriter
from hookloop.handlers.sections.checkpoint import AsyncMode, CheckpointConfig

__all__ = ["CAPTURE", "CHECKPOINT", "RESUME", "STAGING_WAIT", "AsyncCheckpointer"]

logger = logging.getLogger("hookloop.handlers.checkpoint")

_RESUMABLE_EXIT_CODES = (int(ExitCode.SUCCESS), int(ExitCode.STOPPED))

# Where the checkpointer runs, relative to the phases of an event (engine.Priority).
#: TRAIN_START and ROLLBACK: restore; RUN_STARTED: clear a dead run's leftovers, the initial save;
#: STEP_START: reset the save timer; TRAIN_END / TRAIN_FAILED: the last save and the drain.
#: Handlers after it see the restored step.
RESUME = Priority.RESTORE
#: STEP_END: save when asked, the first act, once the step's metrics and validation are in.
CHECKPOINT = Priority.ACT
#: STEP_END: this rank's state (handlers, counters, RNG, data position) for the save started at
#: CHECKPOINT, taken once every handler of the step has run, so it holds what they did at this step.
CAPTURE = Priority.CLEANUP
#: BEFORE_OPTIMIZER_STEP: wait until staging is done, after every handler that may veto the step and
#: right before the optimizer changes the parameters being staged.
STAGING_WAIT = Priority.CLEANUP


class AsyncCheckpointer(Handler):
    """Save sharded checkpoints (in the background by default), resume exactly, answer ROLLBACK.
    When it saves: see :mod:`hookloop.handlers.checkpoint` (it counts no steps).

    Args:
        directory: where the ``step_N`` checkpoint directories and the ``latest`` pointer live.
        keep_last: complete checkpoints to keep; older ones are deleted after a new one is durable.
        keep_best: also keep the best this many checkpoints by ``metric`` (0: off). A checkpoint
            stays if it is among the last ``keep_last`` *or* the best ``keep_best``; ``latest`` and
            the newest known-good one (a NaN rollback may need it) are never pruned either.
        metric: the ``state.metrics`` entry ranking checkpoints, read when a save starts (at
            STEP_END, after validation) and stored in the checkpoint's completion marker, so the
            ranking survives restarts. A checkpoint saved without it is kept by ``keep_last`` only.
        metric_mode: ``"min"`` (lower is better, e.g. ``val_loss``) or ``"max"`` (higher is better, e.g.
            ``val_accuracy`` of a ``validation.metrics`` entry named ``accuracy``).
        mode: ``"async"`` (the default: training waits only for what must not change mid-copy),
            ``"async_copy"`` or ``"sync"`` (see the module docstring); ``"async_staged"`` is an old
            name of ``"async"``.
        resume: ``"auto"`` (the newest complete checkpoint in ``directory``, or a fresh start when
            there is none), a checkpoint directory path (must exist and be complete; a directory
            holding ``step_N`` checkpoints means its newest intact one), or None.
        load_optimizer: restore the optimizer state too (False: model, counters and the rest only).
        finetune_from: a checkpoint whose model weights are loaded at the start of a fresh run
            (step 0), or a directory of checkpoints (its newest intact one); used only when
            ``resume`` finds nothing to resume from.
        wait_timeout_s: the longest any local wait for a save may take before it is an error.
        max_index_mb: the largest DCP index (``.metadata``) a resume or rollback reads, in MiB
            (reading it is bounded, linear in its size). A save whose index is larger stops the run
            once published, and a resume that meets one refuses: both a config error (exit 2)
            naming the value to set, never damage.

    Public surface (what a user or another handler may call): :meth:`wait` (drain the save in
    flight), :meth:`restore_latest` (roll back to the newest intact finite checkpoint),
    :meth:`record_settings` (settings of the run a checkpoint records and a resume checks),
    :meth:`load_resume`, :meth:`close`, the properties :attr:`saving` and :attr:`staging`, and the
    read-only attributes ``directory``, ``mode``, ``last_saved_step``, ``last_checkpoint`` and
    ``resumed_from``. Everything else is private: the events drive it.
    """

    Config = CheckpointConfig
    section = "checkpoint"
    doc = "docs/checkpoint.md"  # its page (a shipped handler: handlers/declarations.py)

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int = 3,
        keep_best: int = 0,
        metric: str = "val_loss",
        metric_mode: str = "min",
        mode: str = "async",
        resume: str | os.PathLike | None = "auto",
        load_optimizer: bool = True,
        finetune_from: str | os.PathLike | None = None,
        wait_timeout_s: float = 600.0,
        max_index_mb: float = 8.0,
    ) -> None:
        if directory is None or str(directory) == "":
            raise ConfigError("checkpoint.directory", "is required: the directory checkpoints are written to")
        # the section's rules, the only copy (errors name the dotted key, e.g. checkpoint.keep_last)
        checked_settings(CheckpointConfig, {**locals(), "directory": os.fspath(directory)}, "checkpoint")
        self.directory = os.path.abspath(directory)
        self.mode = AsyncMode.parse(mode).value
        self.load_optimizer = load_optimizer
        index_limit = int(max_index_mb * 2**20)
        self.resume = None if resume is None else ("auto" if resume == "auto" else os.path.abspath(resume))
        self.finetune_from = None if finetune_from is None else os.path.abspath(finetune_from)
        # created once the run has started: a refused start leaves no directory behind
        check_writable_dir("checkpoint.directory", self.directory)
        if self.resume not in (None, "auto"):
            resolve_checkpoint_setting(self.resume, "checkpoint.resume")
        if self.finetune_from is not None:
            resolve_checkpoint_setting(self.finetune_from, "checkpoint.finetune_from")

        self.last_saved_step: int | None = None
        self.resumed_from: str | None = None
        self.last_checkpoint: str | None = None
        self._pending_ranks = 0  # ranks whose save in flight was not yet durable at this step's agreement
        self._started = False
        self._initial_save_due = False
        self._requested_by: list[str] = []  # who asked for the save in flight
        # The rooms, each given what it works with.
        self._session = CheckpointSession()
        self._store = CheckpointStore(
            self.directory,
            self._session,
            keep_last=keep_last,
            keep_best=keep_best,
            metric=metric,
            metric_mode=metric_mode,
            index_limit=index_limit,
            wait_timeout_s=wait_timeout_s,
            long_wait=self._long_wait,
            known_good=self._known_good_step,
        )
        self._writer = CheckpointWriter(
            self.directory,
            AsyncMode(self.mode),
            self._session,
            self._store,
            wait_timeout_s=wait_timeout_s,
            long_wait=self._long_wait,
        )
        self._reader = CheckpointReader(
            self._store, self._session, index_limit=index_limit, long_wait=self._long_wait
        )
        self._settings = ResumeSettings(self._session)
        self._state: RankState | None = None  # once attached: it works on the trainer

    @classmethod
    def from_config(
        cls, cfg: CheckpointConfig, *, run_dir: str | os.PathLike | None = None
    ) -> AsyncCheckpointer | None:
        """Build from the ``checkpoint`` section, or None when ``cfg.enabled`` is false. A null
        ``directory`` means ``<run_dir>/checkpoints``."""
        if not cfg.enabled:
            return None
        directory = cfg.directory
        if directory is None:
            if run_dir is None:
                raise ConfigError("checkpoint.directory", "is null and no run_dir was given: set one of them")
            directory = os.path.join(run_dir, "checkpoints")
        return cls(**{**section_settings(cfg), "directory": directory})

    # ------------------------------------------------------------------------------ attaching
    def attach(self, trainer: Any) -> AsyncCheckpointer:
        if self.trainer is not None:
            raise RuntimeError(
                "this AsyncCheckpointer is already attached to a trainer; build one per trainer"
            )
        if trainer.get_handler(AsyncCheckpointer) is not None:
            raise RuntimeError("the trainer already has a checkpointer attached; attach only one")
        self._state = RankState(
            trainer,
            self._reader,
            self._settings,
            load_optimizer=self.load_optimizer,
            long_wait=self._long_wait,
        )
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=RESUME)
        trainer.add_event_handler(Events.RUN_STARTED, self._on_run_started, priority=RESUME)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=RESUME)
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, self._wait_staged, priority=STAGING_WAIT)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=CHECKPOINT)
        trainer.add_event_handler(Events.STEP_END, self._capture_due, priority=CAPTURE)
        # whether every rank's save in flight is durable travels in the trainer's step agreement
        trainer.agreement.add("checkpoint.pending", lambda: self._writer.pending, self._on_pending_agreed)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=RESUME)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_exception, priority=RESUME)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback, priority=RESUME)
        return super().attach(trainer)

    # ------------------------------------------------------------------------------ events
    def _on_train_start(self) -> None:
        if not self._session.is_open:  # once: the checkpoint group and this run's session id
            self._session.open()
        self._session.hold(self, self.directory)  # one run writes a checkpoint directory at a time
        if self._started:  # a later run() in this process continues; it does not reload
            return
        self._started = True
        if self.resume is not None and (path := self.load_resume()) is not None:
            max_steps, step = self.trainer.plan.limits[0], self.trainer.state.iteration
            if max_steps is not None and step >= max_steps:
                # the trainer says the reason once, as it stops ("stopping after step N: ...")
                self.trainer.control.request_stop(nothing_left_to_train(path, step, max_steps))
            return
        if self.finetune_from is not None:
            path = self._reader.agreed_checkpoint(self.finetune_from, "checkpoint.finetune_from")
            if path is not None:
                self._reader.load_weights(self.trainer.model, path)
        # A rollback before the first regular save (the save policy says) needs the initial state.
        self._initial_save_due = self.trainer.save_policy.initial_save_due(self.trainer.state.iteration)

    def load_resume(self) -> str | None:
        """TRAIN_START's resume (``hookloop check`` tries it): the checkpoint loaded, or None."""
        path = self._reader.agreed_checkpoint(self.resume, check=self._state.check)
        if path is not None:
            self._load(path, rollback=False)
            self.trainer.state.last_checkpoint = path
        return path

    def _on_run_started(self) -> None:
        """The run has started (every rank agreed): only now is the directory written, so a refused
        start leaves it as it was. Under this run's lock, no partial save is a live run's."""
        os.makedirs(self.directory, exist_ok=True)
        if parallel.rank() == 0:
            self._store.remove_stale_partials()
        self._state.say_resumed()
        if self._initial_save_due:
            self._initial_save_due = False
            self._start_save(0, by=["save policy: initial state"])

    def _on_step_start(self) -> None:
        self._capture_due()  # a step that ended on a handled error skipped CAPTURE
        self.trainer.state.times["checkpoint"] = 0.0

    def _wait_staged(self) -> None:
        """The staging-wait contract: the optimizer must not change what is still being copied."""
        if not self._writer.staging:
            return
        start = time.perf_counter()
        self._writer.wait_staged()
        self._add_blocked(time.perf_counter() - start)

    def _on_step_end(self) -> None:
        start = time.perf_counter()
        state = self.trainer.state
        control = self.trainer.control
        decided = control.decided  # agreed by every rank in this step's one all-reduce
        step = state.iteration
        by = [*(decided.save_by or ("another rank",))] if decided.save else []
        if self.trainer.plan.is_last_step and "last step" not in by:
            by.append("last step")
        if decided.stop and decided.exit_code in _RESUMABLE_EXIT_CODES:
            by.append(f"stop: {control.stop_reason}")
        want = bool(by) and step != self.last_saved_step
        writer = self._writer
        all_done = not self._pending_ranks  # every rank's write durable, its publishing (released) over
        if writer.released and all_done and (save := writer.collect()) is not None:
            self._saved(save)  # published on the writer thread (or a hold deferred it: released again below)
        hand_over = writer.inflight is not None and (want or (all_done and not writer.released))
        # a judge distrusts this state: no save, no publish (asked only when saving or publishing:
        # a judge whose verdicts are still on the device reads them then, engine.save_policy)
        hold = (want or hand_over) and self.trainer.save_policy.saves_held
        want = want and not hold
        if hand_over and not hold:
            if want:  # a new save: this one is drained first
                self._finish(wait=True)
            elif self.mode == AsyncMode.SYNC:
                self._finish(wait=False)
            else:  # published on the writer thread; a hold that comes first still stops it
                writer.release(self.trainer.save_policy.unheld)
                self._pending_ranks = parallel.world_size()  # until the next agreement says
        if want:
            self._start_save(step, capture=False, by=by)  # the rank state once the step's handlers ran
        self._add_blocked(time.perf_counter() - start)

    def _capture_due(self) -> None:
        """The save started at this step's CHECKPOINT gets this rank's state, now that every
        handler of the step has run; in ``mode="sync"`` it is then published."""
        if not self._writer.state_due:
            return
        self._writer.write_state(self._capture(self._writer.inflight.step))
        if self.mode == AsyncMode.SYNC:
            self._finish(wait=False)

    def _on_pending_agreed(self, ranks: float) -> None:
        self._pending_ranks = int(ranks)

    def _on_train_end(self) -> None:
        state = self.trainer.state
        resumable = self.trainer.control.exit_code in _RESUMABLE_EXIT_CODES
        if resumable and state.iteration > 0 and state.iteration != self.last_saved_step:
            # data ran out, or the stop came after the step's agreement: publish the save in
            # flight first, then save this step
            self.wait()
            self._start_save(state.iteration, by=["end of run"])
        if resumable:
            self.wait()
        else:
            self._wait_local()
        if parallel.rank() == 0:
            self._store.remove_reused()
        self._release_lock()

    def _on_exception(self, _error: BaseException) -> None:
        if self._writer.state_due:  # the step failed after its save started: its state as it is
            try:
                extra = self._state.capture(self._writer.inflight.step)
            except Exception:  # noqa: BLE001 - already failing: then the save is never published
                extra = None
            self._writer.write_state(extra)
        self._wait_local()
        self._release_lock()

    def _on_rollback(self) -> None:
        rollback = self.trainer.control.rollback  # None: nobody said; the newest, data position too
        if rollback is None:
            self.restore_latest()
        else:
            self.restore_latest(rollback.keep_data_position, rollback.at_or_before)

    def _known_good_step(self) -> int | None:
        """The newest step the save policy protects: pruning never deletes its checkpoint."""
        return self.trainer.save_policy.protected_step if self.trainer is not None else None

    # ------------------------------------------------------------------------------ public
    @property
    def saving(self) -> bool:
        """A save was started and is not yet published as a complete checkpoint."""
        return self._writer.inflight is not None

    @property
    def staging(self) -> bool:
        """The save in flight still reads the live state (``mode="async"``): the next
        optimizer step, load, rollback, save or drain waits until it does no more."""
        return self._writer.staging

    def wait(self) -> None:
        """Drain the save in flight: wait until it is durable on every rank, then publish it
        (marker, ``latest``, pruning, CHECKPOINT_SAVED). Collective: call it on every rank."""
        if self._writer.inflight is not None:
            self._finish(wait=True)
        self._store.wait_pruned()

    def restore_latest(self, keep_data_position: bool = False, at_or_before: int | None = None) -> int:
        """Restore the newest intact complete checkpoint whose saved parameters and optimizer state
        are finite (at or before step ``at_or_before``, when given) into the running trainer (model,
        optimizer, LR scheduler, counters, stateful handlers unless their ``restore_on_rollback`` is
        False, RNG) and return its step; damaged newer ones are skipped with a warning.
        ``keep_data_position``: the data continues from where it is now instead of going back.
        Collective: every rank calls it (ROLLBACK is agreed)."""
        self.wait()
        path = self._reader.agreed_checkpoint(
            "auto", at_or_before=at_or_before, finite_only=True, check=self._state.check
        )
        if path is None:
            limit = "" if at_or_before is None else f" at or before step {at_or_before}"
            raise CheckpointError(
                f"no complete checkpoint{limit} with finite weights in {self.directory} to roll back to"
            )
        self._load(path, rollback=True, keep_data_position=keep_data_position)
        return self.trainer.state.iteration

    def record_settings(self, settings: dict[str, Recorded]) -> None:
        """Record ``settings`` (dotted config field -> :class:`Recorded`) in every checkpoint, as
        the optimizer's and LR schedule's are; a resume says each change or refuses it by name
        (docs/checkpoint.md, "Changing settings on resume")."""
        self._settings.record(settings)

    def close(self) -> None:
        """Drain the save in flight and release the checkpoint process group and stager."""
        self.wait()
        self._session.close_threads()
        self._writer.close()
        self._session.close()  # a later run() sets it up again
        self._release_lock()

    # ------------------------------------------------------------------------------ private
    def _long_wait(self) -> Any:
        """Lift the trainer's progress watchdog around a *local* wait that is long by nature and
        bounded by its own timeout (``wait_timeout_s``, the process group's timeout): a write still
        on disk, verifying or publishing on slow storage, staging. The collectives around such a
        wait stay under the watchdog's bound; a peer waiting in one of them meanwhile sees this
        rank's heartbeat (:class:`engine.watchdog.PeerHeartbeats`), so slow is not taken for hung,
        while a stopped peer still ends the run with 77 within the bound."""
        watchdog = getattr(self.trainer, "watchdog", None) if self.trainer is not None else None
        return watchdog.suspended() if watchdog is not None else contextlib.nullcontext()

    def _capture(self, step: int) -> dict[str, Any]:
        try:
            return {**self._state.capture(step), "requested_by": list(self._requested_by)}
        except Exception as e:  # e.g. a handler's state_dict() holds something JSON cannot carry
            raise CheckpointError(f"cannot save step {step}: {type(e).__name__}: {e}") from e

    def _start_save(self, step: int, capture: bool = True, *, by: list[str]) -> None:
        if self._writer.inflight is not None:  # one save in flight: its staging buffers are reused
            self._finish(wait=True)
        self._requested_by = by  # who asked: logged and kept in each rank's state file
        logger.info("saving step %d (asked by: %s)", step, "; ".join(by))
        extra = self._capture(step) if capture else None
        state = self.trainer.state
        metrics = self._store.ranking_metric(state.metrics, state.iteration)
        tensors = handler_tensors.capture(self.trainer)
        self._writer.start(step, self.trainer.model, self.trainer.optimizer, extra, metrics, tensors)
        self.last_saved_step = step
        if capture and self.mode == AsyncMode.SYNC:
            self._finish(wait=False)

    def _finish(self, wait: bool) -> None:
        """Publish the save in flight once every rank's write is durable (collective)."""
        self._capture_due()
        if self._writer.inflight is None:  # published by the capture (mode="sync")
            return
        self._saved(self._writer.finish(wait))

    def _saved(self, save: Any) -> None:
        self.last_checkpoint = save.final
        self.trainer.state.last_checkpoint = save.final
        self.trainer.fire(Events.CHECKPOINT_SAVED, save.step, save.final)
        self._store.check_index_bound(save.final, save.index_size)  # over checkpoint.max_index_mb: exit 2

    def _wait_local(self) -> None:
        """Wait for this rank's own write only (no collective: a peer may be gone)."""
        if self._writer.wait_local():
            self._finish(wait=False)

    def _load(self, path: str, *, rollback: bool, keep_data_position: bool = False) -> None:
        self.last_saved_step = self._state.load(
            path, rollback=rollback, keep_data_position=keep_data_position
        )
        self.resumed_from = path

    def _release_lock(self) -> None:
        self._session.release(self, self.directory, started=getattr(self.trainer, "started", True))

    def _add_blocked(self, seconds: float) -> None:
        times = self.trainer.state.times
        times["checkpoint"] = times.get("checkpoint", 0.0) + seconds
