"""Validation: the evaluator, the mean validation loss, ignite metrics reduced over the
data-parallel ranks only, and the ``validation`` config section.

    trainer.set_validation(val_loader, metrics={"accuracy": Accuracy()})
    trainer.validate()  # state.metrics["val_loss"] and ["val_accuracy"], then VALIDATION_END

What one validation does (the trainer runs it at STEP_END when every rank agreed on it:
``trainer.control.request_validate()`` on any rank: the step scheduler's ``val_every_steps`` asks
so; the validator counts no steps). The forward
passes are the step body's (:mod:`engine.step_body`: the local body's own forward, or the
pipeline's stages), so validation knows no layout::

    model.eval(), no gradients
    with ignite_world(body.data_parallel_group(dp)):   # idist's world: the data-parallel ranks
        items = body.eval_batches(data, eval_iters)     # per microbatch: loss, samples, output, targets
        where body.holds_outputs: evaluator.run(items)  # elsewhere (a pipeline's first stages): the losses
            per item: loss_total += loss * samples
                      metric.update((output, targets))            # every metric, ITERATION_COMPLETED
            metric.compute() -> evaluator.state.metrics["val_<name>"]    # COMPLETED
        metrics = body.share_metrics(metrics)           # a pipeline: the last stage's, on every stage
    val_loss = loss_total / samples, both summed over every rank
    state.metrics: val_loss, val_<name> (and whatever else is attached to the evaluator)
    for each other set of weights (add_weights(suffix, weights), e.g. an average of them):
        with weights(): the same again -> val_loss_<suffix>, val_<name>_<suffix>
    VALIDATION_END

**Reduction over the data-parallel ranks only.** An ignite metric reduces its state in
``compute()`` through ``ignite.distributed`` (``sync_all_reduce``, ``idist.all_reduce`` /
``all_gather`` / ``broadcast``), over idist's world: by default the whole process group. That is
right for plain data parallelism only: the ranks of a tensor-parallel group see the same samples
(a world-wide sum counts each sample tp times) and a pipeline's output exists on its last stage
only (the other stages never call ``compute()``, and a world-wide collective hangs). So the
evaluator runs inside :func:`~engine.ignite_adapter.ignite_world`, which makes idist's world the
data-parallel group (:func:`engine.parallel.data_parallel_group`): every tensor-parallel rank then
computes the same value over the ranks holding the same part of the model, and under a pipeline the
last stages reduce among themselves, then broadcast the result to the other stages. Every rank
publishes the same value, and, the validation shards being the same samples whatever the layout,
the value a single process computes over them.

What a custom :class:`ignite.metrics.Metric` must do to be reduced right: reduce its state through
ignite (``@sync_all_reduce("_attr", "_other:MAX")`` on ``compute``, or ``idist.all_reduce`` /
``all_gather`` / ``broadcast`` without a ``group=``), never with ``torch.distributed`` on the
default group; and count each sample once per rank (sums and counts, not per-batch means), so the
value does not depend on how the samples are batched or shared (a pipeline feeds the same samples
in groups of ``n_microbatches``). :class:`~engine.token_accuracy.TokenAccuracy` is an example.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from ignite.engine import Engine
from ignite.metrics import Metric

from hookloop.engine import parallel
from hookloop.engine.checks import check_int
from hookloop.engine.config import METRIC_NAME, ValidationConfig, check_metric_name, metric_target_and_args
from hookloop.engine.errors import ConfigError
from hookloop.engine.events import Events
from hookloop.engine.ignite_adapter import ignite_world
from hookloop.engine.step_batches import data_length
from hookloop.engine.step_body import EvalResult
from hookloop.engine.targets import bind_arguments, resolve_target

if TYPE_CHECKING:
    from hookloop.engine.trainer import Trainer

__all__ = ["ValidationConfig", "Validator", "build_metrics", "check_metrics"]


_UNSET = object()
_END = object()


def check_metrics(metrics: Mapping[str, Metric] | None, prefix: str = "metrics") -> dict[str, Metric]:
    """``metrics`` (name -> ignite ``Metric``) checked: names that make ``val_<name>``, one
    instance per name. Returns them as a dict."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{prefix} must be a mapping name -> ignite Metric, got {type(metrics).__name__}")
    seen: dict[int, str] = {}
    for name, metric in metrics.items():
        check_metric_name(name, f"{prefix}.{name}")
        if not isinstance(metric, Metric):
            raise TypeError(
                f"{prefix}[{name!r}] must be an ignite Metric (e.g. ignite.metrics.Accuracy()), got "
                f"{type(metric).__name__}"
            )
        if id(metric) in seen:
            raise ValueError(
                f"{prefix}[{name!r}] is the same Metric object as {prefix}[{seen[id(metric)]!r}]: give each "
                "name its own instance (each one is updated once per microbatch)"
            )
        seen[id(metric)] = name
    return dict(metrics)


