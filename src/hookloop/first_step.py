"""Step 1, tried before anything starts: what ``hookloop check`` builds (and every ``hookloop
train``, which checks first) so that a config it calls ok trains its first step.

What would fail at step 1 is refused as one ``config error: <field>: ...`` line, before any process
group exists:

1. The model is built on the meta device (shapes, no memory, no time; for real when the meta device
   cannot build it). A ``ValueError``, ``TypeError`` or ``AssertionError`` from its construction
   (or an error raised from one) names the argument its message names (``model.d_model``), else
   ``model``.
2. With ``distributed.pp_size > 1``, the stage split every pipeline rank makes for the world size
   (:func:`~engine.pipeline.plan_stages`): every stage must hold at least one layer.
3. The data is built as the run builds it, for the first data-parallel rank (no worker processes;
   no cache file is written: a built-in corpus not made yet is tokenized in memory), and its first
   microbatch is drawn and collated by the recipe's ``collate_fn``. Errors name ``data.target``
   (the factory) or ``data`` (its samples or their collation).
4. The vocabulary: the first microbatch's largest token id against the model's ``vocab_size`` (or
   a Hugging Face model's input embedding). Token files were read before (:mod:`engine.data.vocab`).
5. When it is cheap, at most :data:`MAX_PARAMS` parameters and :data:`MAX_WORK` parameters x tokens
   of the microbatch (a forward of about 2e10 FLOPs: a second or two on one CPU core), the model is
   built for real and runs one forward and loss on that microbatch on CPU under ``torch.no_grad()``,
   in fp32 and whole (through every pipeline stage in turn with ``pp_size > 1``; no tensor-parallel
   plan or compile; activation checkpointing as configured). A larger model skips this and
   :meth:`FirstStep.summary` (the ``config ok`` line) says so.
6. The validation metrics are fed the model's output on the first validation batch (a small model's).
7. The trainer made and the handlers attached as train does (:func:`new_trainer`,
   :func:`attach_run_handlers`), on the CPU model or a stand-in; in one process, a small model's
   resume loaded into it (:meth:`~handlers.AsyncCheckpointer.load_resume`). Its order of handlers
   is :attr:`FirstStep.order` (``hookloop check --order``).

The random states of Python, NumPy and torch are as they were afterwards; nothing is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hookloop.engine import Trainer, build_lr_scheduler
from hookloop.engine.activation_checkpointing import apply_activation_checkpointing
from hookloop.engine.batch import count_batch, default_prepare_batch, forward_and_loss
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.data import SampleTrace
from hookloop.engine.data.vocab import model_vocab_size
from hookloop.engine.errors import ConfigError
from hookloop.engine.lr import schedule_settings
from hookloop.engine.pipeline import PipelineConfig, hf_patches, plan_stages
from hookloop.engine.pipeline.runtime import forward_through_stages, pipeline_loss_fn, stage_pair
from hookloop.engine.pipeline.split import find_layer_container
from hookloop.engine.step_body import check_loss
from hookloop.engine.validation import build_metrics
from hookloop.handlers import AsyncCheckpointer, attach_handlers
from hookloop.recipe import ResolvedModel, model_error
from hookloop.run_data import build_data
from hookloop.run_settings import resume_settings

__all__ = ["MAX_PARAMS", "MAX_WORK", "FirstStep", "attach_run_handlers", "new_trainer", "try_first_step"]

#: Models with more parameters are not built for real by the check (their forward is not tried).
MAX_PARAMS = 50_000_000
#: Parameters x tokens of the first microbatch above which the forward is not tried.
MAX_WORK = 10_000_000_000


@dataclass(frozen=True)
class FirstStep:
    """What :func:`try_first_step` found: the model's size, the first microbatch's inputs, the
    pipeline stages' layer counts (None without a pipeline), whether the forward ran (else why
    not), and the run's order of handlers (``trainer.describe()``)."""

    params: int
    inputs: str
    forward: bool
    skipped: str = ""
    stage_layers: tuple[int, ...] | None = None
    order: str = ""

    def summary(self) -> str:
        """One clause for the ``config ok`` line."""
        stages = ""
        if self.stage_layers is not None:
            counts = "+".join(map(str, self.stage_layers))
            stages = f", {len(self.stage_layers)} pipeline stages of {counts} layers"
        if self.forward:
            tried = f"first microbatch {self.inputs} ran forward and loss on CPU"
        else:
            tried = f"first microbatch {self.inputs} collated; forward not tried ({self.skipped})"
        return f"{self.params:,} parameters{stages}; {tried}"


