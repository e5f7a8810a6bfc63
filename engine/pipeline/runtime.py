"""The pipeline runtime: this rank's stages, the schedule over them, and the PP step body.

:func:`build_pipeline` cuts the model into stages (see :mod:`engine.pipeline.split`), wraps each
stage for data parallelism across the ``dp`` mesh dimension, and builds the schedule. A
:class:`~engine.Trainer` given ``step_body=runtime`` runs it as its step body (a
:class:`~engine.step_body.StepBody`) instead of the local one; both fire the same events.

Microbatches: the trainer's microbatches *are* the schedule's. One step takes
``n_microbatches = pp_batch_size // pp_microbatch_size`` microbatches of ``pp_microbatch_size``
samples, concatenates them into one batch and hands it to ``schedule.step``, which cuts it back
into the same microbatches. A short group (the end of an epoch) is padded with copies whose loss
weight is zero, so gradients are the mean over the real microbatches, as in the local body.

Precision: ``pipeline.dtype`` casts the stage modules themselves (pure low-precision parameters
and activations). ``Trainer(precision="bf16-mixed")`` runs the whole ``schedule.step`` (every
stage's forward, the loss, and the backward the schedule interleaves, which autocast leaves in
the forward's dtypes) and the validation forward under the trainer's autocast; activations then
cross stages in bfloat16. ``"fp16-mixed"`` is refused: loss scaling would have to reach inside the
schedule's backward.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hookloop.engine import parallel, tensor_parallel
from hookloop.engine.batch import count_batch
from hookloop.engine.errors import ConfigError
from hookloop.engine.pipeline import hf_patches
from hookloop.engine.pipeline.config import PipelineConfig
from hookloop.engine.pipeline.schedules import losses_computed
from hookloop.engine.pipeline.split import find_layer_container, plan_stages, split_stage_module
from hookloop.engine.step_batches import iter_groups
from hookloop.engine.step_body import EvalResult, StepBody, StepContext, StepResult, check_loss, grad_norm

__all__ = [
    "PipelineRuntime",
    "build_pipeline",
    "forward_through_stages",
    "pipeline_loss_fn",
    "stage_module",
    "stage_pair",
]

logger = logging.getLogger(__name__)


def stage_pair(inputs: Any, targets: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a prepared microbatch as the stages take them: a dict microbatch
    (Hugging Face convention) gives its ``input_ids`` and its ``labels``."""
    if isinstance(inputs, Mapping):
        extra = sorted(set(inputs) - {"input_ids", "attention_mask"})
        if "input_ids" not in inputs or extra:
            raise TypeError(
                f"pipeline stages take a dict microbatch's 'input_ids' (and 'labels') only, got keys "
                f"{sorted(inputs)}: drop {extra or ['inputs_embeds']} or run without pipeline parallelism"
            )
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "pipeline stages apply a causal mask only: this microbatch's attention_mask hides "
                "padding; pack sequences to full length (no padding) or drop the mask"
            )
        if targets is None:
            raise ValueError(
                "a dict microbatch without 'labels' under pipeline parallelism: the last stage's "
                "loss needs them (Hugging Face convention: labels unshifted, equal to input_ids)"
            )
        inputs = inputs["input_ids"]
    return inputs, targets