def build_metrics(section: ValidationConfig, prefix: str = "validation") -> dict[str, Metric]:
    """The metrics ``section`` names, built: each target resolved, its arguments checked against its
    signature, then called. Errors are :class:`ConfigError` naming ``<prefix>.metrics.<name>.target``
    or ``<prefix>.metrics.<name>.<argument>``; building a metric touches no process group, so
    ``hookloop check`` runs this before anything starts."""
    out: dict[str, Metric] = {}
    for name, spec in section.metrics.items():
        where = f"{prefix}.metrics.{name}"
        target, args = metric_target_and_args(spec, where)
        obj = resolve_target(target, f"{where}.target")
        if isinstance(obj, Metric) or not callable(obj):
            raise ConfigError(
                f"{where}.target",
                f"{target} is a {type(obj).__name__}: name an ignite Metric class or a factory returning one",
            )
        if isinstance(obj, type) and not issubclass(obj, Metric):
            raise ConfigError(
                f"{where}.target", f"{target} is a class but not an ignite Metric (ignite.metrics.Metric)"
            )
        bind_arguments(obj, args, prefix=where, target=target)
        try:
            metric = obj(**args)
        except (TypeError, ValueError) as e:
            raise ConfigError(where, f"{target}(...) refused its arguments: {e}") from None
        if not isinstance(metric, Metric):
            raise ConfigError(
                f"{where}.target", f"{target} returned {type(metric).__name__}, not an ignite Metric"
            )
        out[name] = metric
    return out


