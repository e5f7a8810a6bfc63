"""The events a :class:`~engine.Trainer` fires, in one namespace.

Where ignite already has the moment, the name is an alias of ignite's member, so an ignite handler
and a hookloop handler attached to "the same" event see one firing, not two. The moments ignite
lacks are members of :class:`StepEvents`, fired from inside the step body.

Where each event fires, as a sketch of the loop (``state.step`` is 1-based from STEP_START on)::

    fire(TRAIN_START)                      # resume happens here (checkpointer runs first)
    while not done:
        state.epoch += 1
        fire(EPOCH_START)
        for microbatches in steps_of(data):    # grad_accum_steps microbatches each
            state.step += 1
            fire(STEP_START)                   # microbatches fetched, nothing computed
            for i, mb in enumerate(microbatches):
                loss = loss_fn(model(x), y) / len(microbatches)
                loss.backward()                # gradients sync on the last microbatch only
                fire(MICROBATCH)               # state.microbatch == i, state.microbatch_loss
            state.loss = mean over microbatches and data-parallel ranks
            state.grad_norm = total norm (before clipping); clip
            fire(BEFORE_OPTIMIZER_STEP)        # a handler may set state.skip_step (the veto)
            if not agreed_by_any_rank(state.skip_step):
                optimizer.step(); lr_scheduler.step()
            optimizer.zero_grad()
            fire(STEP_END)                     # metrics in state
            maybe validate -> fire(VALIDATION_END)
            if agreed_by_any_rank(state.should_stop): stop
        fire(EPOCH_END)
    fire(TRAIN_END)                            # on error: fire(EXCEPTION), then re-raise

Every ignite filter works on every event: ``Events.STEP_END(every=10)``, ``Events.MICROBATCH(once=3)``,
``Events.STEP_START(event_filter=f)``.
"""

from __future__ import annotations

from ignite.engine import Events as IgniteEvents
from ignite.engine.events import EventEnum

__all__ = ["Events", "StepEvents", "STEP_EVENT_TO_ATTR"]


class StepEvents(EventEnum):
    """Moments that ignite's loop has no member for; the trainer fires them itself."""

    MICROBATCH = "microbatch"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    VALIDATION_END = "validation_end"
    CHECKPOINT_SAVED = "checkpoint_saved"
    ROLLBACK = "rollback"


# The state counter each custom event's filters read (``every=``, ``once=``); the trainer
# increments each one right before it fires the event.
STEP_EVENT_TO_ATTR = {
    StepEvents.MICROBATCH: "microbatches_seen",
    StepEvents.BEFORE_OPTIMIZER_STEP: "iteration",
    StepEvents.VALIDATION_END: "validations",
    StepEvents.CHECKPOINT_SAVED: "checkpoints_saved",
    StepEvents.ROLLBACK: "rollbacks",
}


class Events:
    """All trainer events. Aliases of ignite's members where ignite has the moment."""

    TRAIN_START = IgniteEvents.STARTED
    EPOCH_START = IgniteEvents.EPOCH_STARTED
    STEP_START = IgniteEvents.ITERATION_STARTED
    MICROBATCH = StepEvents.MICROBATCH
    BEFORE_OPTIMIZER_STEP = StepEvents.BEFORE_OPTIMIZER_STEP
    STEP_END = IgniteEvents.ITERATION_COMPLETED
    VALIDATION_END = StepEvents.VALIDATION_END
    CHECKPOINT_SAVED = StepEvents.CHECKPOINT_SAVED
    ROLLBACK = StepEvents.ROLLBACK
    EPOCH_END = IgniteEvents.EPOCH_COMPLETED
    TRAIN_END = IgniteEvents.COMPLETED
    EXCEPTION = IgniteEvents.EXCEPTION_RAISED
    TERMINATE = IgniteEvents.TERMINATE
