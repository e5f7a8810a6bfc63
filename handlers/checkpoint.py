"""AsyncCheckpointer: sharded, asynchronous, crash-safe checkpoints and exact resume.

What a checkpoint holds: model and optimizer through ``torch.distributed.checkpoint`` (DCP, sharded
and reshardable), and per rank as JSON: the LR scheduler, the trainer's counters, every stateful
handler registered with the trainer, the data position and the RNG states (python, numpy, torch,
CUDA, the data's own generators). The on-disk layout and the safe readers are in
:mod:`engine.checkpoint_io`.

When it saves (at STEP_END, after the StepScheduler has set its flags): on
``state.should_checkpoint``, every ``every_steps`` steps, at the last step, when the run stops on
request (``state.should_stop`` with a resumable exit code), and at TRAIN_END if the last step was
not saved yet; never twice for one step. The decision is agreed across ranks.

Modes (``mode=``):

* ``"async"`` (the default): the save call returns at once; the checkpointer's writer thread copies
  the state to host memory (DCP's stager, into buffers reused from save to save, pinned with CUDA)
  and then writes it with ``dcp.save`` on a gloo process group of its own. Training waits for the
  copy only where it must (the staging-wait contract): right before the next ``optimizer.step``
  (parameters and optimizer state must not change mid-copy), and before any load, rollback, next
  save or drain. Model buffers (which a forward may change, e.g. BatchNorm statistics) are copied
  at the save itself. ``"async_staged"`` is the old name of this mode and still accepted.
* ``"async_copy"``: ``dcp.async_save``: training waits while the whole state is copied to host
  memory in the save call, then the write runs on a background thread. For code that changes
  parameters or optimizer state outside ``optimizer.step`` (this was ``"async"`` before the
  staged copy became the default).
* ``"sync"``: ``dcp.save``; training waits for the whole write.

Only one save is in flight. A save becomes a checkpoint only when every rank's data is durable: each
rank's DCP writer checksums the files it wrote while it fsyncs them (on DCP's background thread for
an async save), the next STEP_END polls the write, the ranks agree "all done" with one small
all-reduce, rank 0 gathers the ranks' checksums and writes the completion marker with the manifest
of every file, renames the directory to ``step_N`` and moves ``latest``; then
``Events.CHECKPOINT_SAVED(step, path)`` fires. ``wait()`` drains the save in flight; it runs at
TRAIN_END and on the exception path. On the exception path (and after a failure exit code) it only
waits locally, with a timeout, and starts no collective, since a peer may be gone: with several
ranks that save stays an incomplete ``.partial`` directory which resume ignores.

Loading (resume, rollback, ``finetune_from``) first verifies the chosen checkpoint against its
manifest, every rank checking a share of the files; a damaged checkpoint is named in a warning and
the next older complete one is loaded instead, the same one on every rank. Checkpoints without a
manifest (written by an earlier version) load with a warning that they are unverified. Every failure
to save or load leaves as a ``CheckpointError`` naming the path.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hookloop.engine import checkpoint_io as io
from hookloop.engine import intra_op, parallel
from hookloop.engine.checkpoint_io import CheckpointError, CheckpointLayoutError
from hookloop.engine.checks import check_bool, check_choice, check_int, check_number, check_str, dotted
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events, Priority
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler import Handler
from hookloop.engine.intra_op import use_one_intra_op_thread

__all__ = ["AsyncCheckpointer", "CheckpointConfig", "CheckpointError", "CheckpointLayoutError"]

# Where the checkpointer runs, relative to the phases of an event (engine.Priority).
#: TRAIN_START and ROLLBACK: restore; STEP_START: reset the save timer; TRAIN_END / TRAIN_FAILED:
#: the last save and the drain. Handlers after it see the restored step.
RESUME = Priority.RESTORE
#: STEP_END: save when asked, the first act, once the step's metrics and validation are in.
CHECKPOINT = Priority.ACT
#: BEFORE_OPTIMIZER_STEP: wait until staging is done, after every handler that may veto the step and
#: right before the optimizer changes the parameters being staged.
STAGING_WAIT = Priority.CLEANUP

logger = logging.getLogger(__name__)

MODES = ("async", "async_copy", "sync")
# Old mode names configs may still hold -> the mode that behaves as they meant.
MODE_ALIASES = {"async_staged": "async"}
METRIC_MODES = ("min", "max")
_FORMAT = "hookloop-checkpoint"
_VERSION = 1
_RESUMABLE_EXIT_CODES = (int(ExitCode.SUCCESS), int(ExitCode.STOPPED))
# Counters that count events fired (filters read them): a rollback keeps them monotonic.
_EVENT_COUNTERS = ("microbatches_seen", "validations", "checkpoints_saved", "rollbacks", "skipped_steps")
# Optimizer state and hyper-parameters keyed by parameter name, so ranks that hold different
# parameters (pipeline stages) never write the same key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# OmegaConf resolves the config section's annotations at run time: Optional the old way.
# ruff: noqa: UP007, UP045


@dataclass
class CheckpointConfig:
    """The ``checkpoint`` section: see :class:`AsyncCheckpointer`. ``directory`` null means
    ``<run_dir>/checkpoints`` (the run directory is given to ``from_config``)."""

    enabled: bool = True
    directory: Optional[str] = None
    every_steps: Optional[int] = None
    keep_last: int = 3
    keep_best: int = 0
    metric: str = "val_loss"
    metric_mode: str = "min"
    mode: str = "async"
    resume: Optional[str] = "auto"
    load_optimizer: bool = True
    finetune_from: Optional[str] = None
    wait_timeout_s: float = 600.0
    max_index_mb: float = 8.0

    def validate(self, prefix: str = "checkpoint") -> None:
        """The only copy of the checkpointer's rules (its constructor calls this too)."""
        p = prefix
        check_bool(dotted(p, "enabled"), self.enabled)
        check_str(dotted(p, "directory"), self.directory, allow_none=True, what="a directory path")
        check_int(dotted(p, "every_steps"), self.every_steps, allow_none=True)
        check_int(dotted(p, "keep_last"), self.keep_last, hint="complete checkpoints to keep")
        check_int(
            dotted(p, "keep_best"), self.keep_best, low=0, hint="best checkpoints by the metric to keep"
        )
        check_str(dotted(p, "metric"), self.metric, what="a metric name in state.metrics (e.g. 'val_loss')")
        check_choice(dotted(p, "metric_mode"), self.metric_mode, METRIC_MODES)
        check_choice(dotted(p, "mode"), self.mode, (*MODES, *MODE_ALIASES))
        for name in ("resume", "finetune_from"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str | os.PathLike) or not os.fspath(value)):
                raise ConfigError(
                    dotted(p, name), f"must be a checkpoint directory path or null, got {value!r}"
                )
        check_bool(dotted(p, "load_optimizer"), self.load_optimizer)
        if self.finetune_from is not None and self.resume not in (None, "auto"):
            raise ConfigError(
                dotted(p, "finetune_from"),
                f"cannot be combined with an explicit {dotted(p, 'resume')} path; set resume to auto or null",
            )
        check_number(dotted(p, "wait_timeout_s"), self.wait_timeout_s, positive=True, hint="seconds")
        check_number(
            dotted(p, "max_index_mb"),
            self.max_index_mb,
            positive=True,
            hint="the largest .metadata a resume reads, in MiB",
        )


