"""The core engine: an ignite ``Engine`` whose iteration is one optimizer step.

Everything a run needs beyond the step itself (scheduling, checkpoints, NaN handling, logging) is a
handler attached to a :class:`Trainer`. Here is the loop itself: the constructor's wiring, the
events, running and stopping, and the step's tail (BEFORE_OPTIMIZER_STEP, clipping, optimizer, LR
scheduler). Each other part is a room of its own the trainer holds: the step body
(:mod:`engine.step_body`), validation through it (:mod:`engine.validation`), the control point and
the step's decisions (:mod:`engine.control`, :mod:`engine.step_decisions`), the save policy
(:mod:`engine.save_policy`), the run's limits, start and end (:mod:`engine.run_limits`,
:mod:`engine.run_start`, :mod:`engine.run_end`), the error path (:mod:`engine.error_path`) and the
handler registry (:mod:`engine.handler_registry`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from ignite.engine import Engine

from hookloop.engine import parallel, run_limits, tensor_parallel
from hookloop.engine.agreement import StepAgreement
from hookloop.engine.batch import default_prepare_batch
from hookloop.engine.control import StepControl, shared_stop_reason
from hookloop.engine.error_path import ErrorPath
from hookloop.engine.events import (
    STEP_EVENT_TO_ATTR,
    EventHandle,
    EventRegistry,
    Events,
    Priority,
    StepEvents,
)
from hookloop.engine.exit_codes import ExitCode
from hookloop.engine.handler_registry import HandlerRegistry
from hookloop.engine.ignite_adapter import IgniteAdapter
from hookloop.engine.lr import ScheduledRates
from hookloop.engine.precision import AUTOCAST_DTYPES
from hookloop.engine.rank_failure import clear_failure
from hookloop.engine.run_end import RunEnd
from hookloop.engine.run_start import RunStart
from hookloop.engine.save_policy import SavePolicy
from hookloop.engine.state import StateAttribute, TrainState
from hookloop.engine.step_batches import NO_DATA, StepBatches
from hookloop.engine.step_body import (
    StepBody,
    StepContext,
    StepResult,
    accumulation,
    bind_step_body,
    checked_result,
)
from hookloop.engine.step_decisions import StepDecisions
from hookloop.engine.trainer_arguments import check_constructor_arguments
from hookloop.engine.validation import Validator
from hookloop.engine.watchdog import PeerHeartbeats, ProgressWatchdog

__all__ = ["Trainer", "default_prepare_batch"]

logger = logging.getLogger(__name__)

PrepareBatch = Callable[[Any, torch.device], tuple[Any, Any]]

_NO_CONTEXT = contextlib.nullcontext()
_UNSET = object()
#: Default bound of the progress watchdog: longer than any healthy gap between two events.
DEFAULT_HANG_TIMEOUT_S = 1800.0
H = TypeVar("H")


class Trainer(IgniteAdapter):
    """A hook-based training loop on ignite: one ignite iteration is one optimizer step.

    Args:
        model: the module to train (plain, DDP- or FSDP2-wrapped).
        optimizer: a torch optimizer over ``model``'s parameters.
        loss_fn: ``loss_fn(model(inputs), targets) -> scalar tensor``; None: the model computes its
            own loss (``output.loss``) from dict microbatches holding ``labels`` (the Hugging Face
            convention, see :mod:`engine.batch`). A ``step_body`` of your own may use it or not.
        lr_scheduler: stepped after every optimizer step that was not vetoed; ``rates``
            (:class:`engine.lr.ScheduledRates`) is the one writer of the groups' rates.
        grad_accum_steps: microbatches per optimizer step (>= 1).
        grad_clip_norm: clip the total gradient norm to this value; ``None`` measures only.
        prepare_batch: ``prepare_batch(microbatch, device) -> (inputs, targets)``; dict inputs go to
            the model as keyword arguments (:func:`engine.batch.default_prepare_batch`).
        device: where batches go; defaults to the device of the model's first parameter.
        step_body: what runs the step's forward and backward and validation's forward
            (:mod:`engine.step_body`; None: a ``LocalStepBody`` over ``model``): a body of your own,
            or the pipeline runtime ``build_pipeline`` returns (``model`` is then
            ``runtime.module``); a body that declares ``n_microbatches`` sets ``grad_accum_steps``.
        run_dir: where the run writes ``exit_status.json`` (rank 0, on every exit) and, when the
            watchdog fires, every thread's stack, once the run has started (RUN_STARTED: a start
            that fails writes neither). None: neither file is written (stacks go to stderr).
        hang_timeout_s: end the process with exit code 77 when the loop makes no progress (no event,
            no microbatch) for this many seconds, e.g. a peer stopped mid-collective; None disables
            the watchdog. A health check tightens the bound to its own ``timeout_s``.
        graceful_sigint: the first Ctrl-C (SIGINT) during ``run()`` asks for a stop after the
            current step with a final checkpoint (exit code 75, agreed across ranks); a second one
            interrupts at once (``KeyboardInterrupt``). False: Python's default, a traceback.
        precision: ``"fp32"``; ``"bf16-mixed"`` (forward and loss under ``torch.autocast`` to
            bfloat16, in training and validation); ``"fp16-mixed"`` (autocast to float16 plus a
            ``torch.amp.GradScaler``, checkpointed as ``"grad_scaler"``: an overflow skips the step
            on every rank and sets ``state.grad_scaler_overflow``).
        tp_mesh: the tensor-parallel mesh dimension when ``model`` is tensor-parallel
            (:func:`engine.tensor_parallel.apply_tensor_parallel`): the ranks of one ``tp`` group
            see the same samples, so only its first rank counts them (tokens, samples, MFU). None:
            found from the parameters (a DTensor mesh dimension named ``"tp"``), else no TP.
        loss_parallel: the model's output is a DTensor sharded over the vocabulary (a plan that
            leaves the head's logits sharded) and ``loss_fn`` computes the cross entropy on the
            shards: forward, loss and backward run under torch's ``loss_parallel()`` context, and
            MICROBATCH handlers and the validation see the gathered output. Not with a pipeline.
    """

    state = StateAttribute()  # type: ignore[assignment]

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        lr_scheduler: Any | None = None,
        grad_accum_steps: int = 1,
        grad_clip_norm: float | None = None,
        prepare_batch: PrepareBatch | None = None,
        device: torch.device | str | None = None,
        run_dir: str | os.PathLike | None = None,
        hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S,
        graceful_sigint: bool = True,
        precision: str = "fp32",
        tp_mesh: Any | None = None,
        loss_parallel: bool = False,
        step_body: StepBody | None = None,
        **removed: Any,
    ) -> None:
        check_constructor_arguments(
            model,
            optimizer,
            loss_fn,
            prepare_batch=prepare_batch,
            grad_clip_norm=grad_clip_norm,
            precision=precision,
            hang_timeout_s=hang_timeout_s,
            step_body=step_body,
            removed=removed,
        )
        #: Where the run is and where it ends (:mod:`engine.run_limits`): limits, accumulation, position.
        self.plan = run_limits.RunPlan(self, accumulation(step_body, grad_accum_steps))
        self.loss_parallel = bool(loss_parallel)
        #: The step's control point, the trainer's one: handlers request skip / save / validate / stop /
        #: rollback here, and read what every rank agreed in ``control.decided`` (:mod:`engine.control`).
        self.control = StepControl()
        self.events = EventRegistry(self)
        super().__init__(self._run_step)
        # ignite logs every error it routes to the error path (twice, for the inner and outer loop);
        # the trainer reports and re-raises errors itself, so ignite's own lines stay quiet unless
        # a user lowers this logger's level.
        self.logger = logging.getLogger(f"{__name__}.ignite")
        if self.logger.level == logging.NOTSET:
            self.logger.setLevel(logging.CRITICAL)
        self.state = TrainState()
        self.register_events(*StepEvents, event_to_attr=STEP_EVENT_TO_ATTR)
        self._fire_counters: dict[int, str | None] = {}
        #: The attached handlers and what every checkpoint holds (:mod:`engine.handler_registry`).
        self.registry = HandlerRegistry()

        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_scheduler = lr_scheduler
        self.rates = ScheduledRates(self)
        self.grad_clip_norm = grad_clip_norm
        self.prepare_batch: PrepareBatch = prepare_batch or default_prepare_batch
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.precision = precision
        self._autocast_dtype = AUTOCAST_DTYPES[precision]
        self.grad_scaler: torch.amp.GradScaler | None = None
        if precision == "fp16-mixed":
            self.grad_scaler = torch.amp.GradScaler(self.device.type)
            self.register_stateful("grad_scaler", self.grad_scaler)
        self.step_data = StepBatches(None, lambda: self.grad_accum_steps)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.tp_mesh = tp_mesh if tp_mesh is not None else tensor_parallel.find_tp_mesh(self._params)
        #: 1 on the rank of a tensor-parallel group that counts the group's samples and tokens, else 0.
        self.count_share = 1 if self.tp_mesh is None or self.tp_mesh.get_local_rank() == 0 else 0
        #: What runs a step's forward and backward (:mod:`engine.step_body`): ``step_body`` (the
        #: user's, or the pipeline runtime), else a :class:`~engine.step_body.LocalStepBody`.
        self.step_body: StepBody = bind_step_body(
            step_body,
            model,
            self._params,
            loss_fn=loss_fn,
            tp_mesh=self.tp_mesh,
            grad_scaler=self.grad_scaler,
            loss_parallel=self.loss_parallel,
        )
        #: What the step body sees of the trainer.
        self.step_context = StepContext(self)
        #: Validation: its data, metrics and evaluator (:mod:`engine.validation`).
        self.validator = Validator(self)
        self._skip_completed = False
        self.watchdog: ProgressWatchdog | None = None
        if hang_timeout_s is not None:  # its stack dumps go to run_dir once the run has started
            self.watchdog = ProgressWatchdog(hang_timeout_s, rank=parallel.rank())
            self.watchdog.on_expire.append(
                lambda reason: self.write_exit_status(int(ExitCode.HEALTH_CHECK_FAILED), reason)
            )

        self.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=Priority.ENGINE_FIRST)
        self.add_event_handler(Events.TRAIN_START, self._agree_start, priority=Priority.ENGINE_LAST)
        self.add_event_handler(Events.EPOCH_START, self._start_epoch, priority=Priority.ENGINE_LAST)
        self.add_event_handler(Events.STEP_END, self._maybe_validate, priority=Priority.VALIDATION)
        self.add_event_handler(Events.STEP_END, self._end_step, priority=Priority.ENGINE_LAST)
        self.add_event_handler(Events.EPOCH_END, self._end_epoch, priority=Priority.ENGINE_LAST)
        #: Handlers' slots in the step's one all-reduce and who takes part, its ``transport`` (see
        #: :mod:`engine.agreement`).
        self.agreement = StepAgreement()
        #: What handlers that judge the state tell handlers that save it (:mod:`engine.save_policy`).
        self.save_policy = SavePolicy()
        #: Where the step's requests become decisions (:mod:`engine.step_decisions`).
        self.step_decisions = StepDecisions(
            self.control,
            self.agreement,
            lambda: self.state,
            self.events,
            self.fire,
            self.validator.vote,
            self,
        )
        #: Whether the run has started (:mod:`engine.run_start`): RUN_STARTED fired, every rank agreed.
        self.run_start = RunStart(self.control)
        #: How the run ends (:mod:`engine.run_end`): stop signals, Ctrl-C and ``exit_status.json``.
        self.run_end = RunEnd(
            self.control,
            self.run_start,
            lambda: self.state,
            run_dir,
            graceful_sigint=graceful_sigint,
            agreement=self.agreement,
            plan=self.plan,
        )
        #: Where every error of a run goes (:mod:`engine.error_path`): EXCEPTION, TRAIN_FAILED.
        self.error_path = ErrorPath(
            self.events,
            self.run_start,
            self.control,
            lambda: self.state,
            lambda: self.optimizer.zero_grad(set_to_none=True),
            self.limits_reached,
        )

    #: The run plan's (:class:`engine.run_limits.RunPlan`): microbatches per step, default limits.
    grad_accum_steps = run_limits.PlanAttribute()
    max_steps = run_limits.PlanAttribute()
    max_epochs = run_limits.PlanAttribute()

    @property
    def collective_device(self) -> torch.device:
        """Where tensors for a collective over the trainer's ranks must live (CPU for gloo)."""
        return parallel.collective_device()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward and loss run under: ``torch.autocast`` to the precision's dtype, or
        one shared no-op context for fp32 (nothing entered, nothing allocated)."""
        if self._autocast_dtype is None:
            return _NO_CONTEXT
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """The context a microbatch's forward, loss and backward run under: torch's
        ``loss_parallel()`` with ``loss_parallel=True``, else one shared no-op context."""
        if not self.loss_parallel:
            return _NO_CONTEXT
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def set_validation(
        self,
        data: Iterable,
        eval_iters: int | None = None,
        every_steps: int | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        dp_group: Any = None,
    ) -> None:
        """Validate on ``data`` at the steps where any rank asked (``control.request_validate()``;
        the step scheduler asks every ``val_every_steps`` steps); at most ``eval_iters`` batches.
        ``every_steps`` was removed (an error naming its replacement).

        ``metrics``: name -> ignite ``Metric``, fed ``(model_output, targets)`` of every validation
        microbatch and published as ``state.metrics["val_<name>"]``, reduced over the data-parallel
        ranks only. ``dp_group``: those ranks (a process group or a 1-D device mesh such as
        ``info.mesh_dim("dp")``); None: found from the layout (see :mod:`engine.validation`)."""
        self.validator.configure(data, eval_iters, every_steps, metrics, dp_group)

    def add_event_handler(  # type: ignore[override]
        self,
        event_name: Any,
        handler: Callable,
        *args: Any,
        priority: float = Priority.DEFAULT,
        **kwargs: Any,
    ) -> EventHandle:
        """ignite's ``add_event_handler`` plus ``priority``: a :class:`engine.Place` inside a phase of
        :class:`engine.Priority` (higher runs earlier, ties in attach order); a number: DEFAULT + it."""
        return self.events.add(event_name, handler, args, kwargs, priority)

    def has_event_handler(self, handler: Callable, event_name: Any | None = None) -> bool:
        return self.events.has(handler, event_name)

    def remove_event_handler(self, handler: Callable, event_name: Any) -> None:
        self.events.remove(handler, event_name)

    def has_event_handler_for(self, event: Any) -> bool:
        """Whether any handler is attached to ``event``."""
        return self.events.any_for(event)

    def fire(self, event: StepEvents, *args: Any, **kwargs: Any) -> None:
        """Fire a custom event, advancing the counter its filters read."""
        attr = self._fire_counters.get(id(event), _UNSET)
        if attr is _UNSET:  # once per event: members hash slowly, so look up by identity after
            attr = STEP_EVENT_TO_ATTR.get(event) or self.state.event_to_attr.get(event)
            attr = None if attr in ("iteration", "epoch") else attr
            if isinstance(event, StepEvents):
                self._fire_counters[id(event)] = attr
        if attr is not None:
            setattr(self.state, attr, getattr(self.state, attr) + 1)
        try:
            self.dispatch(event, *args, **kwargs)
        finally:
            if event is Events.ROLLBACK:  # a fired ROLLBACK uses up the rollback request, whoever fired it
                self.control.rollback = None

    def register_handler(self, handler: Any, key: str | None = None) -> None:
        """Record ``handler`` as attached: :meth:`get_handler` finds it, and when it is stateful
        every checkpoint holds it under ``key`` (default: its ``state_key``, else its class name;
        see :mod:`engine.handler_registry`)."""
        self.registry.register(handler, key)

    def register_stateful(self, key: str, obj: Any) -> None:
        """Register ``obj`` (with ``state_dict``/``load_state_dict``) so checkpoints hold it under
        ``key``. Two different objects claiming one key is an error, not a silent overwrite."""
        self.registry.register_stateful(key, obj)

    @property
    def stateful(self) -> dict[str, Any]:
        """Registered stateful objects by key (a copy)."""
        return self.registry.stateful

    @property
    def handlers(self) -> tuple[Any, ...]:
        """The registered handlers, in attach order."""
        return self.registry.handlers

    def describe(self) -> str:
        """Every event's handlers in the order they run (:meth:`engine.events.EventRegistry.describe`)."""
        return self.events.describe()

    def get_handler(self, kind: type[H] | str, default: Any = None) -> H | Any:
        """The attached handler of type ``kind`` (the first one, subclasses included), or the one
        registered under the state key ``kind``; ``default`` when there is none."""
        return self.registry.get(kind, default)

    def agree_any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (one small all-reduce)."""
        return parallel.agree_any(flag)

    def terminate(self, skip_completed: bool = False) -> None:
        """Stop the run, agreed across ranks (ignite's ``terminate`` as a stop request).

        A request on :attr:`control` like any other stop: called from a handler, it takes effect
        after the current step (or right after the current TRAIN_START / EPOCH_START / EPOCH_END
        handlers), on every rank at once; ``control.stop_reason`` names the caller and
        ``control.exit_code`` stays as set (0 unless a handler asked for another)."""
        frame = sys._getframe(1)
        caller = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        self.control.request_stop(f"terminate() called by {caller}")
        self._skip_completed = self._skip_completed or skip_completed

    def _stop(self) -> None:
        """The one way a run stops, whoever asked (a handler, :meth:`terminate`, a signal, the time
        limit, a health check): called once every rank agreed to (:attr:`control` holds the
        decided stop), it ends ignite's loop after the current step or event. Every rank gives the
        reason of the rank that asked (one gather, once a run)."""
        if parallel.world_size() > 1:
            reasons = parallel.gather_objects(self.control.stop_reason)
            self.control.stop_reason = shared_stop_reason(reasons, parallel.rank())
        logger.info("stopping after step %d: %s", self.state.iteration, self.control.stop_reason)
        super().terminate(self._skip_completed)

    def _agree_boundary_stop(self) -> None:
        """The stop agreement outside a step (after TRAIN_START, EPOCH_START and EPOCH_END handlers)."""
        control = self.control
        self.run_end.poll(in_step=False)  # a noted Ctrl-C becomes a request here
        if self.agree_any(control.stop):
            control.decide_stop()
            self._stop()

    def _agree_start(self) -> None:
        """TRAIN_START's end: every rank agrees none failed (:mod:`engine.run_start`), the run has
        started (RUN_STARTED), then a stop asked for at TRAIN_START is carried out."""
        self.run_end.poll(in_step=False)
        stop = self.run_start.agree()
        if self.watchdog is not None:  # from now on a hang's stack dumps go to the run directory
            self.watchdog.dump_dir = self.run_dir
        self.fire(Events.RUN_STARTED)
        if stop:
            self.control.decide_stop()
            self._stop()

    @property
    def started(self) -> bool:
        """Whether the current run has started: RUN_STARTED fired (nothing is written before)."""
        return self.run_start.started

    def _start_epoch(self) -> None:
        self.plan.epoch_started()
        self._agree_boundary_stop()

    def _end_epoch(self) -> None:
        self.plan.epoch_ended()
        self._agree_boundary_stop()

    def run(  # type: ignore[override]
        self,
        data: Iterable | None = None,
        max_epochs: int | None = None,
        max_iters: int | None = None,
        epoch_length: int | None = None,
        *,
        max_steps: int | None = None,
    ) -> TrainState:
        """Train on ``data`` (an iterable of microbatches); ignite's ``run`` with steps.

        ``data=None`` is ignite's run without data: ``epoch_length`` steps an epoch, each on
        ``grad_accum_steps`` ``None`` microbatches that ``prepare_batch`` (or a STEP_START handler
        setting ``state.batch``) turns into the step's data.

        ``max_steps`` (keyword) and ``max_epochs`` limit the run, whichever comes first; unset, they
        default to the run plan's ``max_steps`` / ``max_epochs`` (a scheduling handler configures
        those), else one epoch. They are the state's ``max_iters`` and ``max_epochs``; ignite's
        ``max_iters`` is ``max_steps`` under ignite's rules (not together with ``max_epochs``). As
        in ignite, a run that is not finished (after ``load_state_dict``, or a larger limit than
        the last run's) continues with its epoch length; a finished one starts afresh. Returns the state;
        ``trainer.control.exit_code`` (and ``stop_reason``) tell how it ended.
        """
        continuing = self.plan.set_up(data, max_epochs, max_iters, epoch_length, max_steps)
        if self.watchdog is not None:
            self.watchdog.dump_dir = None  # stacks go to stderr until this run has started
            if self.watchdog.heartbeats is None and parallel.world_size() > 1:
                store = parallel.process_group_store()
                if store is not None:  # a long wait on one rank is progress to the others
                    self.watchdog.heartbeats = PeerHeartbeats(store, parallel.rank(), parallel.world_size())
            self.watchdog.start()
        try:
            with self.run_end.running():  # Ctrl-C stops gracefully; an error is recorded
                state = self.start_loop(data, continuing)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
        self.error_path.explain_handled_end()
        self.write_exit_status(int(self.control.exit_code), self.control.stop_reason or "finished")
        return state

    @property
    def run_dir(self) -> Path | None:
        """Where the run writes ``exit_status.json`` and a hang's stack dumps (``Trainer(run_dir=...)``)."""
        return self.run_end.run_dir

    def write_exit_status(self, code: int, reason: str, rank: int | None = None) -> None:
        """Record how the run ended in ``run_dir/exit_status.json`` (:mod:`engine.run_end`), so a
        job script can requeue on 75; ``rank``: the rank whose error ended the run."""
        self.run_end.write(code, reason, rank=rank)

    @property
    def limits(self) -> tuple[int | None, int | None]:
        """``(max_steps, max_epochs)`` of the current run (:attr:`engine.run_limits.RunPlan.limits`)."""
        return self.plan.limits

    @property
    def at_last_step(self) -> bool:
        """Whether the current step is the run's last (:attr:`engine.run_limits.RunPlan.is_last_step`)."""
        return self.plan.is_last_step

    def set_data(self, data: Iterable) -> None:
        """Switch the data source mid-run (ignite's ``set_data``): the next step's microbatches come
        from ``data``, grouped as before; the epoch length is unchanged."""
        if data is None or not isinstance(data, Iterable):
            raise TypeError(
                f"Argument data should be iterable: an iterable of microbatches, got {type(data).__name__}"
            )
        self.state.dataloader = data
        self.restart_data()

    def _step_iterator(self, data: Any) -> Iterator[list]:
        # run(None, epoch_length=N): None microbatches, as ignite's data=None
        self.step_data.data = NO_DATA if data is None else data
        return iter(self.step_data)

    def resume_at(self, epoch: int, steps_in_epoch: int, data_position: dict | None = None) -> None:
        """Put the loop back at a restored position before training starts (call at TRAIN_START):
        ``epoch`` epochs completed, ``steps_in_epoch`` steps done in the next one, and the data at
        ``data_position`` (a :meth:`StepBatches.state_dict`)."""
        self.state.epoch = epoch - 1 if steps_in_epoch > 0 else epoch
        self.position_loop(steps_in_epoch)
        if data_position is not None:
            self.step_data.load_state_dict(data_position)

    def rewind_data(self, data_position: dict) -> None:
        """Move the live data back to ``data_position`` now (a rollback that re-reads the data)."""
        self.step_data.load_state_dict(data_position)
        self.restart_data()

    def _on_train_start(self) -> None:
        clear_failure()  # a record of an earlier run in this launch's store names nothing now
        self.control.start_run()
        self.run_start.begin()
        self.step_decisions.start_run()
        self._skip_completed = False
        self.error_path.start_run()
        self.plan.start_run()

    def _end_step(self) -> None:
        """The step's end (:meth:`engine.step_decisions.StepDecisions.end_step`), then the stop every
        rank agreed to, or ignite's own end at ``max_iters``: a step count moved past it (a handler
        set it) ends the run too, not as a stop request."""
        state = self.state
        if self.step_decisions.end_step():
            self._stop()
        elif state.max_iters is not None and state.iteration > state.max_iters:
            super().terminate(self._skip_completed)

    def _run_step(self, _engine: Engine, microbatches: Sequence[Any]) -> float:
        """One optimizer step (ignite's process function): the step body's forward and backward
        (:mod:`engine.step_body`), then :meth:`_finish_step`."""
        ctx = self.step_context
        ctx.observes_microbatch = self.events.any_for(Events.MICROBATCH)
        return self._finish_step(checked_result(self.step_body, self.step_body.run_step(microbatches, ctx)))

    def _finish_step(self, result: StepResult) -> float:
        """The tail every step shares: the gradient norm, BEFORE_OPTIMIZER_STEP, the step's
        agreement, clipping, the optimizer and LR scheduler.

        ``result`` holds this rank's mean microbatch loss (a tensor), its token count (an int or a
        0-dim tensor) and its sample count. Nothing here reads a tensor to the host: with several
        ranks the loss, norm and counts come back from the agreement's one all-reduce as numbers;
        with one they stay tensors until something reads them. With fp16 loss scaling the
        gradients are unscaled first, and an overflow (a non-finite norm on any rank) vetoes the
        step on every rank."""
        local_loss, tokens, samples = result
        state = self.state
        scaler = self.grad_scaler
        self.agreement.transport.reduce_gradients(self._params)  # beyond DDP / FSDP2 (engine.agreement)
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        norm = self.step_body.grad_norm()
        state.loss, state.grad_norm, state.step_tokens = local_loss, norm, tokens
        state.grad_scaler_overflow = False
        self.fire(Events.BEFORE_OPTIMIZER_STEP)
        overflow = None
        if scaler is not None:  # fp16: a non-finite norm means the loss scale overflowed
            overflow = ~torch.isfinite(norm) if isinstance(norm, torch.Tensor) else False
        self.run_end.poll()  # a noted signal or time limit: a request in this step's agreement
        self.step_decisions.agree(local_loss, norm, tokens, samples, overflow)
        return self._optimizer_step(norm)

    @property
    def skips_on_device(self) -> bool:
        """Whether a skip can be decided on the device (``control.request_skip(on_device=flag)``):
        the optimizer takes a ``found_inf`` and skips its update and step counters where it is
        nonzero (torch's fused Adam, AdamW and SGD, ``fused=True``, on CPU too), no fp16 loss
        scaler owns that input, and the LR schedule can be moved back once the host learns of the
        skip (none, or a ``LambdaLR`` such as :func:`engine.lr.build_lr_scheduler`'s: its rate is a
        function of its step count). Otherwise a skip is decided on the host (one read)."""
        scheduler = self.lr_scheduler
        return (
            self.grad_scaler is None
            and getattr(self.optimizer, "_step_supports_amp_scaling", False)
            and (scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR))
        )

    def count_device_skips(self, skipped: int) -> None:
        """The host learned that ``skipped`` earlier steps were skipped on the device (asked with
        ``control.request_skip(on_device=...)``): ``state.skipped_steps`` counts them, and the LR
        schedule, stepped after each as if it had been applied, moves back as many steps, so its
        count is again the applied steps' (:meth:`engine.lr.ScheduledRates.unstep`). The steps
        between the skip and now ran at the rate one schedule step ahead per unsettled skip."""
        if skipped <= 0:
            return
        state = self.state
        state.skipped_steps += skipped
        self.rates.unstep(skipped, state.step + 1)
        state.lr = self.optimizer.param_groups[0]["lr"]

    def _optimizer_step(self, norm: Any) -> float:
        """The agreed veto (or the one decided on the device), clipping, then optimizer and LR
        scheduler."""
        state = self.state
        scaler = self.grad_scaler
        on_device = self.control.device_skip
        if self.control.decided.skip:
            state.skipped_steps += 1
        elif on_device is not None:  # the optimizer skips where the agreed flag is set (found_inf)
            if not self.skips_on_device:
                raise RuntimeError(
                    "control.request_skip(on_device=...) needs an optimizer that skips on the device "
                    f"(trainer.skips_on_device is False for {type(self.optimizer).__name__}: use a fused "
                    "Adam, AdamW or SGD, no fp16 loss scaler and a LambdaLR schedule), else request_skip()"
                )
            self._clip(norm)
            optimizer = self.optimizer
            optimizer.found_inf = (on_device > 0).to(torch.float32)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
            self.rates.step(state.step + 1)  # moved back if the host learns the step was skipped
        else:
            self._clip(norm)
            if scaler is None:
                self.optimizer.step()
            else:
                scaler.step(self.optimizer)
            self.rates.step(state.step + 1)
        if scaler is not None:
            self._update_scale(scaler, state.grad_scaler_overflow)
        self.optimizer.zero_grad(set_to_none=True)
        state.lr = self.optimizer.param_groups[0]["lr"]
        return state.peek("loss")

    def _clip(self, norm: Any) -> None:
        if self.grad_clip_norm is not None and isinstance(norm, torch.Tensor):
            if self.tp_mesh is not None:
                tensor_parallel.clip_grads_with_norm(self._params, self.grad_clip_norm, norm)
            else:
                torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip_norm, norm, foreach=True)

    def _update_scale(self, scaler: torch.amp.GradScaler, overflow: bool) -> None:
        """``scaler.update()``, with an agreed overflow counted on every rank (also one whose own
        gradients were finite) so every rank backs the scale off alike and the scales stay equal."""
        if overflow:
            recorded = scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
            for found_inf in recorded.values():
                found_inf.fill_(1.0)
        scaler.update()

    def _maybe_validate(self) -> None:
        if self.control.decided.validate:  # agreed: every rank validates at this step
            self.validate()

    @property
    def evaluator(self) -> Engine:
        """The ignite engine validation runs on (:mod:`engine.validation`): attach ignite metrics to
        it (its process function returns ``(model_output, targets)``); their results join
        ``state.metrics`` before VALIDATION_END, reduced over the data-parallel ranks."""
        return self.validator.evaluator

    def validate(self) -> float:
        """Mean validation loss over the samples of every rank; published as ``state.metrics["val_loss"]``
        (with ``val_<name>`` of every metric and the evaluator's ignite metrics) before
        VALIDATION_END fires."""
        return self.validator.run()
