"""Cut a model into pipeline stages by module names.

A stage is a deep copy of the model with every module outside the stage removed: a plain child is
set to ``None`` and a ``ModuleDict`` entry is deleted, so parameter names stay those of the whole
model and the model's own ``forward`` runs the stage as long as it skips parts that are ``None``
(the examples' GPT does; a Hugging Face causal LM gets such forwards from
:mod:`engine.pipeline.hf_patches`). Modules without parameters stay on every stage. The default
split puts the modules before the layer container (embeddings) on the first stage, the ones after
it (norm, head) on the last, and spreads the layers evenly over the stages.

Every stage holds at least one layer (a stage of only embeddings or only the head is refused: the
models' stage forwards run the layers they hold): :func:`plan_stages` checks the split every rank
will make, from the model alone (built on the meta device is enough), before any process group
exists; ``hookloop check --nproc N`` runs it.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

from torch import nn

from hookloop.engine.errors import ConfigError
from hookloop.engine.pipeline.config import PipelineConfig

__all__ = ["default_module_fqns", "find_layer_container", "plan_stages", "split_stage_module"]

_LAYER_NAMES = ("layers", "blocks", "h", "layer")
_FIELD = "pipeline.module_fqns_per_model_part"


def find_layer_container(model: nn.Module) -> str:
    """The dotted name of the module holding the model's repeated layers (a ``ModuleDict`` or
    ``ModuleList``): a child of the model (``blocks``) or, when it has none, a child of one of its
    children (``model.layers`` in a Hugging Face causal LM)."""
    containers = _layer_containers(model) or [
        f"{name}.{found}" for name, child in model.named_children() for found in _layer_containers(child)
    ]
    for name in _LAYER_NAMES:
        for found in containers:
            if found.rpartition(".")[2] == name:
                return found
    if len(containers) == 1:
        return containers[0]
    raise ConfigError(
        _FIELD,
        f"cannot tell which child of {type(model).__name__} holds its layers "
        f"(candidates: {containers or 'none'}); list the modules of each stage in "
        "pipeline.module_fqns_per_model_part",
    )


def _layer_containers(module: nn.Module) -> list[str]:
    return [n for n, c in module.named_children() if isinstance(c, (nn.ModuleDict, nn.ModuleList))]


def default_module_fqns(
    model: nn.Module,
    num_stages: int,
    layers_field: str = "distributed.pp_size",
    layers_hint: str | None = None,
) -> list[list[str]]:
    """Module names per stage: children before the layer container on stage 0, children after it
    on the last stage, layers spread evenly (earlier stages take the remainder). Fewer layers than
    stages is a :class:`ConfigError` on ``layers_field``; ``layers_hint`` names the model's own
    setting of its layer count (``model.n_layers``) in the message."""
    container = find_layer_container(model)
    # Modules before the container (at each level of its dotted name) go first, after it last:
    # GPT: tok_emb, pos_emb | blocks | norm, head; Llama: model.embed_tokens | model.layers |
    # model.norm, model.rotary_emb, lm_head.
    before: list[str] = []
    after: list[str] = []
    parent, prefix = model, ""
    for name in container.split("."):
        names = [n for n, _ in parent.named_children()]
        at = names.index(name)
        before += [prefix + n for n in names[:at]]
        after = [prefix + n for n in names[at + 1 :]] + after
        parent, prefix = getattr(parent, name), f"{prefix}{name}."
    layer_keys = [f"{container}.{k}" for k, _ in parent.named_children()]
    n_layers = len(layer_keys)
    if n_layers < num_stages:
        more = (
            f"{layers_hint} >= {num_stages}" if layers_hint else f"at least {num_stages} layers in the model"
        )
        raise ConfigError(
            layers_field,
            f"{n_layers} layer(s) in {container} cannot give each of {num_stages} pipeline stages one "
            f"(stage {n_layers} would be empty of layers and fail at step 1); use fewer stages (a lower "
            f"distributed.pp_size, a larger pipeline.layers_per_stage, or a schedule with one stage per "
            f"rank) or {more}",
        )
    base, extra = divmod(n_layers, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]  # the first `extra` take one more
    parts = [layer_keys[a:b] for a, b in itertools.pairwise(starts)]
    parts[0] = before + parts[0]
    parts[-1] = parts[-1] + after
    return parts


def plan_stages(
    model: nn.Module, config: PipelineConfig, pp_size: int, *, layers_hint: str | None = None
) -> tuple[dict[str, Any], list[list[str]]]:
    """The schedule's plan (:meth:`PipelineConfig.stage_plan`) for ``pp_size`` pipeline ranks and
    the module names of every stage, checked: every name exists, every parameter is in exactly one
    stage, and every stage holds at least one layer. ``model`` may live on the meta device.
    Errors name ``distributed.pp_size``, ``pipeline.layers_per_stage`` or
    ``pipeline.module_fqns_per_model_part[s]``."""
    fqns = config.module_fqns_per_model_part
    if fqns is not None:
        plan = config.stage_plan(pp_size)
        _check_cover(model, fqns)
        _check_layers_per_stage(model, fqns)
        return plan, fqns
    container = model.get_submodule(find_layer_container(model))
    plan = config.stage_plan(pp_size, len(list(container.children())))
    field = "pipeline.layers_per_stage" if config.layers_per_stage is not None else "distributed.pp_size"
    fqns = default_module_fqns(model, plan["num_stages"], field, layers_hint)
    _check_cover(model, fqns)
    return plan, fqns


def _check_layers_per_stage(model: nn.Module, fqns_per_stage: list[list[str]]) -> None:
    try:
        container = find_layer_container(model)
    except ConfigError:  # no layer container to speak of: the names are the user's whole say
        return
    for s, part in enumerate(fqns_per_stage):
        if not any(n == container or n.startswith(container + ".") for n in part):
            raise ConfigError(
                f"{_FIELD}[{s}]",
                f"stage {s} ({part}) holds none of the layers in {container}: a stage's forward runs "
                "the layers it holds; give every stage at least one",
            )


def split_stage_module(
    model: nn.Module,
    fqns_per_stage: list[list[str]],
    stage: int,
    prepare: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """A deep copy of ``model`` that keeps only the modules of stage ``stage`` (and every module
    without parameters, such as rotary embeddings or dropout, which any stage may need).
    ``prepare(copy)`` runs before pruning (e.g. to turn a ``ModuleList`` of layers into a
    ``ModuleDict``)."""
    _check_cover(model, fqns_per_stage)
    keep = set(fqns_per_stage[stage])
    part = copy.deepcopy(model)
    if prepare is not None:
        prepare(part)
    _prune(part, "", keep)
    if not any(True for _ in part.parameters()):
        raise ConfigError(f"{_FIELD}[{stage}]", f"stage {stage} holds no parameters ({sorted(keep)})")
    return part


def _prune(module: nn.Module, prefix: str, keep: set[str]) -> None:
    for name, child in list(module.named_children()):
        fqn = prefix + name
        if fqn in keep or not any(True for _ in child.parameters()):
            continue
        if any(k.startswith(fqn + ".") for k in keep):
            _prune(child, fqn + ".", keep)
        elif isinstance(module, nn.ModuleDict):
            del module[name]
        elif isinstance(module, nn.ModuleList):
            raise ConfigError(
                _FIELD,
                f"{prefix.rstrip('.')} is a ModuleList: removing {fqn} would renumber the others; "
                "make it a ModuleDict keyed '0', '1', ... so layer names stay stable",
            )
        else:
            setattr(module, name, None)


def _check_cover(model: nn.Module, fqns_per_stage: list[list[str]]) -> None:
    """Every name exists, and every parameter belongs to exactly one stage."""
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    tensor_owner: dict[int, tuple[str, int]] = {}
    for s, part in enumerate(fqns_per_stage):
        for fqn in part:
            if fqn not in modules:
                raise ConfigError(f"{_FIELD}[{s}]", f"{type(model).__name__} has no module {fqn!r}")
            for pname, param in modules[fqn].named_parameters(prefix=fqn, remove_duplicate=False):
                if pname in owner and owner[pname] != s:
                    raise ConfigError(f"{_FIELD}[{s}]", f"{pname} is already in stage {owner[pname]}")
                owner[pname] = s
                first = tensor_owner.setdefault(id(param), (pname, s))
                if first[1] != s:  # one tensor under two names, e.g. tied input/output embeddings
                    raise ConfigError(
                        f"{_FIELD}[{s}]",
                        f"{pname} is the same parameter as {first[0]} in stage {first[1]} (tied weights): "
                        "each stage would train its own copy; untie them (Hugging Face: "
                        "tie_word_embeddings=False) or put both modules on one stage",
                    )
    missing = [n for n, _ in model.named_parameters() if n not in owner]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            _FIELD, f"parameters in no stage would never train: {shown}; add their modules to a stage"
        )