class _Save:
    """One save in flight: where it goes, the futures that tell when it is staged/durable, and this
    rank's manifest entries (its state JSON's from ``rank_file``, its DCP files' in
    ``writer.entries`` once done)."""

    def __init__(
        self,
        step: int,
        partial: str,
        final: str,
        done: Future,
        staged: Future | None,
        writer: io.RecordingWriter | None = None,
        rank_file: Future | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        self.step, self.partial, self.final = step, partial, final
        self.done, self.staged = done, staged
        self.writer, self.rank_file = writer, rank_file
        self.metrics = dict(metrics or {})

    @property
    def finite(self) -> bool | None:
        """Whether this rank's saved parameters and optimizer state hold no NaN/Inf (checked by its
        DCP writer, beside the write); only once ``done`` has resolved without error."""
        return self.writer.finite if self.writer is not None else None

    @property
    def entries(self) -> dict[str, Any]:
        """This rank's manifest entries; only once ``done`` has resolved without error."""
        own = self.rank_file.result() if self.rank_file is not None else {}
        return {**own, **(self.writer.entries if self.writer is not None else {})}


def _done_future(result: Any = None) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


def _all_of(futures: list[Future]) -> Future:
    """One future for several: None once all of them are done, or the first failure among them."""
    combined: Future = Future()
    lock = threading.Lock()

    def check(_: Future) -> None:
        with lock:
            if combined.done() or not all(f.done() for f in futures):
                return
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            if failed is None:
                combined.set_result(None)
            else:
                combined.set_exception(failed)

    for future in futures:
        future.add_done_callback(check)
    return combined


def _write_rank_file(partial: str, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Write this rank's state JSON durably into ``partial``; its manifest entries."""
    io.write_json_atomic(os.path.join(partial, name), extra)
    return io.checksum_files(partial, [name], parallel.rank())  # tens of kB


class AsyncCheckpointer(Handler):
    """Save sharded checkpoints (in the background by default), resume exactly, answer ROLLBACK.

    Args:
        directory: where the ``step_N`` checkpoint directories and the ``latest`` pointer live.
        every_steps: also save every this many steps (None: only on request, at the end, on stop).
        keep_last: complete checkpoints to keep; older ones are deleted after a new one is durable.
        keep_best: also keep the best this many checkpoints by ``metric`` (0: off). A checkpoint
            stays if it is among the last ``keep_last`` *or* the best ``keep_best``; ``latest`` and
            the newest known-good one (a NaN rollback may need it) are never pruned either.
        metric: the ``state.metrics`` entry ranking checkpoints, read when a save starts (at
            STEP_END, after validation) and stored in the checkpoint's completion marker, so the
            ranking survives restarts. A checkpoint saved without it is kept by ``keep_last`` only.
        metric_mode: ``"min"`` (lower is better, e.g. ``val_loss``) or ``"max"``.
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
        max_index_mb: the largest DCP index (``.metadata``) a resume reads, in MiB; a larger one is
            refused as damaged (reading it is bounded, linear in its size). A save whose index is
            larger logs an error naming the value to set.
    """

    asks_after_agreement = False  # late decisions only from values every rank shares

    Config = CheckpointConfig
    section = "checkpoint"

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every_steps: int | None = None,
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
        CheckpointConfig(
            directory=os.fspath(directory),
            every_steps=every_steps,
            keep_last=keep_last,
            keep_best=keep_best,
            metric=metric,
            metric_mode=metric_mode,
            mode=mode,
            resume=resume,  # type: ignore[arg-type]
            load_optimizer=load_optimizer,
            finetune_from=finetune_from,  # type: ignore[arg-type]
            wait_timeout_s=wait_timeout_s,
            max_index_mb=max_index_mb,
        ).validate("checkpoint")
        self.directory = os.path.abspath(directory)
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.keep_best, self.metric, self.metric_mode = keep_best, metric, metric_mode
        self._metric_missing_warned = False
        self._index_warned = False
        self.mode = MODE_ALIASES.get(mode, mode)
        self.load_optimizer = load_optimizer
        self.wait_timeout_s = wait_timeout_s
        self.index_limit = int(max_index_mb * 2**20)
        self.resume = None if resume is None else ("auto" if resume == "auto" else os.path.abspath(resume))
        self.finetune_from = None if finetune_from is None else os.path.abspath(finetune_from)
        _check_writable(self.directory)
        if self.resume not in (None, "auto"):
            _check_loadable(self.resume, "checkpoint.resume")
        if self.finetune_from is not None:
            _check_loadable(self.finetune_from, "checkpoint.finetune_from")

        self.trainer: Any = None
        self.last_saved_step: int | None = None
        self.resumed_from: str | None = None
        self.last_checkpoint: str | None = None
        self._inflight: _Save | None = None
        self._pending_ranks = 0  # ranks whose save in flight was not yet durable at this step's agreement
        self._group: Any = None
        self._stager: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._write_executor: ThreadPoolExecutor | None = None
        self._pruning: Future | None = None
        self._session = ""
        self._started = False

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
        return cls(
            directory,
            every_steps=cfg.every_steps,
            keep_last=cfg.keep_last,
            keep_best=cfg.keep_best,
            metric=cfg.metric,
            metric_mode=cfg.metric_mode,
            mode=cfg.mode,
            resume=cfg.resume,
            load_optimizer=cfg.load_optimizer,
            finetune_from=cfg.finetune_from,
            wait_timeout_s=cfg.wait_timeout_s,
            max_index_mb=cfg.max_index_mb,
        )

    # ------------------------------------------------------------------------------ attaching
    def attach(self, trainer: Any) -> AsyncCheckpointer:
        if self.trainer is not None:
            raise RuntimeError(
                "this AsyncCheckpointer is already attached to a trainer; build one per trainer"
            )
        if trainer.get_handler(AsyncCheckpointer) is not None:
            raise RuntimeError("the trainer already has a checkpointer attached; attach only one")
        # Resume first at TRAIN_START (right after the trainer's own reset); save at STEP_END once
        # the step's flags, metrics and validation are in; wait for staging last before the
        # optimizer changes the parameters.
        trainer.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=RESUME)
        trainer.add_event_handler(Events.STEP_START, self._on_step_start, priority=RESUME)
        trainer.add_event_handler(Events.BEFORE_OPTIMIZER_STEP, self._wait_staged, priority=STAGING_WAIT)
        trainer.add_event_handler(Events.STEP_END, self._on_step_end, priority=CHECKPOINT)
        # whether every rank's save in flight is durable travels in the trainer's step agreement
        trainer.agreement.add("checkpoint.pending", self._save_pending, self._on_pending_agreed)
        trainer.add_event_handler(Events.TRAIN_END, self._on_train_end, priority=RESUME)
        trainer.add_event_handler(Events.TRAIN_FAILED, self._on_exception, priority=RESUME)
        trainer.add_event_handler(Events.ROLLBACK, self._on_rollback, priority=RESUME)
        return super().attach(trainer)

    # ------------------------------------------------------------------------------ events
    def _on_train_start(self) -> None:
        self._setup_group()
        if self._started:  # a later run() in this process continues; it does not reload
            return
        self._started = True
        state = self.trainer.state
        if self.resume is not None:
            path = self._agreed_checkpoint(self.resume)
            if path is not None:
                self._load(path, rollback=False)
                state.last_checkpoint = path
                max_steps = self.trainer.limits[0]
                if max_steps is not None and state.iteration >= max_steps:
                    state.request_stop(
                        f"the checkpoint {path} is at step {state.iteration} >= max_steps ({max_steps}): "
                        "nothing left to train, this run is finished; to start another, pass "
                        "train.run_dir=<new dir> (or checkpoint.resume=null to train again from step 0)"
                    )
                    # The trainer prints the reason once, as it stops ("stopping after step N: ...").
                    self.trainer.terminate()
                return
        if self.finetune_from is not None:
            path = self._agreed_checkpoint(self.finetune_from, "checkpoint.finetune_from")
            if path is not None:
                self._load_weights(path)
        if state.initial_checkpoint_requested and state.iteration == 0:
            # Something may roll back before the first regular save: keep the initial state (written
            # in the background like any save, published at the next step's end).
            self._start_save(0)

    def _on_step_start(self) -> None:
        self.trainer.state.times["checkpoint"] = 0.0

    def _wait_staged(self) -> None:
        """The staging-wait contract: the optimizer must not change what is still being copied."""
        save = self._inflight
        if save is None or save.staged is None or save.staged.done():
            return
        start = time.perf_counter()
        with self._long_wait():
            self._result(save.staged, "staging")
        self._add_blocked(time.perf_counter() - start)

    def _on_step_end(self) -> None:
        start = time.perf_counter()
        state = self.trainer.state
        decisions = self.trainer.decisions  # agreed by every rank in this step's one all-reduce
        step = state.iteration
        hold = state.hold_checkpoints  # a detector distrusts this state: neither save nor publish
        want = (
            not hold
            and step != self.last_saved_step
            and (
                decisions.checkpoint
                or (self.every_steps is not None and step % self.every_steps == 0)
                or state.is_last_step
                or self._at_last_step()
                or (decisions.stop and decisions.exit_code in _RESUMABLE_EXIT_CODES)
            )
        )
        inflight = self._inflight
        all_done = not self._pending_ranks
        if inflight is not None and (all_done or want) and not hold:
            self._finish(wait=not all_done)
        if want:
            self._start_save(step)
        self._add_blocked(time.perf_counter() - start)

    def _save_pending(self) -> bool:
        """This rank's vote in the step agreement: its save in flight is not yet durable."""
        inflight = self._inflight
        return inflight is not None and not inflight.done.done()

    def _on_pending_agreed(self, ranks: float) -> None:
        self._pending_ranks = int(ranks)

    def _on_train_end(self) -> None:
        state = self.trainer.state
        resumable = state.exit_code in _RESUMABLE_EXIT_CODES
        if resumable and state.iteration > 0 and state.iteration != self.last_saved_step:
            # data ran out, or the stop came after the step's agreement: publish the save in
            # flight first, then save this step
            self.wait()
            self._start_save(state.iteration)
        if resumable:
            self.wait()
        else:
            self._wait_local()

    def _on_exception(self, _error: BaseException) -> None:
        self._wait_local()

    def _on_rollback(self) -> None:
        state = self.trainer.state
        self.restore_latest(
            keep_data_position=state.rollback_keep_data_position, at_or_before=state.rollback_target_step
        )

    # ------------------------------------------------------------------------------ public
    @property
    def saving(self) -> bool:
        """A save was started and is not yet published as a complete checkpoint."""
        return self._inflight is not None

    @property
    def staging(self) -> bool:
        """The save in flight is still being copied to host memory (``mode="async"``): the next
        optimizer step, load, rollback, save or drain waits for the copy first."""
        save = self._inflight
        return save is not None and save.staged is not None and not save.staged.done()

    def wait(self) -> None:
        """Drain the save in flight: wait until it is durable on every rank, then publish it
        (marker, ``latest``, pruning, CHECKPOINT_SAVED). Collective: call it on every rank."""
        if self._inflight is not None:
            self._finish(wait=True)
        self._wait_pruned()

    def _long_wait(self) -> Any:
        """Lift the trainer's progress watchdog around a *local* wait that is long by nature and
        bounded by its own timeout (``wait_timeout_s``, the process group's timeout): a write still
        on disk, verifying or publishing on slow storage, staging. The collectives around such a
        wait stay under the watchdog's bound; a peer waiting in one of them meanwhile sees this
        rank's heartbeat (:class:`engine.watchdog.PeerHeartbeats`), so slow is not taken for hung,
        while a stopped peer still ends the run with 77 within the bound."""
        watchdog = getattr(self.trainer, "watchdog", None) if self.trainer is not None else None
        return watchdog.suspended() if watchdog is not None else contextlib.nullcontext()

    def restore_latest(self, keep_data_position: bool = False, at_or_before: int | None = None) -> int:
        """Restore the newest intact complete checkpoint whose saved parameters and optimizer state
        are finite (at or before step ``at_or_before``, when given) into the running trainer (model,
        optimizer, LR scheduler, counters, stateful handlers unless their ``restore_on_rollback`` is
        False, RNG) and return its step; damaged newer ones are skipped with a warning.
        ``keep_data_position``: the data continues from where it is now instead of going back.
        Collective: every rank calls it (ROLLBACK is agreed)."""
        self.wait()
        path = self._agreed_checkpoint("auto", at_or_before=at_or_before, finite_only=True)
        if path is None:
            limit = "" if at_or_before is None else f" at or before step {at_or_before}"
            raise CheckpointError(
                f"no complete checkpoint{limit} with finite weights in {self.directory} to roll back to"
            )
        self._load(path, rollback=True, keep_data_position=keep_data_position)
        return self.trainer.state.iteration

    def close(self) -> None:
        """Drain the save in flight and release the checkpoint process group and stager."""
        self.wait()
        for executor in (self._write_executor, self._executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._write_executor = self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None
        self._session = ""  # a later run() sets both up again

    # ------------------------------------------------------------------------------ saving
    def _at_last_step(self) -> bool:
        trainer, state = self.trainer, self.trainer.state
        if trainer.max_steps is not None and state.iteration >= trainer.max_steps:
            return True
        length, epochs = state.epoch_length, state.max_epochs
        return bool(
            length
            and epochs
            and epochs < 2**40
            and state.epoch >= epochs
            and trainer.step_data is not None
            and trainer.step_data.steps >= length
        )

    def _start_save(self, step: int) -> None:
        if self._inflight is not None:  # one save in flight: its staging buffers are reused
            self._finish(wait=True)
        name = io.step_dir_name(step)
        partial = os.path.join(self.directory, f"{name}.partial-{self._session}")
        own_state = f"rank_{parallel.rank():05d}.json"
        try:
            extra = self._rank_state(step)
        except Exception as e:  # e.g. a handler's state_dict() holds something JSON cannot carry
            raise CheckpointError(f"cannot save step {step}: {type(e).__name__}: {e}") from e
        try:
            os.makedirs(partial, exist_ok=True)
            if self.mode == "sync":
                with self._long_wait():
                    rank_file = _done_future(_write_rank_file(partial, own_state, extra))
            else:  # two fsyncs that training need not wait for: beside the DCP write
                rank_file = self._io().submit(_write_rank_file, partial, own_state, extra)
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoint for step {step} to {partial}: {e}; free space or fix permissions "
                f"of checkpoint.directory ({self.directory}); the previous checkpoint is untouched"
            ) from e
        model_sd, optim_sd = get_state_dict(self.trainer.model, self.trainer.optimizer, options=_OPTIONS)
        checked = _trained_entries(model_sd, optim_sd, self.trainer.model)  # finite or not: the writer says
        if self.mode == "async":  # staged later, while the next forward may change buffers
            model_sd = _copy_buffers(model_sd, self.trainer.model)
        state_dict = {"model": model_sd, "optim": optim_sd}
        # checksums the DCP files as it makes them durable, and checks the saved state for NaN/Inf
        writer = io.RecordingWriter(partial, parallel.rank(), checked=checked)
        kwargs: dict[str, Any] = {
            "checkpoint_id": partial,
            "storage_writer": writer,
            "process_group": self._group,
            "no_dist": self._group is None,
        }
        staged: Future | None = None
        try:
            with _quiet_single_process():
                if self.mode == "sync":
                    with self._long_wait():
                        dcp.save(state_dict, **kwargs)
                    done = _done_future()
                elif self.mode == "async_copy":
                    done = dcp.async_save(state_dict, **kwargs)
                else:  # the copy and the write both on the writer thread: the call returns at once
                    staged = Future()
                    stager = self._get_stager()
                    done = self._writer().submit(_stage_then_write, stager, state_dict, staged, kwargs)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            _wait_quietly(rank_file, self.wait_timeout_s)  # nothing may write into partial later
            _reraise_interrupt(e)
            raise CheckpointError(
                f"saving step {step} to {partial} failed: {_last_line(e)}; free space or fix permissions of "
                f"checkpoint.directory ({self.directory}); the previous complete checkpoint and `latest` "
                "are unchanged"
            ) from e
        final = os.path.join(self.directory, name)
        done = _all_of([done, rank_file])
        self._inflight = _Save(
            step,
            partial,
            final,
            done,
            staged,
            writer=writer,
            rank_file=rank_file,
            metrics=self._ranking_metric(),
        )
        self.last_saved_step = step
        if self.mode == "sync":
            self._finish(wait=False)

    def _rank_state(self, step: int) -> dict[str, Any]:
        trainer, state = self.trainer, self.trainer.state
        handlers = {}
        for key, obj in trainer.stateful.items():
            handlers[key] = io.encode(obj.state_dict(), f"handler {key!r} state_dict()")
        data = trainer.step_data.state_dict() if trainer.step_data is not None else None
        scheduler = trainer.lr_scheduler
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "step": step,
            "rank": parallel.rank(),
            "world_size": parallel.world_size(),
            # This save counts itself: a run resumed from it has saved it (CHECKPOINT_SAVED fires
            # only once the save is published, after these counters were taken).
            "counters": {**state.counters(), "checkpoints_saved": state.checkpoints_saved + 1},
            "epoch_length": state.epoch_length,
            "lr_scheduler": None if scheduler is None else io.encode(scheduler.state_dict(), "lr_scheduler"),
            "handlers": handlers,
            "data": io.encode(data, "data position"),
            "rng": io.capture_rng(self._data_generators()),
            # What the run last reported, so a resumed run that trains no further step still says it.
            "last": {"loss": float(state.loss), "metrics": _numeric(state.metrics)},
        }

    def _data_generators(self) -> list[torch.Generator]:
        step_data = self.trainer.step_data
        return io.data_generators(step_data.data) if step_data is not None else []

    def _get_stager(self) -> Any:
        """DCP's stager, used on the writer thread only: it keeps the host buffers of the first save
        and copies into them at every later one (pinned with CUDA, for fast device-to-host copies)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,  # it runs on our writer thread already
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    def _writer(self) -> ThreadPoolExecutor:
        """The thread that stages and writes ``mode="async"`` saves (one save in flight at a time).
        It runs its torch ops on one intra-op thread: a team of its own would slow every later
        training step (see :mod:`hookloop.engine.intra_op`)."""
        if self._write_executor is None:
            intra_op.prepare()  # here, so that the thread starts as fast as it did before
            self._write_executor = ThreadPoolExecutor(
                1, thread_name_prefix="hookloop-checkpoint-write", initializer=use_one_intra_op_thread
            )
        return self._write_executor

    def _finish(self, wait: bool) -> None:
        """Publish the save in flight once every rank's write is durable (collective)."""
        save, self._inflight = self._inflight, None
        error: BaseException | None = None
        entries: dict[str, Any] = {}
        try:  # without ``wait`` every rank reported its save done: no waiting here
            if wait:
                with self._long_wait():
                    save.done.result(timeout=self.wait_timeout_s)
            else:
                save.done.result(timeout=0)
            entries = save.entries
        except FutureTimeout:
            error = TimeoutError(f"not durable within {self.wait_timeout_s:.0f}s (wait_timeout_s)")
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            _reraise_interrupt(e)
            error = e
        failed = self._agree_failed(error is not None)
        if failed:
            where = f": {_last_line(error)}" if error is not None else " on another rank"
            raise CheckpointError(
                f"writing the checkpoint of step {save.step} to {save.partial} failed{where}; the previous "
                f"complete checkpoint and `latest` are unchanged; free space or fix permissions of "
                f"checkpoint.directory ({self.directory})"
            ) from error
        files, finite = self._collect_entries(entries, save.finite if error is None else None)
        ok = True
        if parallel.rank() == 0:
            with self._long_wait():  # file system work only: marker, renames, fsyncs, pruning
                ok = self._publish(save, files, finite)
        if parallel.world_size() > 1:
            ok = not self._agree_failed(not ok)
        if not ok:
            raise CheckpointError(
                f"publishing the checkpoint of step {save.step} at {save.final} failed (see the error "
                f"logged by rank 0); the previous complete checkpoint and `latest` are unchanged"
            )
        self.last_checkpoint = save.final
        self.trainer.state.last_checkpoint = save.final
        self.trainer.fire(Events.CHECKPOINT_SAVED, save.step, save.final)

    def _collect_entries(
        self, entries: dict[str, Any], finite: bool | None
    ) -> tuple[dict[str, Any] | None, bool | None]:
        """Rank 0 gets every rank's manifest entries and whether all ranks' saved state is finite
        (None: a rank could not tell) in one gather on the checkpoint group, which no write uses any
        more (every rank's save is done); the other ranks get ``(None, None)``."""
        if self._group is None:
            return dict(entries), finite
        parts: list[Any] | None = [None] * parallel.world_size() if parallel.rank() == 0 else None
        dist.gather_object((entries, finite), parts, dst=0, group=self._group)
        if parts is None:
            return None, None
        merged: dict[str, Any] = {}
        for part, _ in parts:
            merged.update(part)
        verdicts = [verdict for _, verdict in parts]
        return merged, (None if None in verdicts else all(verdicts))

    def _publish(self, save: _Save, files: dict[str, Any], finite: bool | None = None) -> bool:
        """Rank 0: marker (with the manifest of every rank's files and whether the saved parameters
        and optimizer state are finite), rename to ``step_N``, move ``latest``, prune. Every rank's
        data is durable and checksummed."""
        try:
            marker = {
                "step": save.step,
                "world_size": parallel.world_size(),
                "mode": self.mode,
                "time": time.time(),
                "metrics": save.metrics,
                "manifest": io.make_manifest(files),
            }
            if finite is not None:
                marker["finite"] = finite
            index = files.get(".metadata", {}).get("size", 0)
            if index > self.index_limit and not self._index_warned:
                self._index_warned = True
                logger.error(
                    "the index (.metadata) of checkpoint %s has %d bytes, more than checkpoint.max_index_mb "
                    "(%.3g MiB): resuming would refuse it as damaged; set checkpoint.max_index_mb to at "
                    "least %g for this run and its resumes",
                    save.final,
                    index,
                    self.index_limit / 2**20,
                    io.index_mb(index),
                )
            io.write_json_atomic(os.path.join(save.partial, io.MARKER), marker)
            if os.path.lexists(save.final):  # an older checkpoint of this step (e.g. before a rollback)
                trash = f"{save.final}.replaced-{self._session}"
                os.replace(save.final, trash)
                _delete_tree(trash)
            os.replace(save.partial, save.final)
            io.fsync_dir(self.directory)
            io.write_latest(self.directory, os.path.basename(save.final))
        except OSError as e:
            logger.error("could not publish checkpoint %s: %s", save.final, e)
            return False
        logger.info("checkpoint of step %d is complete: %s", save.step, save.final)
        try:
            self._prune()
        except OSError as e:  # the new checkpoint is complete; old ones stay until the next save
            logger.warning("could not prune old checkpoints in %s (training goes on): %s", self.directory, e)
        return True

    def _prune(self) -> None:
        """Rank 0: delete the checkpoints ``keep_last`` no longer keeps. Each is made incomplete
        (marker removed) and renamed out of the listing here; the files go on a background thread,
        since unlinking hundreds of MB would block training about as long as a save's copy. Nothing
        outside the checkpoint directory is touched: a step directory that is a symbolic link
        loses the link only (its target, marker included, stays as it was)."""
        self._wait_pruned()
        complete, torn = io.complete_checkpoints(self.directory)
        newest = complete[0][0] if complete else -1
        doomed: list[str] = []
        for path in torn:  # left by a deletion that a crash interrupted (a save in flight is .partial)
            step = io.parse_step(os.path.basename(path))
            if step is not None and step < newest:
                doomed.append(path)
        keep = {path for _, path in complete[: self.keep_last]}
        keep.update(self._best(complete))
        latest = io.read_latest(self.directory)
        if latest:
            keep.add(os.path.join(self.directory, latest))
        good = self.trainer.state.known_good_step if self.trainer is not None else None
        if good is not None:  # a rollback may need it: never prune the newest known-good checkpoint
            known_good = next(
                (path for step, path in complete if step <= good and not _not_finite(path)), None
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
                os.remove(os.path.join(path, io.MARKER))  # incomplete first, so a reader never loads it
            except OSError as e:
                logger.warning("could not delete old checkpoint %s (training goes on): %s", path, e)
                continue
            doomed.append(path)
        trash = []
        for path in doomed:
            target = f"{path}.pruned-{self._session}"
            try:
                os.replace(path, target)
            except OSError as e:
                logger.warning("could not delete old checkpoint %s (training goes on): %s", path, e)
                continue
            trash.append(target)
        if trash:
            self._pruning = self._io().submit(_delete_trees, trash)

    def _io(self) -> ThreadPoolExecutor:
        """The thread for the file work training need not wait for (rank state files, pruning)."""
        if self._executor is None:
            intra_op.prepare()
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="hookloop-checkpoint-io", initializer=use_one_intra_op_thread
            )
        return self._executor

    def _wait_pruned(self) -> None:
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

    def _ranking_metric(self) -> dict[str, float]:
        """``{metric: value}`` to store with the save being started ({} when keep_best is off or
        the run has no finite value of the metric yet)."""
        if not self.keep_best:
            return {}
        value = self.trainer.state.metrics.get(self.metric)
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            if not self._metric_missing_warned and self.trainer.state.iteration > 0:
                self._metric_missing_warned = True
                logger.warning(
                    "checkpoint.metric %r has no finite value in state.metrics at step %d: checkpoints "
                    "saved without it are kept by keep_last only (validate on checkpoint steps, or pick "
                    "a metric the run publishes)",
                    self.metric,
                    self.trainer.state.iteration,
                )
            return {}
        return {self.metric: value}

    def _best(self, complete: list[tuple[int, str]]) -> set[str]:
        """The best ``keep_best`` of ``complete`` by the metric stored in their markers. Ties go to
        the older checkpoint: a value carried over from an earlier validation belongs to it."""
        if not self.keep_best:
            return set()
        ranked = []
        for step, path in complete:
            try:
                value = io.read_json(os.path.join(path, io.MARKER)).get("metrics", {}).get(self.metric)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                ranked.append((value if self.metric_mode == "min" else -value, step, path))
        ranked.sort()
        return {path for _, _, path in ranked[: self.keep_best]}

    def _wait_local(self) -> None:
        """Wait for this rank's own write only (no collective: a peer may be gone)."""
        save = self._inflight
        if save is None:
            return
        try:
            with self._long_wait():
                save.done.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            logger.error(
                "checkpoint of step %d did not finish writing within %.0fs", save.step, self.wait_timeout_s
            )
            return
        except BaseException as e:  # noqa: BLE001 - already failing; report and go on
            logger.error("checkpoint of step %d failed: %r", save.step, e)
            self._inflight = None
            return
        if parallel.world_size() == 1:  # no peer to agree with: this save is complete
            self._finish(wait=False)
        else:
            self._inflight = None
            logger.warning(
                "checkpoint of step %d stays incomplete (%s): the ranks could not agree it finished",
                save.step,
                save.partial,
            )

    # ------------------------------------------------------------------------------ loading
    def _agreed_checkpoint(
        self,
        which: str,
        field: str = "checkpoint.resume",
        at_or_before: int | None = None,
        finite_only: bool = False,
    ) -> str | None:
        """The checkpoint every rank loads, after verifying its manifest (collective).

        ``"auto"``: the newest intact complete checkpoint in ``directory``, None when there is no
        complete one at all. A path: that checkpoint or, when it is damaged, the next older intact
        one beside it. A damaged checkpoint is named in a warning and the next older one is tried;
        CheckpointError when every candidate is damaged. Rank 0 lists the candidates; each rank
        verifies its share of a candidate's files and the ranks exchange what they found, so all of
        them take the same decision even when only one of them saw the damage. ``finite_only``
        (a rollback): checkpoints whose marker records NaN/Inf in the saved parameters or optimizer
        state are skipped too."""
        if which != "auto":
            resolved = _check_loadable(which, field)
            if resolved != which:  # a directory of checkpoints: its newest intact one
                if parallel.rank() == 0:
                    logger.info(
                        "%s %s is a directory of checkpoints: loading its newest intact checkpoint",
                        field,
                        which,
                    )
                which = resolved
        listing: list[Any] = [[], None]
        if parallel.rank() == 0:
            try:
                listing[0] = [
                    path
                    for path in self._candidates(which)
                    if at_or_before is None or (io.parse_step(os.path.basename(path)) or 0) <= at_or_before
                ]
                if finite_only:
                    for path in [path for path in listing[0] if _not_finite(path)]:
                        logger.warning(
                            "not rolling back to %s: its parameters or optimizer state held NaN/Inf "
                            "when it was saved",
                            path,
                        )
                        listing[0].remove(path)
            except OSError as e:
                listing[1] = f"cannot list the checkpoints in {which}: {e}"
        if self._group is not None:
            dist.broadcast_object_list(listing, src=0, group=self._group)
        candidates, listing_error = listing
        if listing_error is not None:
            raise CheckpointError(f"{listing_error}; fix the permissions of checkpoint.directory")
        damaged: list[str] = []
        for path in candidates:
            problems, verified = self._verify_agreed(path)
            if problems:
                damaged.append(path)
                logger.warning(
                    "checkpoint %s is damaged (%s); trying the next older complete checkpoint",
                    path,
                    "; ".join(problems),
                )
                continue
            if damaged:
                logger.warning("loading %s instead of the damaged %s", path, ", ".join(damaged))
            if not verified:
                logger.warning(
                    "checkpoint %s has no manifest in its %s marker (written by an earlier version): "
                    "loading it unverified",
                    path,
                    io.MARKER,
                )
            return path
        if damaged:
            raise CheckpointError(
                f"every complete checkpoint to load from is damaged: {', '.join(damaged)} (the warnings "
                "above name what is wrong with each); restore them from a copy, or move them away to "
                "start fresh"
            )
        return None

    def _candidates(self, which: str) -> list[str]:
        """Rank 0: the checkpoints to try, newest first (see :meth:`_agreed_checkpoint`)."""
        if which != "auto":
            step = io.parse_step(os.path.basename(which))
            parent = os.path.dirname(which)
            older = [path for s, path in io.complete_checkpoints(parent)[0] if step is not None and s < step]
            return [which, *older]
        complete, torn = io.complete_checkpoints(self.directory)
        newest = complete[0][0] if complete else -1
        for path in torn:
            step_of = io.parse_step(os.path.basename(path))
            if step_of is not None and step_of > newest:
                logger.warning("skipping incomplete checkpoint %s (no %s marker)", path, io.MARKER)
        return [path for _, path in complete]

    def _verify_agreed(self, path: str) -> tuple[list[str], bool]:
        """Every rank's problems with ``path`` (each rank checks its share of the files) and whether
        it has a manifest at all; identical on every rank."""
        rank, world = (parallel.rank(), parallel.world_size()) if self._group is not None else (0, 1)
        try:
            with self._long_wait():  # reading the checkpoint back: local, long on slow storage
                problems, verified = io.verify_checkpoint(path, rank, world, self.index_limit)
        except Exception as e:  # noqa: BLE001 - must still join the exchange below, or the peers hang
            problems, verified = [f"verifying it failed: {type(e).__name__}: {e}"], True
        if self._group is None:
            return problems, verified
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (problems, verified), group=self._group)
        everyone = [p if world == 1 else f"rank {r}: {p}" for r, (ps, _) in enumerate(gathered) for p in ps]
        return everyone, all(v for _, v in gathered)

    def _check_compatible(self, path: str, state_dict: dict[str, Any], field: str) -> dict[str, str] | None:
        """Refuse, before anything is read into the model, a checkpoint whose model parameters are
        not this model's (other layers or widths). The verdict is taken on every rank from the union
        of the ranks' parameters, so all ranks raise together. A checkpoint of the same model
        written with pipeline stages and loaded without them (or the reverse) is this model's
        under other names: the map from this rank's parameter names to the checkpoint's is
        returned (None when the names are the same)."""
        index = io.SafeReader(path, index_limit=self.index_limit).read_metadata()
        stored = {
            k.removeprefix("model."): tuple(getattr(v, "size", ()))
            for k, v in index.state_dict_metadata.items()
            if k.startswith("model.")
        }
        wanted = {k: tuple(v.shape) for k, v in state_dict["model"].items() if isinstance(v, torch.Tensor)}
        if self._group is not None:  # ranks may hold different parts (pipeline stages): the union counts
            gathered: list[Any] = [None] * parallel.world_size()
            dist.all_gather_object(gathered, wanted, group=self._group)
            for part in gathered:
                wanted.update(part)
        if stored == wanted:
            return None
        names = _names_across_split(stored, wanted)
        if names is not None:
            return {k: names[k] for k in state_dict["model"]}
        difference = describe_layout_difference(stored, wanted)
        if difference is None:
            return None
        raise CheckpointLayoutError(
            field,
            f"checkpoint {path} holds another model layout: {difference}; resume it with the settings "
            "that wrote it, or start a fresh run with train.run_dir=<new dir> (checkpoint.resume=null "
            "also starts fresh, but saves over this directory's checkpoints); nothing was loaded or "
            "changed",
        )

    def _dcp_load(self, path: str, state_dict: dict[str, Any], field: str = "checkpoint.resume") -> None:
        names = self._check_compatible(path, state_dict, field)
        target = state_dict if names is None else _under_names(state_dict, names)
        if names is not None:
            logger.info(
                "%s was written %s pipeline stages: loading its parameters and optimizer state by name",
                path,
                "without" if any(_STAGE_PREFIX.match(k) for k in names) else "with",
            )
        with _quiet_single_process():
            try:
                dcp.load(
                    target,
                    storage_reader=io.SafeReader(path, index_limit=self.index_limit),
                    planner=io.SafeLoadPlanner(),
                    process_group=self._group,
                    no_dist=self._group is None,
                )
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as e:  # DCP's error derives from BaseException
                raise CheckpointError(
                    f"loading {path} failed: {_last_line(e)}; if the optimizer changed since it was "
                    "written, resume with load_optimizer=False"
                ) from None
        if names is not None:  # DCP replaced the non-tensor values (hyper-parameters) in target
            _back_to_names(target, state_dict, names)

    def _load_weights(self, path: str) -> None:
        model = self.trainer.model
        model_sd = get_model_state_dict(model)
        state_dict = {"model": model_sd}
        self._dcp_load(path, state_dict, "checkpoint.finetune_from")
        try:
            set_model_state_dict(model, state_dict["model"])
        except Exception as e:
            raise CheckpointError(f"loading the model weights of {path} failed: {_last_line(e)}") from e
        logger.info("fine-tuning from the model weights of %s (starting at step 0)", path)

    def _load(self, path: str, *, rollback: bool, keep_data_position: bool = False) -> None:
        """Restore ``path`` into the running trainer; any failure is a CheckpointError naming it."""
        try:
            with self._long_wait():
                self._restore(path, rollback=rollback, keep_data_position=keep_data_position)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"restoring {path} failed ({type(e).__name__}: {_last_line(e)}); resume with the model, "
                "optimizer and handlers that wrote it, or start fresh (checkpoint.resume=None)"
            ) from e

    def _restore(self, path: str, *, rollback: bool, keep_data_position: bool) -> None:
        trainer, state = self.trainer, self.trainer.state
        extra = self._read_rank_state(path)
        if self.load_optimizer:
            model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_OPTIONS)
            state_dict = {"model": model_sd, "optim": optim_sd}
            self._dcp_load(path, state_dict)
            set_state_dict(
                trainer.model,
                trainer.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"],
                options=_OPTIONS,
            )
        else:
            state_dict = {"model": get_model_state_dict(trainer.model)}
            self._dcp_load(path, state_dict)
            set_model_state_dict(trainer.model, state_dict["model"])
        if trainer.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(io.decode(extra["lr_scheduler"]))
        self._load_handlers(extra.get("handlers", {}), rollback)
        counters = dict(extra["counters"])
        if rollback:
            for name in (*_EVENT_COUNTERS, "epoch"):
                counters.pop(name, None)
        position = io.decode(extra["data"]) if extra.get("data") is not None else None
        epoch_length = extra.get("epoch_length")
        state.load_counters(counters)
        io.restore_rng(extra["rng"], self._data_generators())
        state.lr = trainer.optimizer.param_groups[0]["lr"]
        self.last_saved_step = extra["step"]
        self.resumed_from = path
        if not rollback:
            last = extra.get("last") or {}
            if "loss" in last:
                state.loss = last["loss"]
            state.metrics.update(last.get("metrics") or {})
            self._position_data(position, epoch_length, counters["epoch"])
        elif not keep_data_position:
            self._rewind_data(position, epoch_length, counters)
        logger.info("%s %s (step %d)", "rolled back to" if rollback else "resumed from", path, extra["step"])

    def _position_data(self, position: dict | None, epoch_length: int | None, epoch: int) -> None:
        """Before the first epoch starts: counters so ignite re-enters the saved epoch at the saved
        step, and the data source at the saved microbatch."""
        trainer, state = self.trainer, self.trainer.state
        if state.epoch_length is None and epoch_length is not None:
            state.epoch_length = epoch_length
        elif epoch_length is not None and state.epoch_length != epoch_length:
            logger.warning(
                "the data has %s steps per epoch, the checkpoint %s: the data position is not "
                "restored exactly",
                state.epoch_length,
                epoch_length,
            )
        steps = position["steps"] if position else 0
        mid_epoch = (
            position is not None and steps > 0 and not (epoch_length is not None and steps >= epoch_length)
        )
        if position is not None and not mid_epoch:
            # The saved epoch was complete: only a stateful source's own position carries over.
            source = position.get("source")
            position = None if source is None else {"microbatches": 0, "steps": 0, "source": source}
        trainer.resume_at(epoch, steps if mid_epoch else 0, position)

    def _rewind_data(self, position: dict | None, epoch_length: int | None, counters: dict) -> None:
        """Rollback without keeping the data position: the live data iterator restarts at the
        checkpoint's position. ignite's own count of steps in this epoch is not reset, so after such
        a rollback EPOCH_END may fire early by the rewound steps; the data order is exact."""
        if position is None:
            return
        self.trainer.rewind_data(position)

    def _load_handlers(self, states: dict[str, Any], rollback: bool) -> None:
        registered = self.trainer.stateful
        for key, obj in registered.items():
            if rollback and getattr(obj, "restore_on_rollback", True) is False:
                continue
            if key not in states:
                logger.warning("handler state %r is not in the checkpoint; it starts fresh", key)
                continue
            obj.load_state_dict(io.decode(states[key]))
        for key in sorted(set(states) - set(registered)):
            logger.warning("the checkpoint holds state for %r, but no handler registered that key", key)

    def _read_rank_state(self, path: str) -> dict[str, Any]:
        own = os.path.join(path, f"rank_{parallel.rank():05d}.json")
        if not os.path.exists(own):
            own = os.path.join(path, "rank_00000.json")
            logger.warning(
                "%s was written by a different number of ranks: rank %d takes rank 0's data position "
                "and RNG states (a MixtureLoader or MixtureSampler position is global, so the data "
                "continues exactly; a replayed loader skips the steps done)",
                path,
                parallel.rank(),
            )
        try:
            extra = io.read_json(own)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {own}: {e}") from e
        if extra.get("format") != _FORMAT or extra.get("version") != _VERSION:
            raise CheckpointError(f"{own} is not a {_FORMAT} v{_VERSION} state file")
        return extra

    # ------------------------------------------------------------------------------ collectives
    def _setup_group(self) -> None:
        """Once: the gloo group async writes use (so they never collide with training collectives),
        and the session id that names this run's partial directories."""
        if self._session:
            return
        session = uuid.uuid4().int & 0x7FFFFFFF
        if dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
            t = torch.tensor([session], dtype=torch.int64)
            dist.broadcast(t, src=0, group=self._group)
            session = int(t[0])
        self._session = f"{session:08x}"
        if parallel.rank() == 0:
            self._remove_stale_partials()

    def _remove_stale_partials(self) -> None:
        for name in os.listdir(self.directory):
            if ".partial-" in name or ".replaced-" in name or ".pruned-" in name:
                if name.endswith(f"-{self._session}"):
                    continue
                _delete_tree(os.path.join(self.directory, name))

    def _agree_failed(self, failed: bool) -> bool:
        if parallel.world_size() == 1:
            return failed
        t = torch.tensor([int(failed)], dtype=torch.int32, device=parallel.collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0])

    def _result(self, future: Future, what: str) -> Any:
        try:
            return future.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            raise CheckpointError(
                f"checkpoint {what} did not finish within {self.wait_timeout_s:.0f}s (wait_timeout_s)"
            ) from None
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            _reraise_interrupt(e)
            raise CheckpointError(
                f"checkpoint {what} failed: {_last_line(e)}; free space or fix permissions of "
                f"checkpoint.directory ({self.directory})"
            ) from e

    def _add_blocked(self, seconds: float) -> None:
        times = self.trainer.state.times
        times["checkpoint"] = times.get("checkpoint", 0.0) + seconds


