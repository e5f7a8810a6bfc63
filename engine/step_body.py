"""The step-body protocol: how one optimizer step's microbatches become gradients.

The :class:`~engine.Trainer` runs every step the same way, whichever body it was given::

    ctx.observes_microbatch = <any MICROBATCH handler attached>
    result = body.run_step(microbatches, ctx)   # forward + backward; MICROBATCH per microbatch
    norm = body.grad_norm()                     # over every shard and stage of the model
    ... BEFORE_OPTIMIZER_STEP, the step's agreement, clipping, optimizer, LR scheduler

and validation (:mod:`engine.validation`) runs through the same body, forward only::

    group = body.data_parallel_group(dp)        # the ranks validation metrics reduce over
    for loss, samples, output, targets in body.eval_batches(data, eval_iters, ctx):
        ...                                     # the evaluator's items where body.holds_outputs
    metrics = body.share_metrics(metrics)       # computed where the outputs are, on every rank

Two bodies ship: :class:`LocalStepBody` (the model on this rank, plain, DDP, FSDP2 or
tensor-parallel) and :class:`engine.pipeline.PipelineRuntime` (this rank's pipeline stages,
declaring its microbatches per step, ``n_microbatches``). A user whose step is not "forward, loss,
backward" usually subclasses :class:`LocalStepBody` and overrides :meth:`StepBody.compute_loss` (a
frozen teacher, two views of a batch, several losses); an object of another class than
:class:`StepBody` needs every member (:func:`check_step_body` says which are missing). A body sees
the trainer only through the :class:`StepContext` it is handed; what comes after the backward (the
norm's agreement, clipping, the optimizer) is the trainer's. A body runs validation's forward
passes the way it runs a step's, so a model is validated exactly as it is trained (precision,
tensor and pipeline parallelism), with no special case in the trainer.
"""

from __future__ import annotations

import contextlib
import itertools
import reprlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hookloop.engine import parallel, tensor_parallel
from hookloop.engine.batch import count_batch, forward_and_loss
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events

if TYPE_CHECKING:
    from hookloop.engine.trainer import Trainer

__all__ = [
    "EvalResult",
    "LocalStepBody",
    "StepBody",
    "StepContext",
    "StepResult",
    "accumulation",
    "bind_step_body",
    "check_loss",
    "check_step_body",
    "checked_result",
    "grad_norm",
]

#: The members a step body has (:class:`StepBody`); a subclass of it implements ``run_step`` only.
PROTOCOL_MEMBERS = (
    "run_step",
    "grad_norm",
    "holds_outputs",
    "eval_batches",
    "share_metrics",
    "data_parallel_group",
)

_NO_CONTEXT = contextlib.nullcontext()


class StepResult(NamedTuple):
    """What a body's step leaves for the trainer besides the gradients."""

    #: This rank's mean microbatch loss (a 0-dim tensor; not read to the host).
    loss: torch.Tensor
    #: This rank's token count: an int or a 0-dim tensor (an attention mask's sum).
    tokens: Any
    #: This rank's sample count.
    samples: int


class EvalResult(NamedTuple):
    """One validation microbatch's forward, as a body gives it to the evaluator."""

    #: The microbatch's loss (a 0-dim tensor or a number; on every rank of the body).
    loss: Any
    #: Its sample count (at least 1): the loss's weight in the mean over every sample.
    samples: int
    #: The model's output (None on a rank that does not hold the outputs, see ``holds_outputs``).
    output: Any
    #: The microbatch's targets.
    targets: Any


class StepContext:
    """What the trainer lends a step body for one step, and nothing else of the trainer.

    One per trainer, reused every step; ``observes_microbatch`` is set by the trainer before each
    step (whether any MICROBATCH handler is attached, so a body keeps outputs only when one is).
    """

    __slots__ = ("_trainer", "autocast", "loss_context", "observes_microbatch")

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        #: ``autocast()``: the context forward and loss run under (the trainer's precision).
        self.autocast: Callable[[], contextlib.AbstractContextManager] = trainer.autocast
        #: ``loss_context()``: the context forward, loss and backward run under (loss parallelism).
        self.loss_context: Callable[[], contextlib.AbstractContextManager] = trainer.loss_context
        self.observes_microbatch = False

    def prepare(self, microbatch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of ``microbatch`` on the trainer's device (its ``prepare_batch``)."""
        trainer = self._trainer
        return trainer.prepare_batch(microbatch, trainer.device)

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor] | None:
        """The trainer's loss function (None: the model computes its own loss)."""
        return self._trainer.loss_fn

    @property
    def count_share(self) -> int:
        """1 on the rank that counts its tensor-parallel group's samples and tokens, else 0."""
        return self._trainer.count_share

    def microbatch_done(self, index: int, loss: torch.Tensor, output: Any, targets: Any) -> None:
        """Microbatch ``index`` of the step has run: ``state.microbatch`` moves on, the watchdog
        hears of progress, and MICROBATCH fires with its loss, output and targets (when a handler
        observes it; else only ``state.microbatches_seen`` counts it)."""
        trainer = self._trainer
        state = trainer.state
        state.microbatch = index
        watchdog = trainer.watchdog
        if watchdog is not None:
            watchdog.feed()
        if self.observes_microbatch:
            state.microbatch_loss = loss
            if trainer.loss_parallel:  # handlers see the gathered output
                output = tensor_parallel.local_value(output)
            state.microbatch_output, state.microbatch_targets = output, targets
            trainer.fire(Events.MICROBATCH)
            state.microbatch_output = state.microbatch_targets = None
        else:
            state.microbatches_seen += 1


