"""How the optimizer's hyperparameters are laid out in a checkpoint: once per group of parameters
that share them, not once per parameter.

The flattened optimizer state (:data:`~.dcp_calls.STATE_DICT_OPTIONS`) keys everything by
parameter name so that ranks holding different parameters (pipeline stages) never write the same
key; for hyperparameters that means ``param_groups.<param>.<setting>`` for every setting of every
parameter: about 470 of the 585 entries of a 0.9 M-parameter Llama, each a DCP entry of its own
that is planned, serialized and written on every save. :func:`compact` replaces them with one entry
per set of parameters with equal settings, keyed by the first parameter's name::

    hyperparameters.<first param> = ((<param>, ...), ((<setting>, <value>), ...))

A tuple, so DCP stores it as one value. Keys stay apart across stages (a stage's first parameter is
its own) and are equal across ranks that hold the same parameters (DCP writes them once). Settings
that are not plain values (a tensor learning rate) stay in the flattened form.

Loading takes either layout, both in one checkpoint too: :func:`request` swaps the wanted
``param_groups.<param>.<setting>`` keys the checkpoint does not hold for its compact entries, and
the function it returns puts the settings back under their flattened keys once DCP has loaded them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.handlers.checkpoint.dcp_calls import exact_key

__all__ = ["PREFIX", "compact", "request"]

PREFIX = "hyperparameters."
_FLAT = "param_groups."
_PER_ENTRY = 1000  # parameter names per entry (the reader refuses an entry over ENTRY_MAX_BYTES)


def compact(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """``optim_sd`` (flattened) with its ``param_groups.<param>.<setting>`` entries grouped: one
    entry per set of parameters whose settings are equal (see the module docstring)."""
    settings: dict[str, list[tuple[str, Any]]] = {}
    out: dict[str, Any] = {}
    for key, value in optim_sd.items():
        if key.startswith(_FLAT):
            param, _, name = key[len(_FLAT) :].rpartition(".")
            settings.setdefault(param, []).append((name, value))
        else:
            out[key] = value
    groups: dict[tuple, list[str]] = {}
    for param, pairs in settings.items():
        keys = tuple((n, exact_key(v)) for n, v in pairs)
        if all(key is not None for _, key in keys):
            groups.setdefault(keys, []).append(param)
        else:
            out.update({f"{_FLAT}{param}.{n}": v for n, v in pairs})
    for params in groups.values():
        for i in range(0, len(params), _PER_ENTRY):  # each entry far below the reader's size bound
            chunk = params[i : i + _PER_ENTRY]
            out[f"{PREFIX}{chunk[0]}"] = (tuple(chunk), tuple(settings[chunk[0]]))
    return out


def request(optim_sd: dict[str, Any], stored: Iterable[str], path: str) -> Callable[[], None] | None:
    """Make ``optim_sd`` (flattened, about to be loaded from ``path``, whose index holds the keys
    ``stored``, ``optim.``-prefixed) ask for the checkpoint's compact entries in place of the
    flattened settings it does not hold. Returns the function that, once DCP has loaded, puts
    every wanted setting back under its flattened key; None when there is nothing to swap."""
    stored = set(stored)
    entries = [k.removeprefix("optim.") for k in stored if k.startswith(f"optim.{PREFIX}")]
    wanted = {k for k in optim_sd if k.startswith(_FLAT) and f"optim.{k}" not in stored}
    if not entries or not wanted:
        return None
    for key in wanted:
        del optim_sd[key]
    for key in entries:
        optim_sd[key] = None  # DCP puts the stored value in its place

    def expand() -> None:
        found: set[str] = set()
        for key in entries:
            for param, name, value in _settings(optim_sd.pop(key), key, path):
                flat = f"{_FLAT}{param}.{name}"
                if flat in wanted:
                    optim_sd[flat] = value
                    found.add(flat)
        missing = sorted(wanted - found)
        if missing:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(
                f"loading {path} failed: it holds no optimizer setting {', '.join(missing[:3])}{more}; "
                "if the optimizer changed since it was written, resume with load_optimizer=False"
            )

    return expand


def _settings(value: Any, key: str, path: str) -> Iterable[tuple[str, str, Any]]:
    """``(param, setting, value)`` of a compact entry; a CheckpointError when it is not one."""
    ok = (
        type(value) is tuple
        and len(value) == 2
        and type(value[0]) is tuple
        and type(value[1]) is tuple
        and all(type(p) is str for p in value[0])
        and all(type(s) is tuple and len(s) == 2 and type(s[0]) is str for s in value[1])
    )
    if not ok:
        raise CheckpointError(
            f"checkpoint {path} is damaged: its entry 'optim.{key}' is not a list of parameters and their "
            "optimizer settings; resume from another checkpoint or with load_optimizer=False"
        )
    return [(param, name, setting) for param in value[0] for name, setting in value[1]]