_STAGE_PREFIX = re.compile(r"^\d+\.")
_NUMBERED = re.compile(r"^(.*?[A-Za-z_]\w*)\.(\d+)\.")


def _names_across_split(stored: dict[str, tuple], wanted: dict[str, tuple]) -> dict[str, str] | None:
    """When one of ``stored`` (a checkpoint's model parameters, name -> shape) and ``wanted`` (a
    model's) is split into pipeline stages (names under a stage prefix, ``0.blocks.1.w``) and the
    other is not, and they are the same parameters with the same shapes once the prefixes are
    dropped: the map from each of ``wanted``'s names to the checkpoint's. None otherwise."""
    split_stored, split_wanted = (
        bool(names) and all(_STAGE_PREFIX.match(k) for k in names) for names in (stored, wanted)
    )
    if split_stored == split_wanted:
        return None
    plain_stored = {_STAGE_PREFIX.sub("", k) if split_stored else k: k for k in stored}
    plain_wanted = {_STAGE_PREFIX.sub("", k) if split_wanted else k: k for k in wanted}
    if len(plain_stored) != len(stored) or len(plain_wanted) != len(wanted):
        return None  # two stages held a parameter of one name: not one model's parameters
    if describe_layout_difference(
        {k: stored[v] for k, v in plain_stored.items()}, {k: wanted[v] for k, v in plain_wanted.items()}
    ):
        return None
    return {name: plain_stored[plain] for plain, name in plain_wanted.items()}


