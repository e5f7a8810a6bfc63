"""Where every shipped handler runs, by name: :class:`Places`.

The engine's :class:`~hookloop.engine.Priority` names only the phases of an event (``CLOCK``,
``RESTORE``, ``OBSERVE``, ``DECIDE``, ``ACT``, ``DEFAULT``, ``RECORD``, ``CLEANUP``); each shipped
handler's module defines its own place inside one of them (``checkpoint.CHECKPOINT =
Priority.ACT``), a :class:`~hookloop.engine.Place` that cannot leave its phase. This table gathers
those places under the names they have always had, so a handler can be placed relative to a shipped
one::

    from hookloop.handlers import Places

    trainer.on(Events.STEP_END, priority=Places.CHECKPOINT + 1)   # in ACT, just before the save

The whole order, event by event, is in ``docs/concepts.md`` ("The order of a step").
"""

from __future__ import annotations

from hookloop.handlers import (
    checkpoint,
    console,
    curriculum,
    dataset_metrics,
    health_check,
    jsonl_logger,
    metric_logger,
    metrics,
    nan_detector,
    profiler,
    step_scheduler,
    straggler,
    tensorboard_logger,
    wandb_logger,
)

__all__ = ["Places"]


class Places:
    """The place of every shipped handler on the events it attaches to (higher runs first). Each is
    a :class:`~hookloop.engine.Place` inside one of the engine's phases (``Places.CHECKPOINT.phase ==
    "ACT"``); ``Places.CHECKPOINT + 1`` stays in that phase."""

    PROFILE = profiler.PROFILE
    ROLLBACK_COUNT = nan_detector.ROLLBACK_COUNT
    TIME = metrics.TIME
    TIME_STRAGGLER = straggler.TIME_STRAGGLER
    RESUME = checkpoint.RESUME
    HEALTH = health_check.HEALTH
    EXIT_CHECK = step_scheduler.EXIT_CHECK
    PUBLISH = metrics.PUBLISH
    ALIGN_PHASE = curriculum.ALIGN_PHASE
    PHASE = curriculum.PHASE
    DATASET_METRICS = dataset_metrics.DATASET_METRICS
    DATASET_METRICS_END = dataset_metrics.DATASET_METRICS_END
    SCHEDULE = step_scheduler.SCHEDULE
    TRACK_END = metrics.TRACK_END
    STRAGGLER = straggler.STRAGGLER
    NAN_CHECK = nan_detector.NAN_CHECK
    CHECKPOINT = checkpoint.CHECKPOINT
    TRACK = metrics.TRACK
    ALIGN_AFTER_RESTORE = curriculum.ALIGN_AFTER_RESTORE
    LOG_JSONL = jsonl_logger.LOG_JSONL
    LOG_TENSORBOARD = tensorboard_logger.LOG_TENSORBOARD
    LOG_WANDB = wandb_logger.LOG_WANDB
    LOG_CONSOLE = console.LOG_CONSOLE
    LOG = metric_logger.LOG
    ROLLBACK_REQUEST = nan_detector.ROLLBACK_REQUEST
    STAGING_WAIT = checkpoint.STAGING_WAIT
    CAPTURE = checkpoint.CAPTURE
    PROFILE_END = profiler.PROFILE_END
    ROLLBACK_DONE = nan_detector.ROLLBACK_DONE