class PipelineRuntime(StepBody):
    """This rank's pipeline stages and their schedule, and the pipeline's step body (a
    :class:`~engine.step_body.StepBody` declaring ``n_microbatches``). Build with
    :func:`build_pipeline`. ``module`` (an ``nn.ModuleList`` of this rank's stage modules,
    DDP/FSDP-wrapped when the data-parallel degree is > 1) is what the optimizer and the Trainer
    take (see :mod:`engine.pipeline`)."""

    def __init__(
        self,
        config: PipelineConfig,
        stages: list[Any],
        mesh: Any,
        device: torch.device,
        loss_fn: Callable | None,
        rank_stages: dict[int, list[int]],
    ) -> None:
        self.config = config
        self.stages = stages
        self.schedule: Any = None  # set by build_pipeline: the schedule calls this runtime's loss
        self.device = device
        self.loss_fn = loss_fn
        self.module = nn.ModuleList(stage.submod for stage in stages)
        self.stage_ids = [stage.stage_index for stage in stages]
        self.num_stages = stages[0].num_stages
        self.n_microbatches = config.n_microbatches
        self.pp_group = stages[0].group
        self.pp_size = dist.get_world_size(self.pp_group)
        self.pp_rank = dist.get_rank(self.pp_group)
        names = mesh.mesh_dim_names or ()
        #: The data-parallel mesh dimension (the replicas of these stages), or None.
        self.dp_mesh = mesh["dp"] if "dp" in names else None
        self.dp_size = mesh["dp"].size() if "dp" in names else 1
        self.dp_rank = mesh["dp"].get_local_rank() if "dp" in names else 0
        self.has_first = any(stage.is_first for stage in stages)
        self.has_last = any(stage.is_last for stage in stages)
        # The pp-group rank holding the last stage broadcasts the losses.
        self._rank_stages = rank_stages
        last_stage_rank = next(r for r, ids in rank_stages.items() if self.num_stages - 1 in ids)
        self._loss_src = dist.get_global_rank(self.pp_group, last_stage_rank)
        self._raw_losses: dict[int, torch.Tensor] = {}
        self._weights: list[float] = []
        self._input_shape: tuple[int, ...] | None = None
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        #: The tensor-parallel mesh dimension of the stages' parameters (None without one).
        self.tp_mesh = tensor_parallel.find_tp_mesh(self._params)

    def bind(self, model: nn.Module, params: Sequence[torch.Tensor], **settings: Any) -> None:
        """The trainer's arguments checked against this runtime (it keeps its own layout); the
        stages take the trainer's ``loss_fn`` when the runtime has none."""
        if model is not self.module:
            raise ValueError("with step_body=runtime, the model must be runtime.module (its stages)")
        if settings["loss_parallel"]:
            raise ConfigError(
                "loss_parallel", "is not supported with pipeline parallelism (the schedule runs backward)"
            )
        if self.loss_fn is None:
            self.loss_fn = settings["loss_fn"]
        if self.loss_fn is None:
            raise ConfigError(
                "loss_fn",
                "is None but pipeline stages cannot return the model's own loss: the last stage "
                "needs loss_fn(logits, labels); build_pipeline sets one for Hugging Face causal "
                "LMs (pipeline.patch_causal_lm_model), else pass loss_fn to the Trainer or "
                "build_pipeline",
            )

    def parameters(self) -> Iterable[nn.Parameter]:
        """This rank's trainable parameters (build the optimizer over these)."""
        return self.module.parameters()

    @property
    def _comm_device(self) -> torch.device:
        return parallel.collective_device(self.pp_group)

    def __repr__(self) -> str:
        sched = type(self.schedule).__name__
        return (
            f"PipelineRuntime({sched}, stages {self.stage_ids} of {self.num_stages}, "
            f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}, "
            f"{self.n_microbatches} microbatches)"
        )

    # ------------------------------------------------------------------ the loss the schedule calls
    def _scheduled_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.loss_fn(output, target)  # never None: bind() refuses a runtime without a loss
        check_loss(loss, self.loss_fn)
        i = losses_computed(self.schedule)
        self._raw_losses[i] = loss.detach()
        weight = self._weights[i] if i < len(self._weights) else 1.0
        return loss if weight == 1.0 else loss * weight

    def _set_weights(self, n_real: int) -> None:
        n = self.n_microbatches
        # The schedule divides gradients by n when it scales them itself; otherwise the loss does.
        real = n / n_real if self.config.scale_grads_in_schedule else 1.0 / n_real
        self._weights = [real if i < n_real else 0.0 for i in range(n)]

    # ------------------------------------------------------------------ running the schedule
    def _stage_pair(self, ctx: StepContext, microbatch: Any) -> tuple[Any, Any, tuple[int, Any]]:
        """:func:`stage_pair` of one microbatch, and its ``(samples, tokens)``."""
        inputs, targets = ctx.prepare(microbatch)
        counts = count_batch(inputs)
        inputs, targets = stage_pair(inputs, targets)
        return inputs, targets, counts

    def _prepare(
        self, ctx: StepContext, microbatches: Sequence[Any]
    ) -> tuple[list[tuple[Any, Any]], list[tuple]]:
        n = self.n_microbatches
        if not 0 < len(microbatches) <= n:
            raise ValueError(
                f"a pipeline step takes {n} microbatches (pipeline.pp_batch_size // pp_microbatch_size), got "
                f"{len(microbatches)}; leave trainer.grad_accum_steps at {n}"
            )
        prepared = [self._stage_pair(ctx, mb) for mb in microbatches]
        pairs = [(x, y) for x, y, _ in prepared]
        counts = [c for _, _, c in prepared]
        cfg = self.config
        for i, (inputs, _) in enumerate(pairs):
            if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0:
                raise TypeError(
                    f"pipeline microbatch {i}: inputs must be a batched tensor, got {type(inputs).__name__}"
                )
            shape = tuple(inputs.shape)
            if shape[0] != cfg.pp_microbatch_size:
                raise ValueError(
                    f"pipeline.pp_microbatch_size is {cfg.pp_microbatch_size} but microbatch {i} holds "
                    f"{shape[0]} samples: make the loader's batch size pipeline.pp_microbatch_size"
                )
            if cfg.pp_seq_len is not None and (len(shape) < 2 or shape[1] != cfg.pp_seq_len):
                raise ValueError(
                    f"pipeline.pp_seq_len is {cfg.pp_seq_len} but microbatch {i} has shape {shape}"
                )
            if self._input_shape is None:
                self._input_shape = shape
            elif shape != self._input_shape:
                raise ValueError(
                    f"pipeline stages fixed their activation shapes at the first step ({self._input_shape}); "
                    f"microbatch {i} has shape {shape}: keep every microbatch the same shape "
                    "(pad or pack sequences)"
                )
        return pairs + [pairs[0]] * (self.n_microbatches - len(pairs)), counts

    def _run_schedule(self, pairs: list[tuple[Any, Any]], *, keep_outputs: bool) -> tuple[torch.Tensor, Any]:
        """One pass of the schedule over ``pairs``; returns every microbatch's (unweighted) loss on
        every pp rank, and the merged output on the last stage when ``keep_outputs``."""
        self._raw_losses = {}
        args = (torch.cat([x for x, _ in pairs]),) if self.has_first else ()
        kwargs: dict[str, Any] = {"return_outputs": keep_outputs}
        if self.has_last:
            kwargs.update(target=torch.cat([y for _, y in pairs]), losses=[])
        output = self.schedule.step(*args, **kwargs)
        n = self.n_microbatches
        if self.has_last:
            if sorted(self._raw_losses) != list(range(n)):
                raise RuntimeError(
                    f"the schedule computed losses for microbatches {sorted(self._raw_losses)}, "
                    f"not 0..{n - 1}"
                )
            values = torch.stack([self._raw_losses[i] for i in range(n)]).to(self._comm_device, torch.float64)
        else:
            values = torch.zeros(n, dtype=torch.float64, device=self._comm_device)
        dist.broadcast(values, src=self._loss_src, group=self.pp_group)
        self._raw_losses = {}
        return values.cpu(), output

    def run_step(self, microbatches: Sequence[Any], ctx: StepContext) -> StepResult:
        """The PP step body: the step's microbatches through the schedule as one batch (forward and
        backward of every stage), the losses broadcast to every pp rank, then each microbatch
        reported done (MICROBATCH) with its loss, and its output on the last stage."""
        self.module.train()
        n_real = len(microbatches)
        pairs, counts = self._prepare(ctx, microbatches)
        self._set_weights(n_real)
        observed = ctx.observes_microbatch
        with ctx.autocast():
            losses, output = self._run_schedule(pairs, keep_outputs=observed and self.has_last)
        counted = counts if self.has_first and ctx.count_share else []  # once per pipeline (and TP group)
        samples = sum(mb_samples for mb_samples, _ in counted)
        tokens = sum((mb_tokens for _, mb_tokens in counted), 0)
        outputs = (
            torch.split(output, self.config.pp_microbatch_size) if isinstance(output, torch.Tensor) else None
        )
        for i in range(n_real):
            ctx.microbatch_done(i, losses[i], outputs[i] if outputs is not None else None, pairs[i][1])
        return StepResult(losses[:n_real].mean(), tokens, samples)

    def rerun_losses(self, microbatches: Sequence[Any], ctx: StepContext) -> list[float]:
        """A step's forward and backward again, as :meth:`run_step` runs it (the same schedule,
        loss weights and collectives; every rank of the pipeline, and with stages replicated over
        ``dp`` every replica, calls it together), without reporting its microbatches: each real
        microbatch's loss, on every pp rank. The gradients are left in the parameters (the caller
        drops them). What a rerun of a bad step runs (the attribution handler's)."""
        self.module.train()
        pairs, _ = self._prepare(ctx, microbatches)
        self._set_weights(len(microbatches))
        with ctx.autocast():
            losses, _ = self._run_schedule(pairs, keep_outputs=False)
        return losses[: len(microbatches)].tolist()

    def forward_losses(self, microbatches: Sequence[Any], ctx: StepContext) -> list[float]:
        """Each of ``microbatches``' loss (any number, any size: one sample each is fine), forward
        only through every stage, on every pp rank (which all call it together); the caller holds
        ``torch.no_grad()`` and ``eval()`` as validation does."""
        prepared = [self._stage_pair(ctx, mb) for mb in microbatches]
        with ctx.autocast():
            losses, _ = self._forward_only([(x, y) for x, y, _ in prepared])
        return losses.tolist()

    def grad_norm(self) -> Any:
        """The total gradient norm over every stage: this rank's part, then one all-reduce over the
        pp group (every pp rank gets the same)."""
        norm = grad_norm(self._params, self.tp_mesh)
        if not isinstance(norm, torch.Tensor):  # no gradient on this rank
            return norm
        sq = (norm.detach().to(self._comm_device, torch.float64) ** 2).reshape(1)
        dist.all_reduce(sq, group=self.pp_group)
        return sq.sqrt()[0].to(norm.device, norm.dtype)

    @torch.no_grad()
    def _forward_only(self, pairs: list[tuple[Any, Any]]) -> tuple[torch.Tensor, list[Any] | None]:
        """Every microbatch's loss (on every pp rank) and output (on the last stage, else None),
        forward only, stage after stage (schedule-independent: some torch schedules cannot run
        ``eval``). Activations move with plain send/recv, their shape sent first, so any count and
        size of microbatches works (a short last batch too)."""
        x = torch.cat([x for x, _ in pairs])
        local = dict(zip(self.stage_ids, self.module))
        owner = {s: r for r, ids in self._rank_stages.items() for s in ids}
        h: Any = x if self.has_first else None
        for s in range(self.num_stages):
            if owner[s] != self.pp_rank:
                continue
            if s > 0 and owner[s - 1] != self.pp_rank:
                h = self._recv(owner[s - 1])
            h = local[s](h)
            if s < self.num_stages - 1 and owner[s + 1] != self.pp_rank:
                self._send(h, owner[s + 1])
        values = torch.zeros(len(pairs), dtype=torch.float64, device=self._comm_device)
        outputs = None
        if self.has_last:
            outputs = list(torch.split(h, [x.shape[0] for x, _ in pairs]))
            for i, (_, y) in enumerate(pairs):
                values[i] = float(self.loss_fn(outputs[i], y))
        dist.broadcast(values, src=self._loss_src, group=self.pp_group)
        return values.cpu(), outputs

    def _send(self, t: torch.Tensor, pp_rank: int) -> None:
        dst = dist.get_global_rank(self.pp_group, pp_rank)
        dist.send_object_list(
            [(tuple(t.shape), t.dtype)], dst=dst, group=self.pp_group, device=self._comm_device
        )
        dist.send(t.contiguous().to(self._comm_device), dst=dst, group=self.pp_group)

    def _recv(self, pp_rank: int) -> torch.Tensor:
        src = dist.get_global_rank(self.pp_group, pp_rank)
        meta: list[Any] = [None]
        dist.recv_object_list(meta, src=src, group=self.pp_group, device=self._comm_device)
        shape, dtype = meta[0]
        t = torch.empty(shape, dtype=dtype, device=self._comm_device)
        dist.recv(t, src=src, group=self.pp_group)
        return t.to(self.device)

    @property
    def holds_outputs(self) -> bool:
        """The outputs (and validation's evaluator) are on the rank holding the last stage."""
        return self.has_last

    def eval_batches(self, data: Iterable, eval_iters: int | None, ctx: StepContext) -> Iterator[EvalResult]:
        """Validation through the stages: ``n_microbatches`` microbatches of ``data`` (at most
        ``eval_iters``) per forward pass; each one's loss on every pp rank, its output on the last
        stage only (None elsewhere). Every pp rank must iterate it to the end together."""
        batches = data if eval_iters is None else itertools.islice(data, eval_iters)
        for group in iter_groups(batches, self.n_microbatches):
            prepared = [self._stage_pair(ctx, mb) for mb in group]
            with ctx.autocast():
                losses, outputs = self._forward_only([(x, y) for x, y, _ in prepared])
            for i, (_, y, counts) in enumerate(prepared):
                yield EvalResult(losses[i], counts[0] or 1, outputs[i] if outputs is not None else None, y)

    def share_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The last stage's metrics on every pp rank (pickled: small objects)."""
        box = [metrics]
        dist.broadcast_object_list(box, src=self._loss_src, group=self.pp_group, device=self._comm_device)
        return box[0]

    def data_parallel_group(self, dp: Any) -> Any:
        """``dp``, else the ``dp`` mesh dimension, else the ranks at the same tensor-parallel rank and
        pipeline rank."""
        positions = () if self.tp_mesh is None else (self.tp_mesh.get_local_rank(),)
        dp = self.dp_mesh if dp is None else dp
        return parallel.data_parallel_group(dp, positions=(*positions, self.pp_rank))


