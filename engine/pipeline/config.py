"""``PipelineConfig``: how a model is split into pipeline stages and scheduled.

The fields follow NeMo AutoModel's pipelining config, including its Hugging Face patching switches
(``patch_inner_model``, ``patch_causal_lm_model``, ``patch_stage_backward_maybe_with_nosync``,
implemented in :mod:`engine.pipeline.hf_patches`). The degree (``pp_size``) lives in the
distributed section.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hookloop.engine.checks import check_bool, check_int
from hookloop.engine.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["PipelineConfig", "bubble_fraction"]

# dtype names -> the torch dtype's attribute name (torch is imported only to resolve one)
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float64": "float64",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def _is_torch_dtype(value: Any) -> bool:
    """``value`` is a ``torch.dtype`` (none can exist before torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


#: torch schedules that refuse fewer microbatches per step than stages.
_NEED_A_MICROBATCH_PER_STAGE = ("Schedule1F1B", "ScheduleDualPipeV")


def bubble_fraction(n_microbatches: int, pp_size: int, stages_per_rank: int = 1) -> float:
    """Ideal idle fraction of a step: (p - 1) / (v*m + p - 1) for p ranks holding v stages each."""
    return (pp_size - 1) / (stages_per_rank * n_microbatches + pp_size - 1)


@dataclasses.dataclass
class PipelineConfig:
    """Pipeline-parallel settings (used when ``distributed.pp_size > 1``).

    Args:
        pp_schedule: a schedule name the installed torch offers (``gpipe``, ``1f1b``,
            ``interleaved1f1b``, ``loopedbfs``, ``interleavedzerobubble``, ``zbvzerobubble``,
            ``dualpipev``, ...); case and ``_`` are ignored. Unused when ``pp_schedule_csv`` is set.
        pp_schedule_csv: a CSV schedule file (one row of actions per rank); overrides the name.
        pp_microbatch_size: samples per microbatch (one trainer microbatch).
        pp_batch_size: samples per step per data-parallel rank; ``pp_batch_size //
            pp_microbatch_size`` microbatches go through the schedule each step.
        layers_per_stage: derive the stages from this many layers each.
        round_virtual_stages_to_pp_multiple: ``"up"``/``"down"``: round the derived stage count to
            a multiple of ``pp_size`` instead of failing.
        module_fqns_per_model_part: explicit module names per stage, in stage order.
        patch_inner_model: a Hugging Face causal LM's decoder (``model.model``) gets a stage forward:
            token ids or the previous stage's hidden states in, hidden states out, only the layers
            the stage holds. Required (true) for Hugging Face models; ignored for other models.
        patch_causal_lm_model: the causal-LM wrapper's forward returns logits (stage with
            ``lm_head``) or hidden states, never a loss object; the last stage's loss is then the
            model's shifted cross-entropy unless ``loss_fn`` is given. Required for Hugging Face
            models; ignored for others.
        patch_stage_backward_maybe_with_nosync: every stage's backward skips the data-parallel
            gradient sync except on the step's last microbatch, where DDP all-reduces and FSDP2
            reduce-scatters inside that backward (torch's default reduces FSDP2 gradients after
            the whole schedule). Matters only with a ``dp`` degree above 1.
        dtype: cast the stage modules to this dtype (``"bfloat16"``, ``torch.float16``, ...).
        scale_grads_in_schedule: let the schedule divide gradients by the number of microbatches
            (else the loss is divided before backward); gradients are the same either way.
        loss_fn: the loss for the last stage; defaults to the trainer's.
        pp_seq_len: expected sequence length of every microbatch (checked each step).
    """

    pp_schedule: str | None = "1f1b"
    pp_schedule_csv: str | None = None
    pp_microbatch_size: int = 1
    pp_batch_size: int = 1
    layers_per_stage: int | None = None
    round_virtual_stages_to_pp_multiple: str | None = None
    module_fqns_per_model_part: list[list[str]] | None = None
    patch_inner_model: bool = True
    patch_causal_lm_model: bool = True
    patch_stage_backward_maybe_with_nosync: bool = False
    dtype: torch.dtype | str | None = None
    scale_grads_in_schedule: bool = False
    loss_fn: Callable | None = None
    pp_seq_len: int | None = None

    @classmethod
    def from_section(cls, section: Any, **overrides: Any) -> PipelineConfig:
        """A ``PipelineConfig`` from the ``pipeline`` section of a loaded run config (or any object
        with the same attributes); ``overrides`` set fields the file cannot hold, e.g. ``loss_fn``."""
        if isinstance(section, cls):
            return dataclasses.replace(section, **overrides) if overrides else section
        values = {
            f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)
        }
        fqns = values.get("module_fqns_per_model_part")
        if fqns is not None:
            values["module_fqns_per_model_part"] = [list(part) for part in fqns]
        values.update(overrides)
        return cls(**values)

    @property
    def n_microbatches(self) -> int:
        return self.pp_batch_size // self.pp_microbatch_size

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch

        if self.dtype is None or isinstance(self.dtype, torch.dtype):
            return self.dtype
        return getattr(torch, _DTYPES[str(self.dtype).removeprefix("torch.")])

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (dtype as its name, loss_fn as its qualified name)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.module_fqns_per_model_part is not None:
            out["module_fqns_per_model_part"] = [list(p) for p in self.module_fqns_per_model_part]
        if _is_torch_dtype(self.dtype):
            out["dtype"] = str(self.dtype).removeprefix("torch.")
        if self.loss_fn is not None:
            fn = self.loss_fn
            out["loss_fn"] = (
                f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
            )
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, prefix: str = "pipeline", pp_size: int | None = None) -> None:
        """Raise :class:`ConfigError` naming the field at fault. With ``pp_size`` (the pipeline
        degree) also check the schedule against the installed torch and warn about the bubble."""
        p = prefix
        for name in ("pp_microbatch_size", "pp_batch_size"):
            check_int(f"{p}.{name}", getattr(self, name))
        for name in ("layers_per_stage", "pp_seq_len"):
            check_int(f"{p}.{name}", getattr(self, name), allow_none=True)
        if self.pp_batch_size % self.pp_microbatch_size:
            raise ConfigError(
                f"{p}.pp_batch_size",
                f"({self.pp_batch_size}) must be a multiple of {p}.pp_microbatch_size "
                f"({self.pp_microbatch_size}): the step's batch is cut into equal microbatches",
            )
        rounding = self.round_virtual_stages_to_pp_multiple
        if rounding is not None:
            if rounding not in ("up", "down"):
                raise ConfigError(
                    f"{p}.round_virtual_stages_to_pp_multiple",
                    f"must be 'up', 'down' or null, got {rounding!r}",
                )
            if self.layers_per_stage is None:
                raise ConfigError(
                    f"{p}.round_virtual_stages_to_pp_multiple",
                    f"only applies with {p}.layers_per_stage; set it or remove this",
                )
        fqns = self.module_fqns_per_model_part
        if fqns is not None:
            if self.layers_per_stage is not None:
                raise ConfigError(
                    f"{p}.module_fqns_per_model_part",
                    f"and {p}.layers_per_stage both split the model: set only one",
                )
            _check_fqns(f"{p}.module_fqns_per_model_part", fqns)
        if self.dtype is not None and not _is_torch_dtype(self.dtype):
            if str(self.dtype).removeprefix("torch.") not in _DTYPES:
                raise ConfigError(
                    f"{p}.dtype", f"must be one of {', '.join(_DTYPES)} or null, got {self.dtype!r}"
                )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ConfigError(f"{p}.loss_fn", "must be callable: loss_fn(output, target) -> scalar tensor")
        for name in (
            "scale_grads_in_schedule",
            "patch_inner_model",
            "patch_causal_lm_model",
            "patch_stage_backward_maybe_with_nosync",
        ):
            check_bool(f"{p}.{name}", getattr(self, name))
        if self.pp_schedule_csv is None and self.pp_schedule is None:
            raise ConfigError(
                f"{p}.pp_schedule", f"is needed (a schedule name) unless {p}.pp_schedule_csv is set"
            )
        if pp_size is not None:
            self.stage_plan(pp_size, prefix=p)

    def stage_plan(
        self, pp_size: int, n_layers: int | None = None, prefix: str = "pipeline"
    ) -> dict[str, Any]:
        """Check the schedule against ``pp_size`` (and the model's layer count if known); return
        ``{"schedule": class or CsvSchedule, "style", "num_stages", "rank_stages"}``.

        ``rank_stages[r]`` lists the stage ids rank ``r`` runs: one per rank for single-stage
        schedules, ``r + k*pp`` for looped ones, ``r`` and ``2p-1-r`` for V-shaped ones, and what
        the file says for a CSV schedule.
        """
        from hookloop.engine.pipeline import schedules

        p = prefix
        check_int("distributed.pp_size", pp_size)
        m = self.n_microbatches
        csv_schedule = None
        if self.pp_schedule_csv is not None:
            csv_schedule = schedules.parse_schedule_csv(
                self.pp_schedule_csv, pp_size=pp_size, n_microbatches=m, field=f"{p}.pp_schedule_csv"
            )
            style, schedule = "csv", csv_schedule
        else:
            schedule = schedules.resolve_schedule(self.pp_schedule, field=f"{p}.pp_schedule")
            style = schedules.schedule_style(schedule)
        num_stages = self._num_stages(style, pp_size, n_layers, csv_schedule, p)
        name = csv_schedule.path if csv_schedule else self.pp_schedule
        if style == "single" and num_stages != pp_size:
            raise ConfigError(
                f"{p}.pp_schedule",
                f"{name!r} runs one stage per rank ({pp_size} stages) but the split gives {num_stages}; "
                "use a multi-stage schedule (interleaved1f1b, ...) or split into pp_size stages",
            )
        if style == "v" and num_stages != 2 * pp_size:
            raise ConfigError(
                f"{p}.pp_schedule",
                f"{name!r} runs exactly two stages per rank ({2 * pp_size}) but the split gives {num_stages}",
            )
        if style == "loop" and num_stages % pp_size:
            raise ConfigError(
                f"{p}.pp_schedule",
                f"{name!r} needs a multiple of pp_size ({pp_size}) stages, got {num_stages}",
            )
        if csv_schedule is not None:
            rank_stages = csv_schedule.rank_stages
        elif style == "v":
            rank_stages = {r: [r, 2 * pp_size - 1 - r] for r in range(pp_size)}
        else:
            rank_stages = {r: list(range(r, num_stages, pp_size)) for r in range(pp_size)}
        if m < num_stages and getattr(schedule, "__name__", "") in _NEED_A_MICROBATCH_PER_STAGE:
            raise ConfigError(
                f"{p}.pp_batch_size",
                f"gives {m} microbatch(es) per step (pp_batch_size {self.pp_batch_size} // "
                f"pp_microbatch_size {self.pp_microbatch_size}) but {name!r} needs at least one per stage "
                f"({num_stages}); raise step_scheduler.global_batch_size (it sets pp_batch_size = global "
                "batch / data-parallel size) or lower train.local_batch_size",
            )
        if m < num_stages:
            v = num_stages // pp_size
            warnings.warn(
                f"{p}: {m} microbatches per step for {num_stages} pipeline stages leaves the pipeline "
                f"idle for about {bubble_fraction(m, pp_size, v):.0%} of each step (bubble (p-1)/(v*m+p-1)); "
                f"raise {p}.pp_batch_size / {p}.pp_microbatch_size to at least {num_stages}",
                UserWarning,
                stacklevel=2,
            )
        return {"schedule": schedule, "style": style, "num_stages": num_stages, "rank_stages": rank_stages}

    def _num_stages(self, style: str, pp: int, n_layers: int | None, csv_schedule: Any, p: str) -> int:
        if self.module_fqns_per_model_part is not None:
            n, field, says = len(self.module_fqns_per_model_part), "module_fqns_per_model_part", "lists"
        elif self.layers_per_stage is not None and n_layers is not None:
            n, field, says = math.ceil(n_layers / self.layers_per_stage), "layers_per_stage", "gives"
            if n % pp:
                rounding = self.round_virtual_stages_to_pp_multiple
                if rounding is None:
                    raise ConfigError(
                        f"{p}.layers_per_stage",
                        f"{n_layers} layers at {self.layers_per_stage} per stage give {n} stages, "
                        f"not a multiple of pp_size ({pp}); change layers_per_stage or set "
                        f"{p}.round_virtual_stages_to_pp_multiple to 'up' or 'down'",
                    )
                n = math.ceil(n / pp) * pp if rounding == "up" else max(pp, n // pp * pp)
        elif csv_schedule is not None:
            return csv_schedule.num_stages
        else:
            return pp if style == "single" else 2 * pp
        if csv_schedule is not None and n != csv_schedule.num_stages:
            scheduled = f"{csv_schedule.path} schedules {csv_schedule.num_stages}"
            raise ConfigError(f"{p}.{field}", f"{says} {n} stages but {scheduled}")
        return n


def _check_fqns(field: str, fqns: Any) -> None:
    if not isinstance(fqns, (list, tuple)) or not fqns:
        raise ConfigError(field, "must be a non-empty list of lists of module names, one list per stage")
    seen: dict[str, int] = {}
    for i, part in enumerate(fqns):
        if isinstance(part, str) or not isinstance(part, (list, tuple)) or not part:
            raise ConfigError(f"{field}[{i}]", f"must be a non-empty list of module names, got {part!r}")
        for name in part:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{field}[{i}]", f"module names must be non-empty strings, got {name!r}")
            if name in seen:
                raise ConfigError(
                    f"{field}[{i}]",
                    f"{name!r} is already in stage {seen[name]}: a module belongs to one stage",
                )
            seen[name] = i
