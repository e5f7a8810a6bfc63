"""What a checkpoint holds per rank beside DCP's model and optimizer: the trainer's counters, the
LR scheduler, every stateful handler's state, the data position and the RNG states, as one JSON
file (``rank_NNNNN.json``); and putting all of it back into a running trainer (resume, rollback),
handler tensor state (:mod:`.handler_tensors`, through DCP) included."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hookloop.engine import parallel, run_snapshot
from hookloop.engine.checkpoint_format.directory import parse_step
from hookloop.engine.checkpoint_format.errors import CheckpointError, CheckpointLayoutError
from hookloop.engine.checkpoint_format.state_codec import decode
from hookloop.engine.errors import ConfigError
from hookloop.handlers.checkpoint import handler_tensors
from hookloop.handlers.checkpoint.dcp_calls import STATE_DICT_OPTIONS, last_line
from hookloop.handlers.checkpoint.rank_file import FORMAT, VERSION, rank_file, read_rank_file
from hookloop.handlers.checkpoint.reader import CheckpointReader
from hookloop.handlers.checkpoint.resume_settings import ResumePlan, ResumeSettings

__all__ = ["FORMAT", "VERSION", "RankState"]

logger = logging.getLogger("hookloop.handlers.checkpoint")


class RankState:
    """Captures this rank's state of ``trainer`` for a save and restores a checkpoint into it.

    Args:
        trainer: the trainer whose state is saved and restored.
        reader: loads the model (and optimizer) from the checkpoint, after its layout check.
        settings: records the run's settings and decides what a resume does with changed ones.
        load_optimizer: restore the optimizer state too.
    """

    def __init__(
        self,
        trainer: Any,
        reader: CheckpointReader,
        settings: ResumeSettings,
        *,
        load_optimizer: bool,
        long_wait: Callable[[], Any],
    ) -> None:
        self.trainer = trainer
        self._reader = reader
        self._settings = settings
        self.load_optimizer = load_optimizer
        self._long_wait = long_wait
        self._resumed: tuple[str, int, str | None] | None = None  # path, step, settings line: said at start

    def capture(self, step: int) -> dict[str, Any]:
        """This rank's state JSON for a save of ``step``: the trainer's snapshot
        (:mod:`engine.run_snapshot`) with what a checkpoint adds."""
        trainer, state = self.trainer, self.trainer.state
        snapshot = run_snapshot.capture(trainer)
        # This save counts itself: a run resumed from it has saved it (CHECKPOINT_SAVED fires only
        # once the save is published, after these counters were taken).
        snapshot["counters"]["checkpoints_saved"] = state.checkpoints_saved + 1
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "rank": parallel.rank(),
            "world_size": parallel.world_size(),
            **snapshot,
            # What it was trained with, so a resume can tell what changed (resume_settings).
            "settings": self._settings.capture(trainer),
        }

    def load(self, path: str, *, rollback: bool, keep_data_position: bool = False) -> int:
        """Restore ``path`` into the running trainer; any failure is a CheckpointError naming it, or
        a ConfigError naming the setting a resume refuses to change."""
        try:
            with self._long_wait():
                return self._restore(path, rollback=rollback, keep_data_position=keep_data_position)
        except (CheckpointError, ConfigError):
            raise
        except Exception as e:
            raise CheckpointError(
                f"restoring {path} failed ({type(e).__name__}: {last_line(e)}); resume with the model, "
                "optimizer and handlers that wrote it, or start fresh (checkpoint.resume=None)"
            ) from e

    def _plan(self, path: str, *, rollback: bool) -> tuple[dict[str, Any], ResumePlan]:
        """This rank's state file and what the resume does with this run's settings, decided before
        anything loads; a resume's refusal (or a state file this rank cannot read) is raised on
        every rank alike."""
        error, extra, plan = None, None, None
        try:
            extra = self._read_rank_state(path)
            scheduler = decode(extra["lr_scheduler"]) if extra.get("lr_scheduler") is not None else None
            plan = self._settings.plan(
                self.trainer,
                extra.get("settings"),
                scheduler,
                step=extra["step"],
                load_optimizer=self.load_optimizer,
            )
            error = None if rollback else plan.refusal
        except Exception as e:  # noqa: BLE001 - every rank must join the agreement below
            error = e
        if not rollback:
            self._settings.agree(error)
        elif error is not None:
            raise error
        return extra, plan

    def _restore(self, path: str, *, rollback: bool, keep_data_position: bool) -> int:
        trainer = self.trainer
        extra, plan = self._plan(path, rollback=rollback)

        def tensors(stored: dict[str, Any]) -> dict[str, Any]:
            return handler_tensors.targets(trainer, stored, path, rollback=rollback)

        try:
            if self.load_optimizer:
                model_sd, optim_sd = get_state_dict(
                    trainer.model, trainer.optimizer, options=STATE_DICT_OPTIONS
                )
                state_dict = {"model": model_sd, "optim": optim_sd}
                self._reader.load(path, state_dict, handlers=tensors)
                set_state_dict(
                    trainer.model,
                    trainer.optimizer,
                    model_state_dict=state_dict["model"],
                    optim_state_dict=state_dict["optim"],
                    options=STATE_DICT_OPTIONS,
                )
            else:
                state_dict = {"model": get_model_state_dict(trainer.model)}
                self._reader.load(path, state_dict, handlers=tensors)
                set_model_state_dict(trainer.model, state_dict["model"])
        except CheckpointLayoutError as e:  # named by the model setting that changed, if one did
            raise plan.layout_error(e) from None
        handler_tensors.restore(trainer, state_dict.get(handler_tensors.HANDLERS, {}))
        lrs = run_snapshot.apply(  # this run's hyperparameters and schedule honoured after the scheduler
            trainer,
            extra,
            resume=not rollback,
            keep_data_position=keep_data_position,
            after_scheduler=lambda: self._settings.honour(trainer, plan),
        )
        if rollback:  # a resume is said once the run has started (the checkpointer, at RUN_STARTED)
            logger.info("rolled back to %s (step %d)", path, extra["step"])
        else:  # said once the run has started, with the settings that changed since the checkpoint
            self._resumed = (path, extra["step"], plan.line(lrs))
        return extra["step"]

    def say_resumed(self) -> None:
        """Say the resume (every rank) and the settings it changed (rank 0), once the run started."""
        if self._resumed is not None:
            path, step, line = self._resumed
            logger.info("resumed from %s (step %d)", path, step)
            if line is not None and parallel.rank() == 0:
                logger.info("%s", line)
            self._resumed = None

    def check(self, path: str) -> list[str]:
        """What makes checkpoint ``path``'s state file for this rank one the restore cannot take
        (empty: none); the checkpointer treats it as damage, so the loader falls back."""
        try:
            read_rank_file(rank_file(path, parallel.rank())[0], self.trainer.state.counters(), _step_of(path))
        except CheckpointError as e:
            return [str(e)]
        return []

    def _read_rank_state(self, path: str) -> dict[str, Any]:
        own, borrowed = rank_file(path, parallel.rank())
        if borrowed:
            logger.warning(
                "%s was written by a different number of ranks: rank %d takes rank 0's data position "
                "and RNG states (a MixtureLoader or MixtureSampler position is global, so the data "
                "continues exactly; a replayed loader skips the steps done)",
                path,
                parallel.rank(),
            )
        return read_rank_file(own, self.trainer.state.counters(), _step_of(path))


def _step_of(path: str) -> int | None:
    """The step a checkpoint directory's name says (None for a name that is not ``step_N``)."""
    return parse_step(os.path.basename(os.path.normpath(path)))
