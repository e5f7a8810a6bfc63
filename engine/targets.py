"""Targets: the code a config names, ``module:attribute`` or ``path/to/file.py:attribute``, and the
arguments written beside it, checked against the signature before anything is built: the names,
and the types where the signature's annotations say them (``d_model: int`` refuses ``abc``).

Every place a config names code uses these two functions, so one rule holds everywhere::

    model:      {target: hookloop.models.gpt:recipe, n_layers: 4}
    handlers:   [{target: my_hooks.py:GradNorms, every: 10}]
    data:       {target: my_data.py:build, args: {size: 1000}}
    validation: {metrics: {accuracy: ignite.metrics:Accuracy}}

``module:attribute`` imports an installed module; ``path/to/file.py:attribute`` loads a file
(relative to the working directory), once per process whatever the number of targets in it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from hookloop.engine.errors import ConfigError

__all__ = ["TARGET_HINT", "accepted_names", "bind_arguments", "resolve_target"]

TARGET_HINT = "module:attribute (e.g. hookloop.models.gpt:recipe) or path/to/file.py:attribute"


def resolve_target(target: Any, field: str) -> Any:
    """Import what ``target`` (``module:attribute`` or ``file.py:attribute``) names; errors are
    :class:`ConfigError` naming ``field``."""
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ConfigError(field, f"must look like {TARGET_HINT}, got {target!r}")
    where, attr = target.split(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            hint = _did_you_mean(where, [str(p) for p in path.parent.glob("*.py")])
            raise ConfigError(field, f"{where} is not a file{hint} (relative paths start at {Path.cwd()})")
        name = f"hookloop_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception:
                del sys.modules[name]
                raise
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):
                hint = _did_you_mean(e.name, _sibling_modules(e.name), where)
                raise ConfigError(
                    field, f"cannot import {where} ({e}){hint}; install it or give path/to/file.py:{attr}"
                ) from None
            raise
    try:
        return getattr(module, attr)
    except AttributeError:
        hint = _did_you_mean(attr, [n for n in dir(module) if not n.startswith("_")])
        raise ConfigError(field, f"{where} has no attribute {attr!r}{hint}") from None


def _did_you_mean(name: str, candidates: Collection[str], whole: str | None = None) -> str:
    """`` (did you mean 'x'?)`` for the candidate closest to ``name`` (put in place of ``name``
    in ``whole`` when given), as a typo in a config key gets; empty when none is close."""
    close = difflib.get_close_matches(name, candidates, n=1)
    if not close:
        return ""
    return f" (did you mean {(whole.replace(name, close[0], 1) if whole else close[0])!r}?)"


def _sibling_modules(name: str) -> list[str]:
    """The importable modules beside dotted ``name``: its package's, or the top-level ones."""
    package, _, _ = name.rpartition(".")
    try:
        path = importlib.import_module(package).__path__ if package else None
    except (ImportError, AttributeError):
        return []
    prefix = f"{package}." if package else ""
    return [prefix + m.name for m in pkgutil.iter_modules(path)]


def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def _keyword_names(params: Mapping[str, inspect.Parameter]) -> list[str]:
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in params.items() if p.kind in keyword]


def bind_arguments(
    fn: Callable,
    args: Mapping[str, Any],
    *,
    prefix: str,
    target: str,
    provided: Collection[str] = (),
) -> dict[str, Any]:
    """``args`` checked against ``fn``'s signature: every key must be one of its keyword arguments
    (unless it takes ``**kwargs``) and every required argument must be in ``args`` or in
    ``provided`` (the names the caller fills in at build time). Errors name ``<prefix>.<argument>``.
    Returns ``args`` as a dict; nothing is called."""
    params = _parameters(fn)
    if params is None:
        return dict(args)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = _keyword_names(params)
    for key in args:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{prefix}.{key}", f"is not an argument name (of {target})")
        if key not in named and not takes_any:
            raise ConfigError(
                f"{prefix}.{key}", f"is not an argument of {target} (it takes: {', '.join(named) or 'none'})"
            )
    missing = [
        n
        for n in named
        if params[n].default is inspect.Parameter.empty and n not in args and n not in provided
    ]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}", f"is required by {target} and not set")
    hints = _annotations(fn)
    for key, value in args.items():
        hint = hints.get(key, inspect.Parameter.empty)
        if _fits(value, hint) is not False:
            continue
        shown = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
        why = ""
        if isinstance(value, str) and _fits(_number(value), hint):
            why = f"; YAML reads {value} as text: write it with a decimal point (e.g. 1.0e-3)"
        raise ConfigError(
            f"{prefix}.{key}",
            f"got {value!r} ({type(value).__name__}), but {target} takes {key}: {shown}{why}",
        )
    return dict(args)


def _annotations(fn: Callable) -> dict[str, Any]:
    """Parameter name -> its annotation, resolved; empty when the annotations cannot be evaluated
    (a name only a type checker sees): types are then not checked."""
    try:
        params = inspect.signature(fn, eval_str=True).parameters
    except Exception:  # noqa: BLE001 - unresolvable annotations: check names only
        return {}
    return {n: p.annotation for n, p in params.items()}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _fits(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (as a config gives it) fits annotation ``hint``: True, False, or None when
    the annotation says something this check does not read (a class of the user's, a callable, ...),
    which is never refused."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        answers = [_fits(value, h) for h in typing.get_args(hint)]
        if any(a is True for a in answers):
            return True
        return None if any(a is None for a in answers) else False
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or origin is dict:
        return isinstance(value, Mapping)
    if hint in (list, tuple) or origin in (list, tuple):  # YAML has lists only: either is fine
        if not isinstance(value, (list, tuple)):
            return False
        inner = [h for h in typing.get_args(hint) if h is not Ellipsis]
        if len(inner) == 1 or (origin is tuple and inner and len(set(inner)) == 1):
            return False if any(_fits(v, inner[0]) is False for v in value) else True
        return True
    return None


def accepted_names(fn: Callable) -> set[str] | None:
    """The keyword arguments ``fn`` names in its signature (``**kwargs`` aside); None when it has no
    signature."""
    params = _parameters(fn)
    return None if params is None else set(_keyword_names(params))