def check_loss(loss: Any, loss_fn: Callable | None, source: str | None = None) -> None:
    """A step's loss must be a scalar tensor; the error says how to make it one. ``source``: the
    method that computed it, when not the trainer's ``loss_fn`` (a body's own ``compute_loss``)."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return
    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
    if source is not None:
        raise ValueError(
            f"{source} must return (output, loss) with the loss a scalar tensor, got {shape}; reduce "
            "it (e.g. .mean())"
        )
    if loss_fn is None:
        raise ValueError(
            f"the model's own loss (output.loss, Trainer(loss_fn=None)) must be a scalar tensor, "
            f"got {shape}; have the model reduce it, or pass a loss_fn"
        )
    raise ValueError(
        f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean()) "
        "or pass reduction='mean' to the loss"
    )


def checked_result(body: Any, result: Any) -> StepResult:
    """``body.run_step``'s ``result``, checked where it is returned: a :class:`StepResult` whose loss
    is a 0-dim floating tensor, else a ``TypeError`` naming the body's class, ``run_step`` and what
    came back (raised in that step, before anything reads it). Cheap on every step: ``isinstance``,
    ``.dim()`` and ``.dtype`` only, nothing read to the host."""
    if isinstance(result, StepResult):
        loss = result.loss
        if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
            return result
        got = f"a StepResult whose loss is {_got(loss)}"
    else:
        got = _got(result)
    raise TypeError(
        f"{type(body).__name__}.run_step must return a StepResult(loss, tokens, samples) with the loss a "
        f"0-dim floating tensor (this rank's mean loss), got {got}"
    )


def _got(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__} {reprlib.repr(value)}"


def grad_norm(params: Sequence[torch.Tensor], tp_mesh: Any) -> Any:
    """The total gradient norm of ``params`` on this rank's part of the model, as a tensor (over
    every shard of a DTensor gradient: FSDP2, tensor parallelism); 0.0 when none has a gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if tp_mesh is not None:  # DTensor and plain gradients, several placements
        return tensor_parallel.grad_norm(grads)
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor (FSDP2): the norm over all shards
        norm = norm.full_tensor()
    return norm


