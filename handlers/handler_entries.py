"""A run config's own handlers: the ``handlers:`` list, each entry a target and its arguments.

::

    handlers:
      - target: my_hooks.py:GradNorms        # a class or factory, as model.target names one
        every: 10                            # its arguments
      - target: my_package.hooks:early_stop
        patience: 3

Each entry's ``target`` is ``module:attribute`` or ``path/to/file.py:attribute`` (the rules of
``model.target``, :mod:`engine.targets`); the result of calling it with the entry's other keys is
attached to the run after the shipped handlers: a hookloop :class:`~engine.Handler`, or any object
with ``attach(trainer)`` (ignite's convention). An entry takes no priority: where it runs on each
event follows the places it attaches with (each inside a phase of :class:`hookloop.Priority`), as
for the shipped handlers; ties run in attach order, shipped handlers first, then the entries in
list order. A ``Handler``'s ``on_<event>`` methods attach themselves (:class:`engine.Handler`).

* A class with a ``Config`` dataclass (a hookloop ``Handler`` with a section of its own): the
  entry's keys are that dataclass's fields, typed and validated with its ``validate`` as a shipped
  section is (errors read ``handlers[<i>].<field>``); it is built with ``from_config``.
* Any other class or factory: the keys are its keyword arguments, checked against its signature.

Arguments the entry leaves out may be filled from the run: ``trainer``, ``run_dir``, ``config``
(the resolved config as a dict), ``dp_size``, ``local_batch_size``, ``log_interval``, ``sampler``,
``dataloader``, ``flops_per_token``: a factory that names one receives it.

:func:`check_handler_entries` resolves and checks every entry without building anything
(``hookloop check``); :func:`build_handler_entries` builds them.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from hookloop.engine.errors import ConfigError
from hookloop.engine.handler import section_settings
from hookloop.engine.targets import accepted_names, bind_arguments, resolve_target

__all__ = [
    "RUNTIME_NAMES",
    "HandlerEntry",
    "build_handler_entries",
    "check_handler_entries",
    "runtime_arguments",
]

#: What a run fills in for an entry's arguments it leaves out, when the target names them.
RUNTIME_NAMES = frozenset(
    {
        "trainer",
        "run_dir",
        "config",
        "dp_size",
        "local_batch_size",
        "log_interval",
        "sampler",
        "dataloader",
        "flops_per_token",
    }
)


@dataclasses.dataclass(frozen=True)
class HandlerEntry:
    """One ``handlers:`` entry resolved: where it is (``handlers[<i>]``), its target and its
    arguments (the ``Config`` section built and validated, for a class that has one)."""

    field: str
    target: str
    factory: Any
    args: dict[str, Any]
    section: Any = None

    def build(self, runtime: Mapping[str, Any]) -> Any:
        """Call the factory (``from_config`` for a class with a section) with the entry's
        arguments and the runtime values it names; None when its section says ``enabled: false``."""
        if self.section is None:
            return self.factory(**self.args, **_named(self.factory, runtime, exclude=self.args))
        if callable(getattr(self.factory, "from_config", None)):
            return self.factory.from_config(
                self.section, **runtime_arguments(self.factory, self.section, runtime)
            )
        if getattr(self.section, "enabled", True) is False:
            return None
        settings = section_settings(self.section)
        return self.factory(**settings, **_named(self.factory, runtime, exclude=settings))


def _named(fn: Any, runtime: Mapping[str, Any], exclude: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime values ``fn`` names in its signature, minus ``exclude``."""
    names = accepted_names(fn) or set()
    return {n: runtime[n] for n in names if n in runtime and n not in exclude}


