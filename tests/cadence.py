"""Save and validation cadences on a bare Trainer (no StepScheduler): what
``StepScheduler(ckpt_every_steps=n)`` and ``StepScheduler(val_every_steps=n)`` ask for, requested on
the trainer's control point with the engine's one interval rule."""

from __future__ import annotations

from typing import Any

from hookloop.engine.events import Events, every


def save_every(trainer: Any, n: int) -> None:
    """Request a save every ``n`` steps (the checkpointer counts no steps)."""

    def ask() -> None:
        if every(n, trainer.state.step):
            trainer.control.request_save(f"every {n} steps")

    trainer.add_event_handler(Events.STEP_START, ask)


def validate_every(trainer: Any, n: int) -> None:
    """Request a validation every ``n`` steps (the validator counts no steps)."""

    def ask() -> None:
        if every(n, trainer.state.step):
            trainer.control.request_validate()

    trainer.add_event_handler(Events.STEP_START, ask)
