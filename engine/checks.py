"""Validation helpers for config sections and constructor arguments.

Every config section's ``validate(prefix)`` and every handler constructor is written with these, so
a rule reads the same everywhere and every error is a :class:`~engine.errors.ConfigError` whose
``field`` is the dotted name at fault (``nan.spike_factor``) and whose message says what a valid
value looks like. Wrong types never escape as ``TypeError``: ``"10"`` where a number belongs is a
``ConfigError`` naming the field. Number checks reject NaN and +/-inf and booleans.

    check_int("train.seq_len", cfg.seq_len)                       # an integer >= 1
    check_int("lr.warmup_steps", cfg.warmup_steps, low=0)         # an integer >= 0
    check_number("optimizer.weight_decay", wd, low=0)             # a finite number >= 0
    check_number("nan.spike_factor", f, above=1, allow_none=True) # a finite number > 1, or null
    check_choice("checkpoint.mode", mode, ("sync", "async"))
"""

from __future__ import annotations

import math
import numbers
import signal
from collections.abc import Collection, Sequence
from typing import Any

from hookloop.engine.errors import ConfigError

__all__ = [
    "SignalLike",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_str",
    "dotted",
    "grad_acc_steps_for",
    "resolve_signals",
]

SignalLike = str | int | signal.Signals


def dotted(prefix: str, name: str) -> str:
    """``prefix.name``, or just ``name`` when ``prefix`` is empty (a constructor argument)."""
    return f"{prefix}.{name}" if prefix else name


def _got(value: Any) -> str:
    if isinstance(value, str):
        return f"got the string {value!r}: write it as a number, without quotes"
    if isinstance(value, bool):
        return f"got {value!r} (a boolean)"
    if isinstance(value, (int, float)) or value is None:
        return f"got {value!r}"
    return f"got {value!r} (a {type(value).__name__})"


def _tail(hint: str, allow_none: bool) -> str:
    return (" or null" if allow_none else "") + (f" ({hint})" if hint else "")


def check_int(
    field: str,
    value: Any,
    *,
    low: int | None = 1,
    high: int | None = None,
    allow_none: bool = False,
    hint: str = "",
) -> None:
    """An integer with ``low <= value`` (and ``value <= high``); booleans and floats are rejected."""
    if value is None and allow_none:
        return
    bounds = " and ".join(
        b for b in (f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "") if b
    )
    what = f"an integer{' ' + bounds if bounds else ''}{_tail(hint, allow_none)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(field, f"must be {what}, {_got(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(field, f"must be {what}, got {value!r}")


def check_number(
    field: str,
    value: Any,
    *,
    low: float | None = None,
    above: float | None = None,
    below: float | None = None,
    positive: bool = False,
    allow_none: bool = False,
    hint: str = "",
) -> None:
    """A finite real number (never NaN or +/-inf, never a boolean or string) within the bounds:
    ``low <= value`` (inclusive), ``value > above`` (``positive`` means ``above=0``), and
    ``value < below``."""
    if value is None and allow_none:
        return
    if positive:
        above = 0 if above is None else max(above, 0)
    bounds = " and ".join(
        b
        for b in (
            f">= {low:g}" if low is not None else "",
            f"> {above:g}" if above is not None else "",
            f"< {below:g}" if below is not None else "",
        )
        if b
    )
    what = f"a finite number{' ' + bounds if bounds else ''}{_tail(hint, allow_none)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(field, f"must be {what}, {_got(value)}")
    if not math.isfinite(value):
        raise ConfigError(field, f"must be {what}, got {value!r}: NaN and infinity are not allowed")
    if (
        (low is not None and value < low)
        or (above is not None and not value > above)
        or (below is not None and not value < below)
    ):
        raise ConfigError(field, f"must be {what}, got {value!r}")


def check_choice(field: str, value: Any, choices: Collection[Any], *, allow_none: bool = False) -> None:
    """One of ``choices`` (compared with ``==``; unhashable values are simply not a choice)."""
    if value is None and allow_none:
        return
    try:
        ok = value in choices
    except TypeError:
        ok = False
    if not ok:
        options = ", ".join(map(repr, choices)) + (" or null" if allow_none else "")
        raise ConfigError(field, f"must be one of {options}, got {value!r}")


def check_bool(field: str, value: Any, *, allow_none: bool = False) -> None:
    """``True`` or ``False`` (not 0/1, not the string ``"yes"``)."""
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false{' or null' if allow_none else ''}, got {value!r}")


def check_str(field: str, value: Any, *, allow_none: bool = False, what: str = "a non-empty string") -> None:
    """A non-empty string (``what`` describes it in the message, e.g. ``"a directory path"``)."""
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(field, f"must be {what}{' or null' if allow_none else ''}, got {value!r}")


def grad_acc_steps_for(
    global_batch_size: int,
    local_batch_size: int,
    dp_size: int,
    *,
    field: str = "global_batch_size",
    local_field: str = "local_batch_size",
) -> int:
    """Microbatches per optimizer step, ``global_batch_size // (local_batch_size * dp_size)``; the
    one rule that it must divide exactly (the run config checks it with the world size too)."""
    per_microbatch = local_batch_size * dp_size
    if global_batch_size % per_microbatch:
        lower = max(per_microbatch, global_batch_size // per_microbatch * per_microbatch)
        raise ConfigError(
            field,
            f"({global_batch_size}) must be a multiple of {local_field} x data-parallel size "
            f"({local_batch_size} x {dp_size} = {per_microbatch}); use a multiple such as {lower} or "
            f"change {local_field}",
        )
    return global_batch_size // per_microbatch


def resolve_signals(
    value: SignalLike | Sequence[SignalLike] | None, field: str = "stop_signals"
) -> tuple[signal.Signals, ...]:
    """Signal names ("SIGTERM"), numbers or members -> members; None or empty -> none. The one
    rule for ``stop_signals``: catchable signals only; errors name ``field``."""
    if value is None:
        return ()
    items = [value] if isinstance(value, (str, int, signal.Signals)) else list(value)
    out: list[signal.Signals] = []
    for item in items:
        try:
            if isinstance(item, str):
                sig = signal.Signals[item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()]
            elif isinstance(item, int) and not isinstance(item, bool):
                sig = signal.Signals(item)
            else:
                raise TypeError
        except (KeyError, ValueError, TypeError):
            raise ConfigError(
                field, f"{item!r} is not a signal; use names such as 'SIGTERM' or 'SIGUSR1'"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(field, f"{sig.name} cannot be caught; use SIGTERM, SIGUSR1 or SIGUSR2")
        if sig not in out:
            out.append(sig)
    return tuple(out)