def _renamed_optim_key(key: str, names: dict[str, str]) -> str:
    """A flattened optimizer key (``state.<param>.<stat>``, ``param_groups.<param>.<setting>``)
    under the checkpoint's parameter name."""
    section, _, rest = key.partition(".")
    param, _, leaf = rest.rpartition(".")
    return f"{section}.{names[param]}.{leaf}" if param in names else key


def _under_names(state_dict: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state_dict`` ({"model": ..., "optim": ...}) with its parameter names replaced by the
    checkpoint's; the values are the same objects, so tensors load in place."""
    out = {"model": {names[k]: v for k, v in state_dict["model"].items()}}
    if "optim" in state_dict:
        out["optim"] = {_renamed_optim_key(k, names): v for k, v in state_dict["optim"].items()}
    return out


def _back_to_names(loaded: dict[str, Any], state_dict: dict[str, Any], names: dict[str, str]) -> None:
    """Copy what DCP loaded under the checkpoint's names back into ``state_dict``."""
    for k in state_dict["model"]:
        state_dict["model"][k] = loaded["model"][names[k]]
    if "optim" in state_dict:
        for k in state_dict["optim"]:
            state_dict["optim"][k] = loaded["optim"][_renamed_optim_key(k, names)]


def describe_layout_difference(stored: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
    """How a checkpoint's model parameters (name -> shape) differ from a model's, in a few words
    (a pipeline split, layer counts, shapes), or None when they match. Used for the error that
    refuses to load another layout."""
    if stored == wanted:
        return None
    parts: list[str] = []
    split_stored, split_wanted = (
        bool(names) and all(_STAGE_PREFIX.match(k) for k in names) for names in (stored, wanted)
    )
    if split_stored != split_wanted:
        parts.append(
            "it was written by a pipeline-parallel run (parameters under stage prefixes) and this model is "
            "not split into stages (distributed.pp_size=1)"
            if split_stored
            else "it was written without pipeline stages and this model is split into stages "
            "(distributed.pp_size > 1)"
        )

    def plain(names: dict[str, tuple]) -> dict[str, tuple]:
        return {_STAGE_PREFIX.sub("", k) if split_stored != split_wanted else k: v for k, v in names.items()}

    a, b = plain(stored), plain(wanted)
    for container in sorted({m.group(1) for k in (*a, *b) if (m := _NUMBERED.match(k))}):
        counts = [
            len({m.group(2) for k in names if (m := _NUMBERED.match(k)) and m.group(1) == container})
            for names in (a, b)
        ]
        if counts[0] != counts[1]:
            parts.append(f"{container}: {counts[0]} in the checkpoint, {counts[1]} in this model")
    shapes = [f"{k} {a[k]} vs {b[k]}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    if shapes:
        more = f" (+{len(shapes) - 3} more)" if len(shapes) > 3 else ""
        parts.append(f"shapes (checkpoint vs this model): {', '.join(shapes[:3])}{more}")
    if not parts:
        missing, unexpected = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        for label, keys in (("not in the checkpoint", missing), ("not in this model", unexpected)):
            if keys:
                more = " ..." if len(keys) > 3 else ""
                parts.append(f"{len(keys)} parameters {label} ({', '.join(keys[:3])}{more})")
    return "; ".join(parts) if parts else None


def _stage_then_write(
    stager: Any, state_dict: dict[str, Any], staged: Future, kwargs: dict[str, Any]
) -> None:
    """On the writer thread: copy the state to host memory and resolve ``staged`` (from then on
    training may change the state), then write the copy with DCP."""
    try:
        with torch.no_grad():
            host = stager.stage(state_dict)
    except BaseException as e:
        staged.set_exception(e)
        raise
    staged.set_result(None)
    with _quiet_single_process():
        dcp.save(host, **kwargs)


def _trained_entries(model_sd: dict[str, Any], optim_sd: dict[str, Any], model: torch.nn.Module) -> set[str]:
    """The entries whose values decide whether a saved state is known-good, by the names DCP gives
    them (``model.<param>``, ``optim.<key>``): the parameters and the optimizer's floating-point
    state. Buffers are left out: a mask buffer may hold -inf on purpose."""
    params = {_local(p).data_ptr() for p in model.parameters()}
    entries = {
        f"model.{key}"
        for key, value in model_sd.items()
        if isinstance(value, torch.Tensor) and _local(value).data_ptr() in params
    }
    entries.update(
        f"optim.{key}"
        for key, value in optim_sd.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    )
    return entries


def _wait_quietly(future: Future, timeout: float) -> None:
    with contextlib.suppress(Exception):  # the caller reports the error that matters
        future.result(timeout=timeout)


def _delete_trees(paths: list[str]) -> None:
    for path in paths:
        _delete_tree(path)


def _delete_tree(path: str) -> None:
    """Delete ``path`` (inside the checkpoint directory) and nothing outside it: a symbolic link is
    removed itself, never followed (a linked step directory's target belongs to someone else), and
    links inside a directory are removed as links."""
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def _copy_buffers(model_sd: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``model_sd`` with every tensor that is not a parameter (buffers such as BatchNorm statistics,
    which a forward changes) replaced by a copy taken now; parameters stay shared for staging."""
    params = {_local(p).data_ptr() for p in model.parameters()}
    return {
        key: value.detach().clone()
        if isinstance(value, torch.Tensor) and _local(value).data_ptr() not in params
        else value
        for key, value in model_sd.items()
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns on every save/load (also from its writer thread) that it
    # assumes one process, which is what we mean: silence exactly that message.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    yield


def _last_line(error: BaseException) -> str:
    """The gist of an error: DCP's CheckpointException carries every rank's traceback, last line last."""
    text = str(error).strip()
    return text.splitlines()[-1] if text else repr(error)


def _reraise_interrupt(error: BaseException) -> None:
    """A Ctrl-C or exit that reached DCP stays what it is: never a CheckpointError."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        raise error
    failures = getattr(error, "failures", None) if isinstance(error, CheckpointException) else None
    for failure in (failures or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            raise type(inner)() from error


def _check_writable(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-test-{uuid.uuid4().hex}")  # unique across nodes too
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(
            "checkpoint.directory",
            f"{directory} is not a writable directory ({e}); "
            "pass a directory this process can create and write",
        ) from None


def _check_loadable(path: str, field: str) -> str:
    """The complete checkpoint ``path`` names (itself, or the newest complete one in a directory of
    checkpoints); a CheckpointError naming ``field`` otherwise."""
    try:
        return io.resolve_checkpoint(path)[0]
    except CheckpointError as e:
        raise CheckpointError(f"{field}: {e}") from None


def _not_finite(path: str) -> bool:
    """Whether checkpoint ``path``'s marker records NaN/Inf in its saved parameters or optimizer
    state (markers of earlier versions record nothing: they count as finite)."""
    try:
        return io.read_marker(path).get("finite", True) is False
    except CheckpointError:
        return False  # verification reports the damaged marker


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The plain numbers among ``metrics`` (0-dim tensors read once), for the checkpoint."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(key, str):
            out[key] = float(value)
    return out