@contextlib.contextmanager
def _rng_kept(seed: int) -> Iterator[None]:
    """Seeded as the run seeds before it builds (a data factory sees the same state both times);
    the previous states restored afterwards."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _describe(x: Any) -> str:
    """``int64[8, 64]``, ``{input_ids: int64[8, 64]}``, ``(float32[32, 64], ...)``."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}[{', '.join(map(str, x.shape))}]"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in x) + ")"
    return type(x).__name__


def _build(model: ResolvedModel, device: str | None) -> torch.nn.Module:
    try:
        return model.build(device)
    except ConfigError:
        raise
    except Exception as e:
        error = model_error(e, model.args, model.filled)
        if error is not None:
            raise error from None
        raise ConfigError.caused_by("model", f"{model.target} cannot be built", e) from None


def _token_ids(inputs: Any) -> torch.Tensor | None:
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if isinstance(ids, torch.Tensor) and ids.numel() and not ids.is_floating_point() and not ids.is_complex():
        return ids
    return None


def _check_vocab(model: ResolvedModel, built: torch.nn.Module, inputs: Any) -> None:
    ids = _token_ids(inputs)
    if ids is None:
        return
    vocab, field = model_vocab_size(model.recipe.build, model.args), "model.vocab_size"
    embeddings = getattr(built, "get_input_embeddings", None)
    if vocab is None and hf_patches.is_hf_causal_lm(built) and callable(embeddings):
        vocab, field = getattr(embeddings(), "num_embeddings", None), "model"
    largest = int(ids.max())
    if vocab is not None and largest >= vocab:
        raise ConfigError(
            field,
            f"the model has {vocab} token ids but the data's first microbatch holds id {largest}; "
            f"give the model a vocabulary of {largest + 1} or more, or data of its vocabulary",
        )


