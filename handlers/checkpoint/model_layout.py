"""How a checkpoint's model parameters relate to this model's: the same ones under the names of
another pipeline split (a run with stages resumes a run without and the reverse, parameters and
optimizer state loaded by name), or another layout, described in a few words for the error."""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "STAGE_PREFIX",
    "back_to_names",
    "describe_layout_difference",
    "names_across_split",
    "stored_under_these_names",
    "under_names",
]


STAGE_PREFIX = re.compile(r"^\d+\.")
_NUMBERED = re.compile(r"^(.*?[A-Za-z_]\w*)\.(\d+)\.")


def names_across_split(stored: dict[str, tuple], wanted: dict[str, tuple]) -> dict[str, str] | None:
    """When one of ``stored`` (a checkpoint's model parameters, name -> shape) and ``wanted`` (a
    model's) is split into pipeline stages (names under a stage prefix, ``0.blocks.1.w``) and the
    other is not, and they are the same parameters with the same shapes once the prefixes are
    dropped: the map from each of ``wanted``'s names to the checkpoint's. None otherwise."""
    split_stored, split_wanted = (
        bool(names) and all(STAGE_PREFIX.match(k) for k in names) for names in (stored, wanted)
    )
    if split_stored == split_wanted:
        return None
    plain_stored = {STAGE_PREFIX.sub("", k) if split_stored else k: k for k in stored}
    plain_wanted = {STAGE_PREFIX.sub("", k) if split_wanted else k: k for k in wanted}
    if len(plain_stored) != len(stored) or len(plain_wanted) != len(wanted):
        return None  # two stages held a parameter of one name: not one model's parameters
    if describe_layout_difference(
        {k: stored[v] for k, v in plain_stored.items()}, {k: wanted[v] for k, v in plain_wanted.items()}
    ):
        return None
    return {name: plain_stored[plain] for plain, name in plain_wanted.items()}


def _renamed_optim_key(key: str, names: dict[str, str]) -> str:
    """A flattened optimizer key (``state.<param>.<stat>``, ``param_groups.<param>.<setting>``)
    under the checkpoint's parameter name."""
    section, _, rest = key.partition(".")
    param, _, leaf = rest.rpartition(".")
    return f"{section}.{names[param]}.{leaf}" if param in names else key


def under_names(state_dict: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state_dict`` ({"model": ..., "optim": ...}) with its parameter names replaced by the
    checkpoint's; the values are the same objects, so tensors load in place."""
    out = {"model": {names[k]: v for k, v in state_dict["model"].items()}}
    if "optim" in state_dict:
        out["optim"] = {_renamed_optim_key(k, names): v for k, v in state_dict["optim"].items()}
    if "handlers" in state_dict:  # handler tensor state named after parameters (an average) follows
        out["handlers"] = {
            key: {names.get(name, name): tensor for name, tensor in tensors.items()}
            for key, tensors in state_dict["handlers"].items()
        }
    return out


def stored_under_these_names(stored: dict[str, Any], names: dict[str, str], prefix: str) -> dict[str, Any]:
    """A checkpoint's index entries with the names under ``prefix`` (``handlers.``) that are the
    checkpoint's parameter names given as this model's (``names``: this model's -> the checkpoint's),
    so handler tensor state named after parameters is found across a pipeline split."""
    mine = {theirs: ours for ours, theirs in names.items()}
    out = {}
    for key, value in stored.items():
        if key.startswith(prefix):
            head, _, name = key.removeprefix(prefix).partition(".")
            key = f"{prefix}{head}.{mine.get(name, name)}"
        out[key] = value
    return out


def back_to_names(loaded: dict[str, Any], state_dict: dict[str, Any], names: dict[str, str]) -> None:
    """Copy what DCP loaded under the checkpoint's names back into ``state_dict``."""
    for k in state_dict["model"]:
        state_dict["model"][k] = loaded["model"][names[k]]
    if "optim" in state_dict:
        for k in state_dict["optim"]:
            state_dict["optim"][k] = loaded["optim"][_renamed_optim_key(k, names)]


def describe_layout_difference(stored: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
    """How a checkpoint's model parameters (name -> shape) differ from a model's, in a few words
    (a pipeline split, layer counts, shapes), or None when they match. Used for the error that
    refuses to load another layout."""
    if stored == wanted:
        return None
    parts: list[str] = []
    split_stored, split_wanted = (
        bool(names) and all(STAGE_PREFIX.match(k) for k in names) for names in (stored, wanted)
    )
    if split_stored != split_wanted:
        parts.append(
            "it was written by a pipeline-parallel run (parameters under stage prefixes) and this model is "
            "not split into stages (distributed.pp_size=1)"
            if split_stored
            else "it was written without pipeline stages and this model is split into stages "
            "(distributed.pp_size > 1)"
        )

    def plain(names: dict[str, tuple]) -> dict[str, tuple]:
        return {STAGE_PREFIX.sub("", k) if split_stored != split_wanted else k: v for k, v in names.items()}

    a, b = plain(stored), plain(wanted)
    for container in sorted({m.group(1) for k in (*a, *b) if (m := _NUMBERED.match(k))}):
        counts = [
            len({m.group(2) for k in names if (m := _NUMBERED.match(k)) and m.group(1) == container})
            for names in (a, b)
        ]
        if counts[0] != counts[1]:
            parts.append(f"{container}: {counts[0]} in the checkpoint, {counts[1]} in this model")
    shapes = [f"{k} {a[k]} vs {b[k]}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    if shapes:
        more = f" (+{len(shapes) - 3} more)" if len(shapes) > 3 else ""
        parts.append(f"shapes (checkpoint vs this model): {', '.join(shapes[:3])}{more}")
    if not parts:
        missing, unexpected = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        for label, keys in (("not in the checkpoint", missing), ("not in this model", unexpected)):
            if keys:
                more = " ..." if len(keys) > 3 else ""
                parts.append(f"{len(keys)} parameters {label} ({', '.join(keys[:3])}{more})")
    return "; ".join(parts) if parts else None
