"""Where every shipped handler runs, by name: :class:`Places`.

The engine's :class:`~hookloop.engine.Priority` names only the phases of an event (``CLOCK``,
``RESTORE``, ``OBSERVE``, ``DECIDE``, ``ACT``, ``DEFAULT``, ``RECORD``, ``CLEANUP``); each shipped
handler's module defines its own place inside one of them (``checkpoint.CHECKPOINT =
Priority.ACT``), a :class:`~hookloop.engine.Place` that cannot leave its phase. This table gathers
those places under their names, so a handler can be placed relative to a shipped
one::

    from hookloop.handlers import Places

    trainer.on(Events.STEP_END, priority=Places.CHECKPOINT + 1)   # in ACT, just before the save

The whole order of a run, event by event, is printed by the code: ``trainer.describe()`` (and
``hookloop check CONFIG --order``).
"""

from __future__ import annotations

from hookloop.engine.events import Place
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
    """The place of every shipped handler on the events it attaches to (higher runs first), each
    gathered from its module under the name it has there (see the module docstring)."""


_MODULES = (checkpoint, console, curriculum, dataset_metrics, health_check, jsonl_logger,
            metric_logger, metrics, nan_detector, profiler, step_scheduler, straggler,
            tensorboard_logger, wandb_logger)  # fmt: skip
for _module in _MODULES:
    for _name, _place in vars(_module).items():
        if isinstance(_place, Place):
            setattr(Places, _name, _place)
