"""Reading a rank state file (``rank_NNNNN.json``) without trusting it.

Whoever can write the checkpoint directory can rewrite this file and its manifest entry, so before
a checkpoint is chosen every rank checks the file it would load (:func:`read_rank_file`): at most
:data:`MAX_BYTES`, JSON nested at most :data:`MAX_DEPTH` deep, every field the restore reads of the
type it needs, every tagged value decodable, and the RNG states accepted by throwaway generators.
A file that fails is damage: the loader falls back to the next older checkpoint, as for a damaged
``.distcp``. What a handler or a data source makes of its own state stays for its
``load_state_dict`` to check.
"""

from __future__ import annotations

import json
import numbers
import os
import random
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.state_codec import decode

__all__ = ["FORMAT", "MAX_BYTES", "MAX_DEPTH", "VERSION", "rank_file", "read_rank_file"]

FORMAT = "hookloop-checkpoint"
VERSION = 1
#: The largest rank state file read (bytes). Counters, positions and RNG states take about 40 kB;
#: the rest is what handlers' ``state_dict()`` return. A save writing a larger one fails.
MAX_BYTES = 64 << 20
#: The deepest nesting of JSON arrays and objects read (the restore recurses through it).
MAX_DEPTH = 64


class _Refused(ValueError):
    """What is wrong with the file's content (the message follows the file's name)."""


def rank_file(path: str, rank: int) -> tuple[str, bool]:
    """The state file rank ``rank`` loads from checkpoint ``path``, and whether it is rank 0's in
    place of its own (the checkpoint was written by another number of ranks)."""
    own = os.path.join(path, f"rank_{rank:05d}.json")
    if os.path.exists(own):
        return own, False
    return os.path.join(path, "rank_00000.json"), True


def read_rank_file(file: str, counters: Collection[str], step: int | None = None) -> dict[str, Any]:
    """The state in ``file`` once it passed the checks above; CheckpointError naming the file and
    the problem otherwise. ``counters``: the names of the counters the trainer keeps (no other
    attribute of its state may be set from a file); ``step``: the checkpoint's step, when known."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                raise CheckpointError(
                    f"{file} has {size} bytes, more than the {MAX_BYTES} a rank state file may have"
                )
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {file} ({e.strerror})") from None
    try:
        if len(data) > MAX_BYTES:
            raise _Refused(f"grew past {MAX_BYTES} bytes while it was read")
        state = json.loads(data)
        _check_depth(state)
        _check(state, frozenset(counters), step)
    except _Refused as e:
        raise CheckpointError(f"{file} {e}") from None
    except Exception as e:  # noqa: BLE001 - malformed or hostile JSON, values decode() or torch refuse
        raise CheckpointError(
            f"{file} is not a state file this version can restore ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    return state


def _check_depth(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Refused(f"nests deeper than {MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _want(ok: bool, field: str, value: Any, what: str) -> None:
    if not ok:
        raise _Refused(f"holds {field} = {str(value)[:80]!r}, not {what}")


def _check(state: Any, counters: frozenset[str], step: int | None) -> None:
    """Everything the restore reads, of the type it needs (see ``RankState._restore``)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise _Refused(f"is not a {FORMAT} v{VERSION} state file")
    saved = state.get("step")
    _want(_count(saved) and (step is None or saved == step), "step", saved, f"the checkpoint's step {step}")
    values = state.get("counters")
    _want(isinstance(values, dict), "counters", values, "an object")
    unknown = sorted(set(values) - counters)
    if unknown:
        raise _Refused(f"holds counters the trainer does not keep: {', '.join(unknown)[:200]}")
    for name in ("step", "epoch"):
        _want(name in values, f"counters.{name}", None, "present")
    for name, value in values.items():
        _want(_count(value), f"counters.{name}", value, "a count")
    _want(values["step"] == saved, "counters.step", values["step"], f"the state's step {saved}")
    length = state.get("epoch_length")
    _want(length is None or (_count(length) and length > 0), "epoch_length", length, "a length or null")
    handlers = state.get("handlers", {})
    _want(isinstance(handlers, dict), "handlers", handlers, "an object")
    for value in handlers.values():
        decode(value)
    if state.get("lr_scheduler") is not None:
        scheduler = decode(state["lr_scheduler"])
        _want(isinstance(scheduler, dict), "lr_scheduler", scheduler, "a scheduler's state_dict")
    if state.get("data") is not None:
        _check_position(decode(state["data"]))
    _check_rng(decode(state.get("rng")), "rng")
    last = state.get("last") or {}
    _want(isinstance(last, dict), "last", last, "an object")
    loss = last.get("loss", 0.0)
    _want(isinstance(loss, numbers.Real) and not isinstance(loss, bool), "last.loss", loss, "a number")
    metrics = last.get("metrics") or {}
    _want(isinstance(metrics, dict), "last.metrics", metrics, "an object")
    for name, value in metrics.items():
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        _want(ok, f"last.metrics.{name}", value, "a number")


def _check_position(position: Any) -> None:
    _want(isinstance(position, dict), "data", position, "a data position")
    for name in ("microbatches", "steps"):
        _want(_count(position.get(name)), f"data.{name}", position.get(name), "a count")
    for name in ("grad_accum_steps", "global_batch"):
        value = position.get(name)
        _want(value is None or _count(value), f"data.{name}", value, "a count or null")
    if position.get("pass_start_rng") is not None:
        _check_rng(decode(position["pass_start_rng"]), "data.pass_start_rng")


def _check_rng(rng: Any, field: str) -> None:
    """Put ``rng``'s states into throwaway generators: what they refuse, restoring would."""
    _want(isinstance(rng, dict) and {"python", "numpy", "torch"} <= set(rng), field, rng, "RNG states")
    version, internal, gauss = rng["python"]
    random.Random().setstate((version, tuple(internal), gauss))
    np.random.RandomState().set_state(rng["numpy"])
    _want(isinstance(rng["torch"], torch.Tensor), f"{field}.torch", rng["torch"], "a tensor")
    torch.Generator().set_state(rng["torch"])
    generators = rng.get("generators", [])
    _want(isinstance(generators, list), f"{field}.generators", generators, "a list")
    for state in generators:
        _want(isinstance(state, torch.Tensor), f"{field}.generators", state, "a list of tensors")
        torch.Generator().set_state(state)
