"""The core engine: an ignite ``Engine`` whose iteration is one optimizer step.

Everything a run needs beyond the step itself (scheduling, checkpoints, NaN handling, logging) is a
handler attached to a :class:`Trainer`; the trainer only runs the step body, fires events, keeps
:class:`~engine.state.TrainState`, and takes the decisions handlers ask for (skip, stop) once every
rank agrees.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from ignite.engine import Engine
from ignite.engine.events import CallableEventWithFilter, EventsList, RemovableEventHandle, State

from engine import checkpoint_io, parallel
from engine.errors import ConfigError
from engine.events import STEP_EVENT_TO_ATTR, Events, StepEvents
from engine.state import TrainState

__all__ = ["Trainer", "default_prepare_batch"]

logger = logging.getLogger(__name__)

PrepareBatch = Callable[[Any, torch.device], tuple[Any, Any]]

# Internal handlers sit outside the range users are expected to pick.
_NO_CONTEXT = contextlib.nullcontext()
_FIRST = float("inf")
_LAST = float("-inf")
_VALIDATION_PRIORITY = 1_000_000


def default_prepare_batch(microbatch: Any, device: torch.device) -> tuple[Any, Any]:
    """``(inputs, targets, ...)`` or ``{"input_ids", "labels"}`` -> ``(inputs, targets)`` on ``device``."""
    if isinstance(microbatch, (list, tuple)) and len(microbatch) >= 2:
        inputs, targets = microbatch[0], microbatch[1]
    elif isinstance(microbatch, dict) and "input_ids" in microbatch and "labels" in microbatch:
        inputs, targets = microbatch["input_ids"], microbatch["labels"]
    else:
        raise TypeError(
            f"a microbatch must be (inputs, targets) or a dict with 'input_ids' and 'labels', got "
            f"{type(microbatch).__name__}; pass Trainer(prepare_batch=fn) to unpack other layouts"
        )
    return _to_device(inputs, device), _to_device(targets, device)


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _every_gate(event_name: Any) -> tuple[str, int] | None:
    """``(state attribute, N)`` when ``event_name`` carries ignite's plain ``every=N`` filter."""
    if not isinstance(event_name, CallableEventWithFilter) or event_name.filter is None:
        return None
    f = event_name.filter
    if not getattr(f, "__qualname__", "").endswith("every_event_filter.<locals>.wrapper"):
        return None
    every = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ()))).get("every")
    attr = State.event_to_attr.get(event_name)
    return (attr, every) if isinstance(every, int) and attr else None