class StepBody:
    """One optimizer step's forward and backward over its microbatches: subclass it and implement
    :meth:`run_step`. Everything else has a default for a model held whole on this rank, from what
    the trainer hands the body (:meth:`bind`): override :meth:`compute_loss` (or
    :meth:`eval_batches`) when it validates differently, and the layout members (``holds_outputs``,
    :meth:`share_metrics`, :meth:`data_parallel_group`, :meth:`grad_norm`, ``n_microbatches``) only
    for a layout of its own, as the pipeline runtime does. Give the trainer an instance,
    ``Trainer(model, optimizer, loss_fn, step_body=body)``."""

    #: The microbatches one step takes when the body fixes it (a pipeline schedule does): the
    #: trainer's ``grad_accum_steps`` follows it. None: the trainer's ``grad_accum_steps``.
    n_microbatches: int | None = None
    #: Whether this rank holds the model's outputs: the evaluator and its metrics run here.
    holds_outputs = True
    #: The trainer's model, bound with its parameters and layout (:meth:`bind`).
    model: torch.nn.Module
    _loss_checked = False

    def bind(
        self,
        model: torch.nn.Module,
        params: Sequence[torch.Tensor],
        *,
        loss_fn: Callable | None,
        tp_mesh: Any,
        grad_scaler: torch.amp.GradScaler | None,
        loss_parallel: bool,
    ) -> None:
        """Take what the trainer owns, before its first step: the model it trains (checkpoints,
        clipping and validation's ``eval()`` go through it), the parameters it clips and steps (the
        gradient norm is theirs), its tensor-parallel mesh, fp16 loss scaler and loss parallelism
        (``loss_fn`` reaches the step through its context)."""
        self.model, self.params, self.tp_mesh = model, params, tp_mesh
        self.grad_scaler, self.loss_parallel = grad_scaler, loss_parallel

    def run_step(self, microbatches: Sequence[Any], ctx: StepContext) -> StepResult:
        """Forward and backward over ``microbatches``, gradients left in the parameters (the mean
        over the microbatches); :meth:`StepContext.microbatch_done` once per microbatch, in order."""
        raise NotImplementedError(f"{type(self).__name__} must implement run_step(microbatches, ctx)")

    def grad_norm(self) -> Any:
        """The total norm of the accumulated gradients over every shard and stage of the model (a
        tensor; 0.0 when no parameter has a gradient), before clipping."""
        return grad_norm(self.params, self.tp_mesh)

    def compute_loss(self, inputs: Any, targets: Any, ctx: StepContext) -> tuple[Any, torch.Tensor]:
        """One microbatch's ``(output, loss)``: the model's output (what MICROBATCH handlers and
        validation metrics see) and its scalar loss; the default is ``loss_fn(model(inputs),
        targets)`` (:func:`engine.batch.forward_and_loss`).

        Override it for another step. It runs under the trainer's autocast, in training (the
        backward follows) and in validation (``self.model.training`` is False and gradients are
        off), so a body may validate on another loss than it trains on."""
        return forward_and_loss(self.model, inputs, targets, ctx.loss_fn)

    def _forward(self, inputs: Any, targets: Any, ctx: StepContext) -> tuple[Any, torch.Tensor]:
        """One microbatch's output and loss under the trainer's autocast (training and validation
        alike); the first loss is checked to be a scalar."""
        with ctx.autocast():
            result = self.compute_loss(inputs, targets, ctx)
        if not self._loss_checked:
            own = type(self).compute_loss is not StepBody.compute_loss
            source = f"{type(self).__name__}.compute_loss" if own else None
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ValueError(
                    f"{source} must return a pair (output, loss), got {type(result).__name__}; return "
                    "the model's output beside the loss (MICROBATCH handlers and metrics read it)"
                )
            check_loss(result[1], ctx.loss_fn, source)
            self._loss_checked = True
        return result

    def eval_batches(self, data: Iterable, eval_iters: int | None, ctx: StepContext) -> Iterator[EvalResult]:
        """Validation's forward passes (the caller holds ``torch.no_grad()`` and ``model.eval()``)
        over at most ``eval_iters`` microbatches of ``data``: one :class:`EvalResult` per microbatch,
        in order; every rank of the body iterates it to the end together. The default: the
        :meth:`compute_loss` forward per microbatch; with loss parallelism the gathered output and
        loss."""
        for microbatch in data if eval_iters is None else itertools.islice(data, eval_iters):
            inputs, targets = ctx.prepare(microbatch)
            with ctx.loss_context():
                output, loss = self._forward(inputs, targets, ctx)
            if self.loss_parallel:
                output, loss = tensor_parallel.local_value(output), tensor_parallel.local_value(loss)
            yield EvalResult(loss, count_batch(inputs)[0] or 1, output, targets)

    def share_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` computed on the ranks that hold the outputs, on every rank of the body: the
        default, every rank holds its outputs and computed them."""
        return metrics

    def data_parallel_group(self, dp: Any) -> Any:
        """This rank's data-parallel peers (:func:`engine.parallel.data_parallel_group`), which
        validation metrics reduce over: ``dp``, else the ranks with the same tensor-parallel rank
        (the whole world without TP)."""
        positions = () if self.tp_mesh is None else (self.tp_mesh.get_local_rank(),)
        return parallel.data_parallel_group(dp, positions=positions)


class LocalStepBody(StepBody):
    """The step body of a model held whole on this rank (plain, DDP, FSDP2 or tensor-parallel):
    forward and backward per microbatch, gradients synchronised on the last one only.

    A step that is not ``loss_fn(model(inputs), targets)`` subclasses it and overrides
    :meth:`compute_loss` only, built over the trainer's ``model`` (the wrapped one under DDP or
    FSDP2). Unbound, it trains every trainable parameter of ``model`` in fp32.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tp_mesh, self.grad_scaler, self.loss_parallel = None, None, False

    def bind(self, model: torch.nn.Module, params: Sequence[torch.Tensor], **settings: Any) -> None:
        if model is not self.model:
            raise ValueError(
                f"step_body ({type(self).__name__}) runs another module than the Trainer's model: "
                "build the body over the model you pass to the Trainer (the wrapped one under DDP or "
                "FSDP2), e.g. Trainer(model, optimizer, loss_fn, step_body=MyBody(model, ...))"
            )
        super().bind(model, params, **settings)

    def run_step(self, microbatches: Sequence[Any], ctx: StepContext) -> StepResult:
        model = self.model
        if not model.training:
            model.train()
        n = len(microbatches)
        ddp = hasattr(model, "no_sync")
        fsdp = hasattr(model, "set_requires_gradient_sync")
        scaler = self.grad_scaler
        count_share = ctx.count_share
        loss_sum: Any = 0.0
        tokens = samples = 0
        for i, microbatch in enumerate(microbatches):
            inputs, targets = ctx.prepare(microbatch)
            last = i == n - 1
            if fsdp:  # gradients reduce-scatter only on the step's last microbatch
                model.set_requires_gradient_sync(last)
            with model.no_sync() if ddp and not last else _NO_CONTEXT, ctx.loss_context():
                output, loss = self._forward(inputs, targets, ctx)
                if scaler is None:
                    (loss / n).backward()
                else:
                    scaler.scale(loss / n).backward()
            loss = loss.detach()
            if self.loss_parallel:  # a replicated DTensor: every rank holds the whole value
                loss = tensor_parallel.local_value(loss)
            loss_sum = loss_sum + loss
            mb_samples, mb_tokens = count_batch(inputs)
            if count_share:  # one rank of a tensor-parallel group counts its samples
                samples += mb_samples
                tokens = tokens + mb_tokens  # an attention mask's sum stays a 0-dim tensor
            ctx.microbatch_done(i, loss, output, targets)
            # Free this microbatch's activations now, not when the next forward reassigns them:
            # the allocator can then reuse their memory for the next forward.
            del output, inputs, targets
        return StepResult(loss_sum / n, tokens, samples)


def check_step_body(step_body: Any, precision: str) -> None:
    """``Trainer(step_body=...)`` checked before anything is built: an instance implementing
    ``run_step`` (a :class:`StepBody` subclass; any other object has every member of
    :data:`PROTOCOL_MEMBERS`), fp16 loss scaling only where the body scales its loss. Each error
    names ``step_body`` (or the setting) and the fix."""
    if step_body is None:
        return
    if isinstance(step_body, type):
        raise TypeError(
            f"step_body must be a step body object, got the class {step_body.__name__}; pass an "
            f"instance, e.g. step_body={step_body.__name__}(model, ...)"
        )
    if isinstance(step_body, StepBody):  # the rest has the trainer's defaults
        missing = [] if type(step_body).run_step is not StepBody.run_step else ["run_step"]
    else:
        missing = [name for name in PROTOCOL_MEMBERS if not hasattr(step_body, name)]
    methods = [name for name in PROTOCOL_MEMBERS if name != "holds_outputs" and hasattr(step_body, name)]
    not_callable = [name for name in methods if not callable(getattr(step_body, name))]
    if missing or not_callable:
        what = [f"missing {', '.join(missing)}"] if missing else []
        what += [f"not callable: {', '.join(not_callable)}"] if not_callable else []
        raise TypeError(
            f"step_body ({type(step_body).__name__}) is not a step body: {'; '.join(what)}. Subclass "
            "hookloop.engine.StepBody and implement run_step (or subclass hookloop.engine.LocalStepBody "
            "and override compute_loss); an object of another class needs every member of "
            f"hookloop.engine.StepBody ({', '.join(PROTOCOL_MEMBERS)})"
        )
    if precision == "fp16-mixed" and not isinstance(step_body, LocalStepBody):
        raise ConfigError(
            "precision",
            f"'fp16-mixed' needs a body that scales its loss before the backward, which "
            f"step_body ({type(step_body).__name__}) does not promise: subclass "
            "hookloop.engine.LocalStepBody (its run_step scales), or use 'bf16-mixed'",
        )


def accumulation(step_body: Any, grad_accum_steps: int) -> int:
    """The microbatches a step takes: ``grad_accum_steps``, unless the body declares its own
    (``n_microbatches``, a pipeline schedule's), which ``grad_accum_steps`` may then only repeat."""
    declared = getattr(step_body, "n_microbatches", None)
    if declared is None:
        return grad_accum_steps
    if grad_accum_steps not in (1, declared):
        raise ConfigError(
            "grad_accum_steps",
            f"is {grad_accum_steps} but the step body ({type(step_body).__name__}) takes {declared} "
            "microbatches per step (a pipeline: pipeline.pp_batch_size // pp_microbatch_size); leave "
            "it unset",
        )
    return declared


def bind_step_body(
    step_body: Any, model: torch.nn.Module, params: Sequence[torch.Tensor], **settings: Any
) -> StepBody:
    """The body a trainer runs: ``step_body`` (checked by :func:`check_step_body`), else a
    :class:`LocalStepBody` over ``model``; a :class:`StepBody` is given the trainer's ``settings``
    (:meth:`StepBody.bind`: ``loss_fn``, ``tp_mesh``, ``grad_scaler``, ``loss_parallel``)."""
    if step_body is None:
        step_body = LocalStepBody(model)
    if isinstance(step_body, StepBody):
        step_body.bind(model, params, **settings)
    return step_body