class Validator:
    """The trainer's validation (``trainer.validator``): what :meth:`Trainer.set_validation`
    configures, :meth:`Trainer.validate` runs and ``trainer.evaluator`` is. See the module
    docstring for one validation's order and the data-parallel reduction."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.data: Iterable | None = None
        self.eval_iters: int | None = None
        #: name -> ignite metric, attached to the evaluator as ``val_<name>``.
        self.metrics: dict[str, Metric] = {}
        self._dp: Any = None
        self._group: Any = _UNSET
        self._evaluator: Engine | None = None
        self._loss_total = torch.zeros((), dtype=torch.float64)
        self._samples = 0
        #: suffix -> the weights validated beside the model's own (:meth:`add_weights`)
        self._weights: dict[str, Callable[[], AbstractContextManager[Any]]] = {}

    def configure(
        self,
        data: Iterable,
        eval_iters: int | None = None,
        every_steps: int | None = None,
        metrics: Mapping[str, Metric] | None = None,
        dp_group: Any = None,
    ) -> None:
        if every_steps is not None:
            raise ConfigError(
                "set_validation(every_steps=)",
                "was removed: the validation cadence is the step scheduler's val_every_steps=N "
                "(step_scheduler.val_every_steps), or ask with trainer.control.request_validate()",
            )
        check_int("eval_iters", eval_iters, allow_none=True)
        metrics = check_metrics(metrics)
        evaluator = self.evaluator
        for metric in self.metrics.values():
            metric.detach(evaluator)
        for name, metric in metrics.items():
            metric.attach(evaluator, f"val_{name}")
        self.data, self.eval_iters, self.metrics = data, eval_iters, metrics
        if dp_group is not self._dp:
            self._dp, self._group = dp_group, _UNSET

    def vote(self) -> bool:
        """This rank's vote for a validation at this step, in the step's agreement: there is
        validation data and a validation was asked for (``trainer.control.request_validate()``).
        Any rank's vote makes every rank validate (``trainer.control.decided.validate``)."""
        return self.data is not None and self._trainer.control.validate

    @property
    def evaluator(self) -> Engine:
        """The ignite engine validation runs on; its process function returns ``(model_output,
        targets)``. Under pipeline parallelism it runs on the rank holding the last stage only."""
        if self._evaluator is None:
            self._evaluator = Engine(self._step)
            self._evaluator.logger.setLevel(logging.WARNING)
        return self._evaluator

    @property
    def dp_group(self) -> Any:
        """The process group metrics reduce over (None: this rank alone); found at the first
        validation (a collective every rank joins) unless ``set_validation(dp_group=...)`` gave it."""
        if self._group is _UNSET:
            self._group = self._trainer.step_body.data_parallel_group(self._dp)
        return self._group

    def add_weights(self, suffix: str, weights: Callable[[], AbstractContextManager[Any]]) -> None:
        """Validate other weights too, at every validation: the same validation runs again inside
        ``weights()``, a context manager in which the model holds them (and which puts the trained
        ones back), and publishes ``val_loss_<suffix>`` and ``val_<name>_<suffix>`` beside
        ``val_loss`` before VALIDATION_END (an average of the weights: ``suffix="ema"``). The
        validation data is read once per set of weights: it must be re-iterable."""
        if not isinstance(suffix, str) or not METRIC_NAME.fullmatch(suffix):
            raise ValueError(f"suffix {suffix!r}: use letters, digits and underscores (val_loss_<suffix>)")
        if suffix in self._weights:
            raise ValueError(f"weights with the suffix {suffix!r} are validated already: give another suffix")
        self._weights[suffix] = weights

    @torch.no_grad()
    def run(self) -> float:
        """One validation; returns ``val_loss`` (see :meth:`Trainer.validate`)."""
        if self.data is None:
            raise RuntimeError("no validation data: call trainer.set_validation(data) first")
        trainer = self._trainer
        start = time.perf_counter()
        val_loss, metrics = self._measure()
        state = trainer.state
        state.metrics.update(metrics)
        state.metrics["val_loss"] = val_loss
        for suffix, weights in self._weights.items():
            with weights():
                loss, more = self._measure()
            state.metrics.update({f"{name}_{suffix}": value for name, value in more.items()})
            state.metrics[f"val_loss_{suffix}"] = loss
        state.times["validation"] = time.perf_counter() - start
        trainer.fire(Events.VALIDATION_END)
        return val_loss

    def _measure(self) -> tuple[float, dict[str, Any]]:
        """The validation loss and metrics of the model's weights as they are."""
        trainer = self._trainer
        group = self.dp_group
        body = trainer.step_body
        model = trainer.model
        was_training = model.training
        model.eval()
        self._loss_total = torch.zeros((), dtype=torch.float64)
        self._samples = 0
        try:
            with ignite_world(group):
                items = body.eval_batches(self.data, self.eval_iters, trainer.step_context)
                metrics = self._run_evaluator(items) if body.holds_outputs else self._count_losses(items)
                metrics = body.share_metrics(metrics)
        finally:
            model.train(was_training)
        total = torch.stack([self._loss_total, torch.tensor(float(self._samples), dtype=torch.float64)])
        if parallel.world_size() > 1:
            total = parallel.all_reduce_sum(total)
        if total[1] == 0:
            raise ValueError("validation data yielded no batches: pass non-empty data to set_validation")
        return float(total[0] / total[1]), metrics

    def _run_evaluator(self, items: Iterator[EvalResult]) -> dict[str, Any]:
        """The evaluator over the body's items (one per microbatch: ``length`` of them, when the
        data has a length); its metrics."""
        first = next(items, _END)
        if first is _END:
            return {}
        length, eval_iters = data_length(self.data), self.eval_iters
        batches = eval_iters if length is None else min(length, eval_iters or length)
        evaluator = self.evaluator
        evaluator.run(itertools.chain([first], items), max_epochs=1, epoch_length=batches)
        return dict(evaluator.state.metrics)

    def _count_losses(self, items: Iterator[EvalResult]) -> dict[str, Any]:
        """On a rank without the outputs: the losses only (the metrics come from the rank with them)."""
        for item in items:
            self._add_loss(item)
        return {}

    def _step(self, engine: Engine, item: EvalResult) -> tuple[Any, Any]:
        """The evaluator's process function: one microbatch's loss into the totals; returns
        ``(model_output, targets)`` for the metrics."""
        self._add_loss(item)
        return item.output, item.targets

    def _add_loss(self, item: EvalResult) -> None:
        watchdog = self._trainer.watchdog
        if watchdog is not None:
            watchdog.feed()
        # Weighted by samples: the mean over every validation sample, whatever the batches' sizes
        # and however the samples are shared among ranks.
        self._loss_total += torch.as_tensor(item.loss).detach().double().cpu() * item.samples
        self._samples += item.samples
