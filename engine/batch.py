"""How a microbatch meets the model: ``(inputs, targets)`` tuples and Hugging Face-style dicts.

* ``(inputs, targets, ...)``: the model is called ``model(inputs)`` and the loss is
  ``loss_fn(output, targets)``.
* ``{"input_ids": ..., "labels": ..., ...}`` (the Hugging Face convention): every key except
  ``labels`` and the metadata keys (:data:`METADATA_KEYS`, e.g. a mixture's ``source_idx``) goes to
  the model as a keyword argument, ``model(**inputs)``. With ``Trainer(loss_fn=None)`` the labels go
  too and the model computes its own loss (``output.loss``; a causal LM takes the labels
  *unshifted*, equal to ``input_ids``, and shifts them inside). With a ``loss_fn`` the labels are its
  targets: ``loss_fn(model(**inputs), labels)``.

* A dict with keys of your own: :func:`keyed_prepare_batch` (``data.inputs`` / ``data.targets``
  in a run config) takes ``model(batch[inputs])`` and ``loss_fn(output, batch[targets])``.

Tokens of a dict microbatch are ``attention_mask.sum()`` where it has a mask (a 0-dim tensor, so
counting never waits for the device), else ``input_ids.numel()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookloop.engine.errors import ConfigError

__all__ = [
    "METADATA_KEYS",
    "count_batch",
    "default_prepare_batch",
    "forward_and_loss",
    "keyed_prepare_batch",
    "model_loss",
]

#: Keys of a dict microbatch that describe it and never reach the model.
METADATA_KEYS = frozenset({"source_idx"})

_HF_HINT = (
    "Hugging Face convention: {'input_ids': ids, 'labels': ids}, labels unshifted (equal to "
    "input_ids; the model shifts them), -100 marks positions without a loss"
)


def default_prepare_batch(microbatch: Any, device: torch.device) -> tuple[Any, Any]:
    """``(inputs, targets, ...)`` -> ``(inputs, targets)``; a dict -> ``(model keyword arguments,
    labels or None)``; everything moved to ``device``."""
    if isinstance(microbatch, (list, tuple)) and len(microbatch) >= 2:
        return to_device(microbatch[0], device), to_device(microbatch[1], device)
    if microbatch is None:
        raise TypeError(
            "a microbatch is None: run(None, epoch_length=N) (ignite's data=None) gives the step None "
            "microbatches; pass Trainer(prepare_batch=fn) where fn(None, device) makes (inputs, targets), "
            "or set state.batch to the step's microbatches in a STEP_START handler"
        )
    if isinstance(microbatch, Mapping):
        if "input_ids" not in microbatch and "inputs_embeds" not in microbatch:
            raise TypeError(
                f"a dict microbatch needs 'input_ids' (or 'inputs_embeds'), got keys {sorted(microbatch)}: "
                f"name the input and target keys with data.inputs / data.targets, or follow the {_HF_HINT}"
            )
        inputs = {
            k: to_device(v, device) for k, v in microbatch.items() if k != "labels" and k not in METADATA_KEYS
        }
        labels = microbatch.get("labels")
        return inputs, (to_device(labels, device) if labels is not None else None)
    raise TypeError(
        f"a microbatch must be (inputs, targets) or a dict with 'input_ids' (and 'labels'), got "
        f"{type(microbatch).__name__}; pass Trainer(prepare_batch=fn) to unpack other layouts"
    )


def keyed_prepare_batch(inputs: str, targets: str) -> Callable[[Any, torch.device], tuple[Any, Any]]:
    """A ``prepare_batch`` for dict microbatches with keys of their own: ``(microbatch[inputs],
    microbatch[targets])`` on the device. A key the microbatch lacks is a :class:`ConfigError`
    naming ``data.inputs`` or ``data.targets`` and the keys found."""

    def prepare(microbatch: Any, device: torch.device) -> tuple[Any, Any]:
        found = sorted(map(str, microbatch)) if isinstance(microbatch, Mapping) else None
        for name, key in (("data.inputs", inputs), ("data.targets", targets)):
            if found is None:
                raise ConfigError(
                    name, f"names a key of a dict microbatch, got a {type(microbatch).__name__}"
                )
            if key not in microbatch:
                raise ConfigError(
                    name, f"{key!r} is not a key of the microbatch; keys found: {', '.join(found)}"
                )
        return to_device(microbatch[inputs], device), to_device(microbatch[targets], device)

    return prepare


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or lists, tuples and dicts of them) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def forward_and_loss(
    model: Callable, inputs: Any, targets: Any, loss_fn: Callable | None
) -> tuple[Any, torch.Tensor]:
    """``(output, loss)`` of one microbatch under the batch convention above."""
    if loss_fn is None:
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"Trainer(loss_fn=None) means the model computes its own loss from a dict microbatch "
                f"({_HF_HINT}), but this microbatch gave {type(inputs).__name__} inputs; pass a loss_fn "
                "for (inputs, targets) batches, or give dict microbatches"
            )
        output = model(**inputs) if targets is None else model(**inputs, labels=targets)
        return output, model_loss(output)
    if isinstance(inputs, Mapping):
        if targets is None:
            raise ValueError(
                f"loss_fn is set but the dict microbatch has no 'labels' (keys: {sorted(inputs)}): add "
                "'labels' as loss_fn's targets, or pass Trainer(loss_fn=None) so the model computes "
                f"its loss ({_HF_HINT})"
            )
        output = model(**inputs)
    else:
        output = model(inputs)
    return output, loss_fn(output, targets)


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss`` or ``output["loss"]``."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"Trainer(loss_fn=None) takes the loss the model computes (output.loss or output['loss']), "
            f"but the model returned {type(output).__name__} without one: put 'labels' in every dict "
            f"microbatch ({_HF_HINT}), or pass a loss_fn"
        )
    return loss


def count_batch(inputs: Any) -> tuple[int, int | torch.Tensor]:
    """``(samples, tokens)`` of one microbatch's inputs, read from shapes (tokens of a dict with an
    ``attention_mask`` are its sum, a 0-dim tensor). Float tensor inputs count samples only."""
    if isinstance(inputs, torch.Tensor):
        samples = inputs.shape[0] if inputs.dim() else 1
        return samples, (0 if inputs.is_floating_point() else inputs.numel())
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        mask = inputs.get("attention_mask")
        first = ids if isinstance(ids, torch.Tensor) else inputs.get("inputs_embeds")
        samples = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
        if isinstance(mask, torch.Tensor):
            return samples, mask.sum()
        return samples, (ids.numel() if isinstance(ids, torch.Tensor) else 0)
    return 0, 0