class _StepBatches:
    """Groups a microbatch iterable into lists of ``trainer.grad_accum_steps`` microbatches.

    One pass over ``data`` is one epoch; its last group may be shorter. ``skip_next`` drops that
    many microbatches at the start of the next pass.

    It also knows the data position, for exact resume: ``consumed`` microbatches and ``steps``
    groups taken in the current pass, the RNG states right before the pass began (python, numpy,
    torch and the data's own generators, which decide a shuffled ``DataLoader``'s order), and the
    state of a stateful data source. :meth:`load_state_dict` positions the next pass: a stateful
    source (``data`` itself with ``state_dict``/``load_state_dict``, or the sampler of a
    ``DataLoader`` without worker processes, whose sampler is never read ahead) restores its own
    position in O(1); any other iterable is replayed from the pass's start RNG states and the
    consumed microbatches are skipped, which costs O(consumed) fetches.
    """

    def __init__(self, trainer: Trainer, data: Iterable) -> None:
        self.trainer = trainer
        self.data = data
        self.skip_next = 0
        self.consumed = 0
        self.steps = 0
        self._pass_start_rng: dict | None = None
        self._resume: dict | None = None

    def __len__(self) -> int:
        n = len(self.data)  # type: ignore[arg-type]
        return math.ceil(n / self.trainer.grad_accum_steps)

    def stateful_source(self) -> Any:
        """The object that can save and restore the data position itself, or None."""
        data = self.data
        if _is_stateful(data):
            return data
        if getattr(data, "num_workers", None) == 0:  # a DataLoader that does not read ahead
            batch_sampler = getattr(data, "batch_sampler", None)
            candidates = (
                batch_sampler,
                getattr(batch_sampler, "sampler", None),
                getattr(data, "sampler", None),
            )
            for candidate in candidates:
                if _is_stateful(candidate):
                    return candidate
        return None

    def state_dict(self) -> dict[str, Any]:
        """The data position after the microbatches handed out so far in this pass."""
        state: dict[str, Any] = {
            "microbatches": self.consumed,
            "steps": self.steps,
            "pass_start_rng": self._pass_start_rng,
        }
        source = self.stateful_source()
        if source is not None:
            state["source"] = source.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next pass at ``state``'s position. The RNG states current at this call are
        reinstated once the data is positioned, so set them before calling."""
        generators = checkpoint_io.data_generators(self.data)
        self._resume = {**state, "rng_after": checkpoint_io.capture_rng(generators)}

    def __iter__(self) -> Iterator[list]:
        accum = self.trainer.grad_accum_steps
        generators = checkpoint_io.data_generators(self.data)
        resume, self._resume = self._resume, None
        skip, self.skip_next = self.skip_next, 0
        self.consumed = self.steps = 0
        replay = resume is not None and resume.get("microbatches", 0) > 0 and "source" not in resume
        if resume is not None and "source" in resume:
            self.stateful_source().load_state_dict(resume["source"])
        if replay and resume.get("pass_start_rng") is not None:
            checkpoint_io.restore_rng(resume["pass_start_rng"], generators)
        if resume is not None and resume.get("microbatches", 0) > 0:
            self._pass_start_rng = resume.get("pass_start_rng")
            self.consumed, self.steps = resume["microbatches"], resume["steps"]
        else:
            self._pass_start_rng = checkpoint_io.capture_rng(generators)
        it = iter(self.data)
        if replay:
            skip += resume["microbatches"]
            self.consumed -= resume["microbatches"]
        for _ in range(skip):
            if next(it, _END) is _END:
                break
            self.consumed += 1
        if resume is not None:
            checkpoint_io.restore_rng(resume["rng_after"], generators)
        size = _length(self.data)
        group: list = []
        yielded = False
        pending: Any = _END
        while True:
            microbatch, pending = (pending, _END) if pending is not _END else (next(it, _END), _END)
            if microbatch is _END:
                break
            group.append(microbatch)
            self.consumed += 1
            if self.consumed == size:
                # Run the source to its end now, before this step's checkpoint: whatever RNG it
                # draws at its end (a sampler's next permutation) is then part of that checkpoint.
                pending = next(it, _END)
                ended = pending is _END
            else:
                ended = False
            if len(group) == accum:
                yielded = True
                self.steps += 1
                yield group
                group = []
            if ended:
                break
        if group:
            yielded = True
            self.steps += 1
            yield group
        if not yielded and not skip and resume is None:
            raise ValueError("data yielded no microbatches in this epoch: pass a non-empty dataset or loader")


_END = object()


def _length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:  # no __len__, or an IterableDataset's loader
        return None


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Trainer(Engine):
    """A hook-based training loop on ignite: one ignite iteration is one optimizer step.

    Args:
        model: the module to train (plain, DDP- or FSDP2-wrapped).
        optimizer: a torch optimizer over ``model``'s parameters.
        loss_fn: ``loss_fn(model(inputs), targets) -> scalar tensor``.
        lr_scheduler: stepped after every optimizer step that was not vetoed.
        grad_accum_steps: microbatches per optimizer step (>= 1).
        grad_clip_norm: clip the total gradient norm to this value; ``None`` measures only.
        prepare_batch: ``prepare_batch(microbatch, device) -> (inputs, targets)``.
        device: where batches go; defaults to the device of the model's first parameter.
        pipeline: a :class:`engine.pipeline.PipelineRuntime` (from ``build_pipeline``): run the
            pipeline-parallel step body; ``model`` is then ``runtime.module`` and each step takes
            ``runtime.n_microbatches`` microbatches.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        lr_scheduler: Any | None = None,
        grad_accum_steps: int = 1,
        grad_clip_norm: float | None = None,
        prepare_batch: PrepareBatch | None = None,
        device: torch.device | str | None = None,
        pipeline: Any | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(model_output, targets) -> scalar tensor")
        if prepare_batch is not None and not callable(prepare_batch):
            raise TypeError("prepare_batch must be callable: prepare_batch(microbatch, device)")
        self._grad_accum_steps = 1
        self.grad_accum_steps = grad_accum_steps
        if grad_clip_norm is not None and not (
            isinstance(grad_clip_norm, (int, float)) and grad_clip_norm > 0
        ):
            raise ConfigError("grad_clip_norm", f"must be a positive number or None, got {grad_clip_norm!r}")

        if pipeline is not None:
            if not hasattr(pipeline, "run_step"):
                raise TypeError(
                    "pipeline must be the runtime engine.pipeline.build_pipeline(model, config, dist_info) "
                    f"returns, got {type(pipeline).__name__}; build the optimizer over runtime.parameters()"
                )
            if model is not pipeline.module:
                raise ValueError("with pipeline=runtime, the model must be runtime.module (its stages)")
            if grad_accum_steps not in (1, pipeline.n_microbatches):
                raise ConfigError(
                    "grad_accum_steps",
                    f"is {grad_accum_steps} but the pipeline takes {pipeline.n_microbatches} microbatches "
                    "per step (pipeline.pp_batch_size // pp_microbatch_size); leave it unset",
                )
            self.grad_accum_steps = pipeline.n_microbatches
            if pipeline.loss_fn is None:
                pipeline.loss_fn = loss_fn
        self.pipeline = pipeline
        super().__init__(self._pipeline_step_body if pipeline is not None else self._step_body)
        self.logger = logger
        self.state = TrainState()
        self.register_events(*StepEvents, event_to_attr=STEP_EVENT_TO_ATTR)
        self._priorities: dict[int, float] = {}
        self._gates: dict[int, tuple[str, int]] = {}
        self._plans: dict[Any, tuple[list, int, list]] = {}
        self._stateful: dict[str, Any] = {}

        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lr_scheduler = lr_scheduler
        self.grad_clip_norm = grad_clip_norm
        self.prepare_batch: PrepareBatch = prepare_batch or default_prepare_batch
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.max_steps: int | None = None
        self.max_epochs: int | None = None
        self.step_data: _StepBatches | None = None
        self._validation: tuple[Iterable, int | None, int | None] | None = None
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._loss_checked = False

        self.add_event_handler(Events.TRAIN_START, self._on_train_start, priority=_FIRST)
        self.add_event_handler(Events.STEP_END, self._maybe_validate, priority=_VALIDATION_PRIORITY)
        self.add_event_handler(Events.STEP_END, self._end_step, priority=_LAST)

    # ------------------------------------------------------------------ configuration
    @property
    def grad_accum_steps(self) -> int:
        return self._grad_accum_steps

    @grad_accum_steps.setter
    def grad_accum_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("grad_accum_steps", f"must be an integer >= 1, got {value!r}")
        self._grad_accum_steps = value

    def set_validation(
        self, data: Iterable, eval_iters: int | None = None, every_steps: int | None = None
    ) -> None:
        """Validate on ``data`` whenever ``state.should_validate`` is set (the StepScheduler sets it)
        or every ``every_steps`` steps; at most ``eval_iters`` batches per validation."""
        for name, value in (("eval_iters", eval_iters), ("every_steps", every_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be a positive integer or None, got {value!r}")
        self._validation = (data, eval_iters, every_steps)

    # ------------------------------------------------------------------ handlers
    def add_event_handler(  # type: ignore[override]
        self, event_name: Any, handler: Callable, *args: Any, priority: float = 0, **kwargs: Any
    ) -> RemovableEventHandle:
        """ignite's ``add_event_handler`` plus ``priority``: higher runs earlier; ties run in
        attach order."""
        if isinstance(event_name, EventsList):
            for event in event_name:
                self.add_event_handler(event, handler, *args, priority=priority, **kwargs)
            return RemovableEventHandle(event_name, handler, self)
        handle = super().add_event_handler(event_name, handler, *args, **kwargs)
        entries = self._event_handlers[event_name]
        self._priorities[id(entries[-1])] = priority
        gate = _every_gate(event_name)
        if gate is not None:
            self._gates[id(entries[-1])] = gate
        if priority != 0 or any(self._priorities.get(id(e), 0) != 0 for e in entries):
            entries.sort(key=lambda e: -self._priorities.get(id(e), 0))
        self._plans.pop(event_name, None)
        return handle

    def remove_event_handler(self, handler: Callable, event_name: Any) -> None:
        super().remove_event_handler(handler, event_name)
        self._plans.pop(event_name, None)

    def _plan(self, event_name: Any) -> list:
        """Handlers of one event as runs sharing one ``every=N`` gate (or none), in firing order,
        so a run of filtered-out handlers costs one modulo instead of a call each."""
        entries = self._event_handlers.get(event_name, [])
        cached = self._plans.get(event_name)
        if cached is not None and cached[0] is entries and cached[1] == len(entries):
            return cached[2]
        plan: list = []
        for entry in entries:
            gate = self._gates.get(id(entry))
            if plan and plan[-1][0] == gate:
                plan[-1][1].append(entry)
            else:
                plan.append((gate, [entry]))
        self._plans[event_name] = (entries, len(entries), plan)
        return plan

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # ignite's dispatch, minus its per-call debug formatting, plus the every=N gates.
        self.last_event_name = event_name
        state = self.state
        for gate, entries in self._plan(event_name):
            if gate is not None and getattr(state, gate[0]) % gate[1]:
                continue
            for func, args, kwargs in entries:
                if event_kwargs:
                    kwargs.update(event_kwargs)
                if args and isinstance(args[0], weakref.ref):
                    engine = args[0]()
                    if engine is None:
                        raise RuntimeError("Engine reference not resolved. Cannot execute event handler.")
                    func(engine, *event_args, *args[1:], **kwargs)
                else:
                    func(*event_args, *args, **kwargs)

    def on(self, event_name: Any, *args: Any, priority: float = 0, **kwargs: Any) -> Callable:  # type: ignore[override]
        def decorator(f: Callable) -> Callable:
            self.add_event_handler(event_name, f, *args, priority=priority, **kwargs)
            return f

        return decorator

    def register_stateful(self, key: str, obj: Any) -> None:
        """Register ``obj`` (with ``state_dict``/``load_state_dict``) so checkpoints hold it under
        ``key``. Two different objects claiming one key is an error, not a silent overwrite."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{type(obj).__name__} needs state_dict() and load_state_dict() to be registered")
        held = self._stateful.get(key)
        if held is not None and held is not obj:
            raise ValueError(
                f"state key {key!r} is already registered by {type(held).__name__}; give "
                f"{type(obj).__name__} another state_key so its checkpoint state does not overwrite it"
            )
        self._stateful[key] = obj

    @property
    def stateful(self) -> dict[str, Any]:
        """Registered stateful objects by key (a copy)."""
        return dict(self._stateful)

    def fire(self, event: StepEvents, *args: Any, **kwargs: Any) -> None:
        """Fire a custom event, advancing the counter its filters read."""
        attr = STEP_EVENT_TO_ATTR[event]
        if attr != "iteration":
            setattr(self.state, attr, getattr(self.state, attr) + 1)
        if self._event_handlers.get(event):
            self._fire_event(event, *args, **kwargs)

    def has_event_handler_for(self, event: Any) -> bool:
        """Whether any handler is attached to ``event``."""
        return bool(self._event_handlers.get(event))

    def agree_any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (one small all-reduce)."""
        return parallel.agree_any(flag)

    # ------------------------------------------------------------------ running
    def run(  # type: ignore[override]
        self, data: Iterable, max_steps: int | None = None, max_epochs: int | None = None
    ) -> TrainState:
        """Train on ``data`` (an iterable of microbatches) until ``max_steps`` optimizer steps or
        ``max_epochs`` passes over the data, whichever comes first (one epoch if neither is set).
        Returns the final state; ``state.exit_code`` tells how the run ended."""
        max_steps = self.max_steps if max_steps is None else max_steps
        max_epochs = self.max_epochs if max_epochs is None else max_epochs
        for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be a positive integer or None, got {value!r}")
        if data is None or not isinstance(data, Iterable):
            raise TypeError(f"data must be an iterable of microbatches, got {type(data).__name__}")
        if _length(data) == 0:
            raise ValueError("data is empty (len(data) == 0): pass a non-empty dataset or loader")
        self.max_steps, self.max_epochs = max_steps, max_epochs
        if self.step_data is None or self.step_data.data is not data:
            self.step_data = _StepBatches(self, data)
        if max_epochs is None:
            max_epochs = 1 if max_steps is None else 2**62
        if self.state.max_epochs is not None and self._is_done(self.state):
            self.state.max_epochs = None  # a finished run starts afresh
        if self.state.max_epochs is None:
            self.state.reset_counters()
        else:
            self.state.max_epochs = max_epochs
        super().run(self.step_data, max_epochs=max_epochs)
        return self.state

    def _on_train_start(self) -> None:
        state = self.state
        state.should_stop = False
        state.stop_reason = None
        state.exit_code = 0
        state.clear_step_flags()

    def _end_step(self) -> None:
        state = self.state
        reached = self.max_steps is not None and state.iteration >= self.max_steps
        stop = self.agree_any(state.should_stop)
        state.clear_step_flags()
        if stop:
            state.should_stop = True
            if state.stop_reason is None:
                state.stop_reason = "stop requested on another rank"
            logger.info("stopping after step %d: %s", state.iteration, state.stop_reason)
        if stop or reached:
            self.terminate()

    def _handle_exception(self, e: BaseException) -> None:
        # ignite routes an error through here twice (inner and outer loop): notify handlers once.
        if getattr(e, "_hookloop_notified", False):
            raise e
        with contextlib.suppress(AttributeError, TypeError):
            e._hookloop_notified = True  # type: ignore[attr-defined]
        for func, args, kwargs in list(self._event_handlers.get(Events.EXCEPTION, ())):
            first = (self,) if args and callable(args[0]) and args[0]() is self else ()
            rest = args[1:] if first else args
            try:
                func(*first, e, *rest, **kwargs)
            except BaseException as handler_error:  # keep notifying; the original error wins
                logger.error("EXCEPTION handler %r failed: %r", func, handler_error)
        raise e

    # ------------------------------------------------------------------ step body
    def _step_body(self, _engine: Engine, microbatches: Sequence[Any]) -> float:
        """Local (non-pipeline) step: forward/backward per microbatch, then one optimizer step."""
        state, model = self.state, self.model
        if not model.training:
            model.train()
        n = len(microbatches)
        fire_microbatch = bool(self._event_handlers.get(Events.MICROBATCH))
        ddp = hasattr(model, "no_sync")
        fsdp = hasattr(model, "set_requires_gradient_sync")
        loss_sum: Any = 0.0
        tokens = samples = 0
        for i, microbatch in enumerate(microbatches):
            inputs, targets = self.prepare_batch(microbatch, self.device)
            last = i == n - 1
            if fsdp:  # gradients reduce-scatter only on the step's last microbatch
                model.set_requires_gradient_sync(last)
            with model.no_sync() if ddp and not last else _NO_CONTEXT:
                output = model(inputs)
                loss = self.loss_fn(output, targets)
                if not self._loss_checked:
                    self._check_loss(loss)
                (loss / n).backward()
            loss = loss.detach()
            loss_sum = loss_sum + loss
            if isinstance(inputs, torch.Tensor):
                samples += inputs.shape[0] if inputs.dim() else 1
                if not inputs.is_floating_point():
                    tokens += inputs.numel()
            state.microbatch = i
            if fire_microbatch:
                state.microbatch_loss = float(loss)
                state.microbatch_output, state.microbatch_targets = output, targets
                self.fire(Events.MICROBATCH)
                state.microbatch_output = state.microbatch_targets = None
            else:
                state.microbatches_seen += 1
            # Free this microbatch's activations now, not when the next forward reassigns them:
            # the allocator can then reuse their memory for the next forward.
            del output, inputs, targets
        self._reduce_step_metrics(loss_sum / n, tokens, samples)
        state.grad_norm = self._clip_gradients()
        return self._optimizer_step()

    def _pipeline_step_body(self, _engine: Engine, microbatches: Sequence[Any]) -> float:
        """Pipeline-parallel step (``engine/pipeline/runtime.py``): same events as the local body."""
        return self.pipeline.run_step(self, list(microbatches))

    def _check_loss(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean()) "
                "or pass reduction='mean' to the loss"
            )
        self._loss_checked = True

    def _reduce_step_metrics(self, local_loss: torch.Tensor, tokens: int, samples: int) -> None:
        """Mean loss over data-parallel ranks and summed token/sample counts: one all-reduce."""
        state = self.state
        if parallel.world_size() > 1:
            packed = torch.stack(
                [local_loss.double().cpu(), torch.tensor(float(tokens)), torch.tensor(float(samples))]
            ).to(torch.float64)
            packed = parallel.all_reduce_sum(packed)
            local_loss = packed[0] / parallel.world_size()
            tokens, samples = int(packed[1]), int(packed[2])
        state.loss = float(local_loss)
        state.step_tokens = tokens
        state.tokens_seen += tokens
        state.samples_seen += samples

    def _clip_gradients(self) -> float:
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor (FSDP2): the norm over all shards
            norm = norm.full_tensor()
        if self.pipeline is not None:  # this rank holds only some stages: the norm over all of them
            norm = self.pipeline.reduce_grad_norm(norm)
        if self.grad_clip_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip_norm, norm, foreach=True)
        return float(norm)

    def _optimizer_step(self) -> float:
        """BEFORE_OPTIMIZER_STEP, the agreed veto, then optimizer and LR scheduler."""
        state = self.state
        self.fire(Events.BEFORE_OPTIMIZER_STEP)
        state.skip_step = self.agree_any(state.skip_step)
        if state.skip_step:
            state.skipped_steps += 1
        else:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.lr = self.optimizer.param_groups[0]["lr"]
        return state.loss

    # ------------------------------------------------------------------ validation
    def _maybe_validate(self) -> None:
        if self._validation is None:
            return
        every = self._validation[2]
        if self.state.should_validate or (every is not None and self.state.iteration % every == 0):
            self.validate()

    @torch.no_grad()
    def validate(self) -> float:
        """Mean validation loss over batches and ranks; published as ``state.metrics["val_loss"]``
        before VALIDATION_END fires."""
        if self._validation is None:
            raise RuntimeError("no validation data: call trainer.set_validation(data) first")
        data, eval_iters, _ = self._validation
        start = time.perf_counter()
        model = self.model
        was_training = model.training
        model.eval()
        if self.pipeline is not None:  # forward through the stages, n_microbatches batches a pass
            total = self.pipeline.validation_totals(self, data, eval_iters)
        else:
            total = torch.zeros(2, dtype=torch.float64)
            for i, microbatch in enumerate(data):
                if eval_iters is not None and i >= eval_iters:
                    break
                inputs, targets = self.prepare_batch(microbatch, self.device)
                total[0] += float(self.loss_fn(model(inputs), targets))
                total[1] += 1
        if parallel.world_size() > 1:
            total = parallel.all_reduce_sum(total)
        model.train(was_training)
        if total[1] == 0:
            raise ValueError("validation data yielded no batches: pass non-empty data to set_validation")
        val_loss = float(total[0] / total[1])
        self.state.metrics["val_loss"] = val_loss
        self.state.times["validation"] = time.perf_counter() - start
        self.fire(Events.VALIDATION_END)
        return val_loss