def build_pipeline(
    model: nn.Module,
    config: PipelineConfig | Any,
    dist_info: Any = None,
    loss_fn: Callable | None = None,
    *,
    dp_mode: str = "ddp",
    mesh: Any = None,
    tp_plan: Any = None,
    sequence_parallel: bool = False,
) -> PipelineRuntime:
    """Split ``model`` into stages for this rank and build the schedule.

    Args:
        model: the whole model (on CPU or meta-free; each stage deep-copies its part).
        config: a :class:`PipelineConfig` or the ``pipeline`` section of a run config.
        dist_info: what :func:`engine.init_distributed` returned; its mesh must have a ``pp``
            dimension (and ``dp`` for data parallelism): ``init_distributed(mesh_shape=(world //
            pp, pp), mesh_dim_names=("dp", "pp"))``.
        loss_fn: ``loss_fn(output, target)``; defaults to ``config.loss_fn``, then (for a Hugging
            Face causal LM) :func:`~engine.pipeline.hf_patches.causal_lm_loss`, else the Trainer's.
        dp_mode: ``"ddp"``, ``"fsdp"`` or ``"none"``: how each stage is replicated across ``dp``.
        mesh: a device mesh to use instead of ``dist_info.mesh``.
        tp_plan: with a ``tp`` mesh dimension of size > 1 (``init_distributed(**parallel_mesh(world,
            tp, pp))``), each stage's part is parallelized with this plan (see
            :func:`engine.tensor_parallel.apply_tensor_parallel`) before its data-parallel wrapper.
        sequence_parallel: hand the plan ``sequence_parallel=True``.
    """
    from torch.distributed.pipelining import PipelineStage

    from hookloop.engine.parallel import wrap_data_parallel
    from hookloop.engine.pipeline import schedules

    cfg = PipelineConfig.from_section(config)
    cfg.validate("pipeline")
    if dp_mode not in ("ddp", "fsdp", "none"):
        raise ConfigError("distributed.dp_mode", f"must be 'ddp', 'fsdp' or 'none', got {dp_mode!r}")
    mesh = mesh if mesh is not None else getattr(dist_info, "mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is None or "pp" not in names:
        raise ConfigError(
            "distributed.pp_size",
            "pipeline parallelism needs a device mesh with a 'pp' dimension: "
            "init_distributed(mesh_shape=(world_size // pp_size, pp_size), mesh_dim_names=('dp', 'pp'))",
        )
    pp_mesh = mesh["pp"]
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    if pp_size < 2:
        raise ConfigError(
            "distributed.pp_size", f"is {pp_size}: a pipeline needs at least 2 ranks; train without one"
        )
    plan, fqns = plan_stages(model, cfg, pp_size)
    num_stages = plan["num_stages"]
    device = getattr(dist_info, "device", None) or torch.device("cpu")
    dtype = cfg.torch_dtype
    dp_mesh = mesh["dp"] if "dp" in names and mesh["dp"].size() > 1 else None
    tp_mesh = mesh["tp"] if "tp" in names and mesh["tp"].size() > 1 else None
    stages = []
    if hf_patches.is_hf_causal_lm(model):
        hf_patches.check_hf_pipeline(model, cfg)
    loss_fn = pipeline_loss_fn(model, cfg, loss_fn)
    for stage_id in plan["rank_stages"][pp_rank]:
        part = stage_module(model, cfg, fqns, stage_id).to(device=device, dtype=dtype)
        if tp_mesh is not None:
            from hookloop.engine.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(part, tp_mesh, tp_plan, sequence_parallel=sequence_parallel)
        if dp_mesh is not None:
            part = wrap_data_parallel(part, dp_mode, mesh=dp_mesh)
        stage = PipelineStage(part, stage_id, num_stages, device, group=pp_mesh.get_group())
        if cfg.patch_stage_backward_maybe_with_nosync:
            hf_patches.patch_stage_backward(stage)
        if isinstance(part, nn.parallel.DistributedDataParallel):
            _infer_shapes_without_ddp_sync(stage)
        stages.append(stage)
    runtime = PipelineRuntime(cfg, stages, mesh, device, loss_fn, plan["rank_stages"])
    kwargs = {"loss_fn": runtime._scheduled_loss, "scale_grads": cfg.scale_grads_in_schedule}
    style = plan["style"]
    if style == "csv":
        schedule = schedules.build_csv_schedule(stages, plan["schedule"], cfg.n_microbatches, **kwargs)
    elif style == "single":
        schedule = plan["schedule"](stages[0], cfg.n_microbatches, **kwargs)
    else:
        schedule = plan["schedule"](stages, cfg.n_microbatches, **kwargs)
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    if (
        style != "single"
        and mapping is not None
        and any(mapping.get(s) != pp_rank for s in plan["rank_stages"][pp_rank])
    ):
        raise RuntimeError(
            f"{type(schedule).__name__} places stages {mapping} but this rank built "
            f"{plan['rank_stages'][pp_rank]}; this schedule's layout is not known here: "
            "use a pipeline.pp_schedule_csv file"
        )
    runtime.schedule = schedule
    logger.info("pipeline: %r", runtime)
    return runtime


def pipeline_loss_fn(model: nn.Module, config: PipelineConfig, loss_fn: Callable | None) -> Callable | None:
    """The last stage's loss: ``loss_fn``, else ``config.loss_fn``, else for a Hugging Face causal
    LM its shifted cross entropy (:func:`~engine.pipeline.hf_patches.causal_lm_loss`)."""
    default = hf_patches.causal_lm_loss if hf_patches.is_hf_causal_lm(model) else None
    return loss_fn or config.loss_fn or default


def stage_module(model: nn.Module, config: PipelineConfig, fqns: list[list[str]], stage_id: int) -> nn.Module:
    """Stage ``stage_id``'s part of ``model`` (a copy keeping the modules ``fqns[stage_id]`` names),
    with the pipeline forwards of a Hugging Face causal LM bound to it."""
    if not hf_patches.is_hf_causal_lm(model):
        return split_stage_module(model, fqns, stage_id)
    # stages of a Hugging Face causal LM run the pipeline forwards (pipeline.patch_* fields)
    container = find_layer_container(model)
    part = split_stage_module(model, fqns, stage_id, lambda c: hf_patches.layers_as_module_dict(c, container))
    hf_patches.patch_stage_module(
        part, patch_inner=config.patch_inner_model, patch_causal_lm=config.patch_causal_lm_model
    )
    return part


@torch.no_grad()
def forward_through_stages(
    model: nn.Module, config: PipelineConfig | Any, fqns: list[list[str]], inputs: torch.Tensor
) -> Any:
    """The pipeline's forward in this one process: ``inputs`` through every stage's module in stage
    order (what the ranks compute together), for checking a split before any process group exists."""
    cfg = PipelineConfig.from_section(config)
    h: Any = inputs
    for stage_id in range(len(fqns)):
        part = stage_module(model, cfg, fqns, stage_id)
        if cfg.torch_dtype is not None:
            part = part.to(dtype=cfg.torch_dtype)
        h = part(h)
    return h


def _infer_shapes_without_ddp_sync(stage: Any) -> None:
    """Run a DDP stage's first-step shape inference under ``no_sync()``, as its real forwards are.

    torch infers the stages' activation shapes by running the stage module (with gradients, on
    meta tensors) before the first real forward. Through DDP that forward arms the reducer, the
    inference backward marks every parameter ready, and the real last backward marks them all again:
    DDP's first-step bucket rebuild then counts each parameter twice and asserts ("rebuilt params
    size 52 vs 26") at the second step. Under ``no_sync()`` the inference leaves the reducer alone.
    """
    for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
        infer = getattr(stage, name, None)
        if infer is None:  # another torch: nothing of this kind to guard
            continue

        def guarded(*args: Any, _infer: Callable = infer, **kwargs: Any) -> Any:
            with stage.submod.no_sync():
                return _infer(*args, **kwargs)

        setattr(stage, name, guarded)