def try_first_step(cfg: Any, model: ResolvedModel, world_size: int) -> FirstStep:
    """Build what step 1 needs and try it (see the module docs); raise :class:`ConfigError`
    naming the field for what would fail."""
    pp, tp = cfg.distributed.pp_size, cfg.distributed.tp_size
    with _rng_kept(cfg.train.seed):
        built = _meta_model(model)
        if built is None or _count(built) <= MAX_PARAMS:  # small (or unknown): the real thing
            built = _build(model, None)
        params = _count(built)
        apply_activation_checkpointing(built, cfg.train.activation_checkpointing)
        pipe, fqns = None, None
        if pp > 1:
            pipe = PipelineConfig.from_section(cfg.pipeline)
            if hf_patches.is_hf_causal_lm(built):
                hf_patches.check_hf_pipeline(built, pipe)
            with warnings.catch_warnings():  # the config's validation gave the schedule's warnings
                warnings.simplefilter("ignore", UserWarning)
                _, fqns = plan_stages(built, pipe, pp, layers_hint=_layers_hint(model, built))
        dp = max(1, world_size // (tp * pp))
        data = build_data(cfg, 0, dp, model.recipe.collate_fn, num_workers=0, write_cache=False)
        prepare = cfg.data.prepare_batch(model.recipe) or default_prepare_batch
        inputs, targets = _prepared(prepare, data.train)
        described = _describe(inputs)
        layers = _stage_layers(built, fqns) if fqns is not None else None
        _check_vocab(model, built, inputs)
        samples, tokens = count_batch(inputs)
        tokens = max(int(tokens), samples, 1)
        skipped = ""
        if params > MAX_PARAMS or params * tokens > MAX_WORK:
            skipped = (
                f"{params:,} parameters x {tokens:,} tokens is above the check's bound of {MAX_PARAMS:,} "
                f"parameters and {MAX_WORK:.0e} parameters x tokens"
            )
        else:
            _forward(model, built, pipe, fqns, inputs, targets)
            if data.val is not None and cfg.validation.metrics:
                _feed_metrics(cfg, model, built, pipe, fqns, *_prepared(prepare, data.val))
        order = _attached(cfg, model, built, data, dp, real=not skipped)
        return FirstStep(params, described, not skipped, skipped, layers, order)


def _prepared(prepare: Any, loader: Any) -> tuple[Any, Any]:
    """The first microbatch of ``loader``, prepared as the step body prepares it."""
    try:
        batch = next(iter(loader))
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError.caused_by("data", "the first microbatch cannot be made", e) from None
    try:
        return prepare(batch, torch.device("cpu"))
    except TypeError as e:  # a layout the default does not know: data.inputs / data.targets say it
        raise ConfigError("data.inputs", str(e)) from None


def _feed_metrics(
    cfg: Any, model: ResolvedModel, built: Any, pipe: Any, fqns: Any, inputs: Any, targets: Any
) -> None:
    """Each validation metric fed the model's output on the first validation batch, and computed."""
    output = _forward(model, built, pipe, fqns, inputs, targets)
    for name, metric in build_metrics(cfg.validation).items():
        try:
            metric.update((output, targets))
            metric.compute()
        except Exception as e:
            what = f"refuses the model's output on the first validation batch {_describe(inputs)}"
            raise ConfigError.caused_by(f"validation.metrics.{name}", what, e) from None


def _attached(cfg: Any, model: ResolvedModel, built: torch.nn.Module, data: Any, dp: int, real: bool) -> str:
    """The run's trainer on ``built`` (``real``: the model built for real; else a stand-in) with its
    handlers attached, and with a small model the checkpoint a resume loads loaded; its order."""
    flops = model.flops_per_token(built, cfg)
    trainer = new_trainer(cfg, model, built if real else torch.nn.Linear(1, 1), device=torch.device("cpu"))
    attach_run_handlers(trainer, cfg, model, data, dp_size=dp, flops_per_token=flops)
    checkpointer = trainer.get_handler(AsyncCheckpointer)
    alone = os.environ.get("WORLD_SIZE", "1") == "1"  # else the run's resume refuses on every rank alike
    if real and alone and checkpointer is not None and checkpointer.resume is not None:
        try:
            with _unsaid():  # what the resume changes and warns of, the run's own resume says once
                checkpointer.load_resume()
        except CheckpointError as e:  # damage: the run's resume falls back or says so itself
            if isinstance(e, ConfigError):
                raise
    return trainer.describe()


@contextlib.contextmanager
def _unsaid() -> Iterator[None]:
    """Log records below ERROR dropped inside (the trial of what the run then does for real)."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def new_trainer(cfg: Any, resolved: ResolvedModel, model: torch.nn.Module, **settings: Any) -> Trainer:
    """``model``'s :class:`~engine.Trainer` with the config's optimizer, LR schedule and settings, and
    ``settings`` (the layout's: ``device``, ``step_body``, ...; ``loss_fn`` replaces the recipe's)."""
    optimizer = cfg.optimizer.build(model.parameters())
    return Trainer(
        model,
        optimizer,
        settings.pop("loss_fn", resolved.recipe.loss_fn),
        lr_scheduler=build_lr_scheduler(optimizer, **schedule_settings(cfg)),
        grad_clip_norm=cfg.train.grad_clip_norm,
        precision=cfg.train.precision,
        prepare_batch=cfg.data.prepare_batch(resolved.recipe),
        **settings,
    )


def attach_run_handlers(
    trainer: Trainer, cfg: Any, resolved: ResolvedModel, data: Any, *, dp_rank: int = 0, **runtime: Any
) -> list[Any]:
    """Every enabled shipped handler, then the config's ``handlers:`` entries, then ``extra``,
    attached by :func:`handlers.attach_handlers` with ``runtime`` (``dp_size``, ``run_dir``, ...);
    what the checkpoints record; the sample trace (``write_trace``: this rank writes it). Returns
    the attached handlers. ``hookloop check`` attaches them too (:func:`try_first_step`)."""
    write_trace = runtime.pop("write_trace", False)
    attached = attach_handlers(trainer, cfg, dataloader=data.train, sampler=data.sampler, **runtime)
    checkpointer = trainer.get_handler(AsyncCheckpointer)
    if checkpointer is not None:  # what its checkpoints record and a resume checks, before it loads
        checkpointer.record_settings(resume_settings(cfg, resolved))
    if cfg.data.trace_samples:  # one file per data-parallel rank
        run_dir, dp = runtime.get("run_dir", cfg.train.run_dir), runtime["dp_size"]
        SampleTrace(run_dir, data.train, rank=dp_rank, world_size=dp, write=write_trace).attach(trainer)
    return attached


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _meta_model(model: ResolvedModel) -> torch.nn.Module | None:
    """The model on the meta device; None when the meta device cannot build it (or the factory
    refuses its arguments: the real build reports that)."""
    try:
        return model.build("meta")
    except Exception:  # noqa: BLE001
        return None


def _layers_hint(model: ResolvedModel, built: torch.nn.Module) -> str | None:
    """The ``model`` argument that sets the layer count (``model.n_layers``), when one does."""
    try:
        n_layers = len(list(built.get_submodule(find_layer_container(built)).children()))
    except ConfigError:
        return None
    names = [k for k, v in model.args.items() if "layer" in k and v == n_layers]
    return f"model.{names[0]}" if len(names) == 1 else None


def _stage_layers(built: torch.nn.Module, fqns: list[list[str]]) -> tuple[int, ...]:
    container = find_layer_container(built)
    layers = {f"{container}.{name}" for name, _ in built.get_submodule(container).named_children()}
    return tuple(
        len(layers) if container in part else sum(1 for name in part if name in layers) for part in fqns
    )


def _forward(
    model: ResolvedModel,
    built: torch.nn.Module,
    pipe: PipelineConfig | None,
    fqns: list[list[str]] | None,
    inputs: Any,
    targets: Any,
) -> Any:
    ids = _token_ids(inputs)
    loss_fn = model.recipe.loss_fn
    try:
        with torch.no_grad():
            if pipe is None:
                output, loss = forward_and_loss(built, inputs, targets, loss_fn)
            else:
                x, y = stage_pair(inputs, targets)
                loss_fn = pipeline_loss_fn(built, pipe, loss_fn)
                if loss_fn is None:
                    raise ConfigError(
                        "pipeline.loss_fn",
                        f"is needed: model.target {model.target} computes its own loss, which the last "
                        "pipeline stage cannot; give the recipe a loss_fn",
                    )
                output = forward_through_stages(built, pipe, fqns, x)
                loss = loss_fn(output, y)
            check_loss(loss, loss_fn)
            return output
    except ConfigError:
        raise
    except Exception as e:
        hint = ""
        if isinstance(e, IndexError) and ids is not None:
            hint = (
                f" (its largest token id is {int(ids.max())}: does the model's vocabulary cover the data's?)"
            )
        where = "through the pipeline stages " if pipe is not None else ""
        what = f"forward and loss {where}on the first microbatch {_describe(inputs)} fail"
        raise ConfigError.caused_by("model", what, e, hint) from None