def runtime_arguments(cls: type, section_cfg: Any, runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime values ``cls.from_config`` asks for by name; a missing required one is an error.
    The default ``from_config`` (taking ``**runtime``) passes the section's fields to the
    constructor, so the constructor's other arguments are offered too, as optional ones."""
    params = list(inspect.signature(cls.from_config).parameters.values())[1:]  # after cfg
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        fields = (
            {f.name for f in dataclasses.fields(section_cfg)}
            if dataclasses.is_dataclass(section_cfg)
            else set()
        )
        for p in inspect.signature(cls).parameters.values():
            if (
                p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.name not in named
                and p.name not in fields
            ):
                named[p.name] = p.replace(default=None)
    missing = [n for n, p in named.items() if p.default is p.empty and n not in runtime]
    if missing:
        raise TypeError(
            f"{cls.__name__}.from_config needs {', '.join(f'{n}=...' for n in missing)}: "
            "pass it to attach_handlers"
        )
    return {n: runtime[n] for n in named if n in runtime}


def _section_of(factory: Any) -> type | None:
    config = getattr(factory, "Config", None) if isinstance(factory, type) else None
    if isinstance(config, type) and dataclasses.is_dataclass(config):
        return config
    return None


def _build_section(config: type, args: Mapping[str, Any], where: str, target: str) -> Any:
    """``config`` from ``args`` with OmegaConf's typing (as a shipped section is loaded), then
    its ``validate``; errors name ``<where>.<field>``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    fields = [f.name for f in dataclasses.fields(config)]
    for key in args:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{where}.{key}",
                f"is not a setting of {target} ({hint}its {config.__name__} has: {', '.join(fields)})",
            )
    try:
        section = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config), dict(args)))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        raise ConfigError(f"{where}.{key}" if key else where, str(e).splitlines()[0]) from None
    validate = getattr(section, "validate", None)
    if callable(validate):
        try:
            validate(where)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(where, str(e)) from None
    return section


def check_handler_entries(entries: Sequence[Any]) -> list[HandlerEntry]:
    """Resolve every ``handlers:`` entry and check its arguments; nothing is built. Raises
    :class:`ConfigError` naming ``handlers[<i>]`` or ``handlers[<i>].<argument>``."""
    if isinstance(entries, str | bytes | Mapping) or not isinstance(entries, Sequence):
        raise ConfigError(
            "handlers", f"must be a list of {{target: ..., <arguments>}} entries, got {entries!r}"
        )
    out = []
    for i, entry in enumerate(entries):
        where = f"handlers[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(
                where,
                f"must be a mapping {{target: module:attribute, <its arguments>}}, got {entry!r}",
            )
        args = dict(entry)
        target = args.pop("target", None)
        if target is None:
            raise ConfigError(f"{where}.target", "is not set: name the handler's class or factory")
        factory = resolve_target(target, f"{where}.target")
        if not callable(factory):
            raise ConfigError(
                f"{where}.target",
                f"{target} is a {type(factory).__name__}: name a handler class or a factory returning one",
            )
        if isinstance(factory, type) and not callable(getattr(factory, "attach", None)):
            raise ConfigError(
                f"{where}.target",
                f"{target} has no attach(trainer): name a hookloop Handler, an object with "
                "attach(trainer), or a factory returning one",
            )
        config = _section_of(factory)
        if config is not None:
            section = _build_section(config, args, where, target)
            out.append(HandlerEntry(where, target, factory, args, section))
            continue
        names = accepted_names(factory) or set()
        bind_arguments(factory, args, prefix=where, target=target, provided=RUNTIME_NAMES & names)
        out.append(HandlerEntry(where, target, factory, args))
    return out


def build_handler_entries(
    entries: Sequence[HandlerEntry], runtime: Mapping[str, Any]
) -> list[tuple[str, Any]]:
    """Build every checked entry (``(field, handler)`` pairs, the disabled ones left out); a result
    without ``attach(trainer)`` is a :class:`ConfigError` naming the entry."""
    built = []
    for entry in entries:
        try:
            handler = entry.build(runtime)
        except ConfigError:
            raise
        except Exception as e:  # the handler's own refusal of its arguments, as one line
            raise ConfigError.caused_by(entry.field, f"{entry.target}(...) fails", e) from e
        if handler is None:
            continue
        if not callable(getattr(handler, "attach", None)):
            raise ConfigError(
                f"{entry.field}.target",
                f"{entry.target} returned a {type(handler).__name__}, which has no attach(trainer): "
                "return a hookloop Handler or an object with attach(trainer)",
            )
        built.append((entry.field, handler))
    return built
