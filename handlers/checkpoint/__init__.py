"""AsyncCheckpointer: sharded, asynchronous, crash-safe checkpoints and exact resume.

What a checkpoint holds: model and optimizer through ``torch.distributed.checkpoint`` (DCP, sharded
and reshardable), and per rank as JSON: the LR scheduler, the trainer's counters, every stateful
handler registered with the trainer, the data position and the RNG states (python, numpy, torch,
CUDA, the data's own generators). The on-disk format and the safe readers are in
:mod:`hookloop.engine.checkpoint_format`.

When it saves (at STEP_END): when the control point decided a save (``trainer.control.decided.save``:
the StepScheduler's ``ckpt_every_steps`` cadence, a stop signal, a user's ``request_save``), at the
last step, when the run stops on request (``control.decided.stop`` with a resumable exit code), and
at TRAIN_END if the last step was not saved yet; never twice for one step. It counts no steps. The
decision is agreed across ranks; who asked is logged and kept as ``requested_by`` in each rank's
state file.

What a handler that judges the state (a NaN detector) knows reaches the checkpointer through the
trainer's save policy (``trainer.save_policy``, :mod:`hookloop.engine.save_policy`), never through
the handler itself: no save starts or is published while ``saves_held``; pruning keeps the newest
finite checkpoint at or before ``protected_step``; a fresh run saves step 0 first when
``initial_save_due(0)``.

Modes (``mode=``):

* ``"async"`` (the default): the save call returns at once; the checkpointer's writer thread writes
  the state with ``dcp.save`` on a gloo process group of its own, plain CPU tensors straight from
  the live state (``host_copy``), a CUDA or sharded state after copying it to host memory (DCP's
  stager, buffers reused from save to save, pinned with CUDA). Training waits only where it must
  (the staging-wait contract): right before the next ``optimizer.step`` (parameters and optimizer
  state must not change while they are read; what the writer has not reached is copied then), and
  before any load, rollback, next save or drain. Model buffers (which a forward may change, e.g.
  BatchNorm statistics) are copied at the save itself. ``"async_staged"`` is the old name of this
  mode and still accepted.
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
to save or load leaves as a ``CheckpointError`` naming the path (the errors are defined in
:mod:`hookloop.engine.checkpoint_format.errors` and named here for users).

The package is a few rooms, each owning its state, and a thin handler:

* :mod:`.config`: the ``checkpoint`` section and :class:`AsyncMode`;
* :mod:`.session`: the checkpoint process group, the session id and the background threads;
* :mod:`.writer`: the save in flight (starting, staging, waiting, publishing through the store);
* :mod:`.store`: the directory (marker, ``latest``, pruning, the ranking metric, candidates);
* :mod:`.reader`: choosing, verifying and loading a checkpoint; :mod:`.model_layout`: parameter
  names across a pipeline split and how a checkpoint's model layout differs from this model's;
* :mod:`.rank_state`: the per-rank state JSON (counters, LR scheduler, handlers, data, RNG);
  :mod:`.rank_file`: reading one without trusting it;
* :mod:`.resume_settings`: the settings a checkpoint records and what a resume does with a changed
  one (takes effect and is said, or is refused by name before anything loads);
* :mod:`.handler`: :class:`AsyncCheckpointer`, which wires events and policy to the rooms.
"""

from hookloop.engine.checkpoint_format.errors import (
    CheckpointError,
    CheckpointIndexBoundError,
    CheckpointLayoutError,
)
from hookloop.handlers.checkpoint.handler import CAPTURE, CHECKPOINT, RESUME, STAGING_WAIT, AsyncCheckpointer
from hookloop.handlers.checkpoint.model_layout import describe_layout_difference
from hookloop.handlers.checkpoint.resume_settings import Recorded
from hookloop.handlers.sections.checkpoint import AsyncMode, CheckpointConfig

__all__ = [
    "CAPTURE",
    "CHECKPOINT",
    "RESUME",
    "STAGING_WAIT",
    "AsyncCheckpointer",
    "AsyncMode",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointIndexBoundError",
    "CheckpointLayoutError",
    "Recorded",
    "describe_layout_difference",
]
