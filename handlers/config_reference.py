"""The configuration reference page, generated from the run config dataclasses.

    hookloop config --markdown > docs/configuration.md

Walks :class:`hookloop.train.TrainingConfig` (``hookloop config``'s schema, :class:`handlers.RunConfig`)
(or any schema made with :func:`handlers.compose_config`) section
by section and writes every field with its YAML type, its default and its description. A field's
description is, first found: its own comment in the section's source (a trailing ``# ...`` or a
``#:`` line above it), then the ``Args:`` entry of the same name in the docstring of the handler
built from the section (or of the section class itself). Documenting a field therefore means
documenting it in the code, once; ``tests/test_config_reference.py`` fails when the committed page
is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

__all__ = ["DocSource", "doc_sources", "field_docs", "render", "type_name"]

COMMAND = "hookloop config --markdown > docs/configuration.md"

# Where a section's field descriptions come from when the field has no comment of its own: the class
# whose docstring has an ``Args:`` list for the same names. Handlers name their section themselves.
_ENGINE_DOC_SOURCES = {"hookloop.engine.pipeline.config:PipelineConfig": "pipeline"}
# Fields every handler section shares, described once here.
_GENERIC = {"enabled": "build and attach this section's handler (false: `from_config` returns None)"}


def type_name(tp: Any) -> str:
    """A field annotation as a YAML reader would say it: ``int or null``, ``list of str``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, typing.List):  # noqa: UP006
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, typing.Dict):  # noqa: UP006
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return f"`{tp.__name__}`"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return _yaml(dataclasses.asdict(value))
    return str(value)


def _md(text: str) -> str:
    """Docstring markup (reST roles, double backquotes) as Markdown."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _comments(cls: type) -> dict[str, str]:
    """Each field's own comment in ``cls``'s source: ``#:`` lines above it, or a trailing ``#``."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    src_lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        i = node.lineno - 2
        while i >= 0 and src_lines[i].strip().startswith("#:"):
            above.insert(0, src_lines[i].strip()[2:].strip())
            i -= 1
        line = src_lines[node.end_lineno - 1]
        trailing = re.search(r"#\s*(?!noqa|type:)(.+)$", line[node.end_col_offset :])
        text = " ".join(above) or (trailing.group(1).strip() if trailing else "")
        if text:
            out[node.target.id] = text
    return out


def _args(doc: str | None) -> dict[str, str]:
    """The ``Args:`` entries of a Google-style docstring; ``a, b: text`` documents both names."""
    if not doc:
        return {}
    doc = inspect.cleandoc(doc)
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    if not match:
        return {}
    out: dict[str, str] = {}
    current: list[str] = []
    for line in match.group(1).splitlines():
        entry = re.match(r"^    ([\w, ]+):\s*(.*)$", line)
        if entry and not line.startswith("     "):
            current = [n.strip() for n in entry.group(1).split(",")]
            for name in current:
                out[name] = entry.group(2).strip()
        elif line.strip() and current:
            for name in current:
                out[name] += " " + line.strip()
        elif not line.strip():
            current = []
    return out


@dataclasses.dataclass(frozen=True)
class DocSource:
    """The class whose docstring documents a section's fields (``Args:``), read from its source
    file without importing it (a handler's module imports torch)."""

    module: str
    name: str
    doc: str | None

    @classmethod
    def find(cls, dotted: str) -> DocSource:
        """``module:Class`` without importing ``module`` (nor its package: only ``hookloop.engine`` or
        ``hookloop.handlers``, which import nothing heavy)."""
        import importlib

        module, _, name = dotted.partition(":")
        parts = module.split(".")
        top = Path(importlib.import_module(".".join(parts[:2])).__file__).parent
        source = top.joinpath(*parts[2:]).with_suffix(".py").read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return cls(module, name, ast.get_docstring(node))
        raise LookupError(f"{dotted}: no class {name} in {module}")


def field_docs(section_cls: type, doc_source: DocSource | None = None) -> dict[str, str]:
    """Field name -> description for one section (see the module docstring for the sources)."""
    docs = {**_args(section_cls.__doc__)}
    if doc_source is not None:
        docs.update(_args(doc_source.doc))
    docs.update(_comments(section_cls))
    return docs


def doc_sources() -> dict[str, DocSource]:
    """Section name -> the handler (or engine class) whose docstring documents its fields: the first
    shipped handler reading the section (:data:`handlers.shipped.HANDLERS`)."""
    from hookloop.handlers.shipped import HANDLERS

    out: dict[str, DocSource] = {}
    for dotted, section in {**HANDLERS, **_ENGINE_DOC_SOURCES}.items():
        if section not in out:
            out[section] = DocSource.find(dotted)
    return out


def _summary(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return ""
    paragraph = doc.split("\n\n")[0]
    return _md(" ".join(line.strip() for line in paragraph.splitlines()))


def _table(cls: type, doc_source: DocSource | None, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls, doc_source)
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    nested: list[type] = []
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, f.type)
        for inner in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(inner) and inner not in nested:
                nested.append(inner)
        text = docs.get(f.name) or _GENERIC.get(f.name, "")
        text = _md(text).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{prefix}.{f.name}` | {type_name(tp)} | {_default(f)} | {text} |")
    out = rows
    for inner in nested:
        out += ["", f"Each item of a list of `{inner.__name__}` (in `{prefix}`):", ""]
        summary = _summary(inner)
        if summary:
            out += [summary, ""]
        out += _table(inner, None, "item")
    return out


#: What the sections that are not dataclasses hold.
_FREE_FORM = {
    "model": (
        "`model.target` names the model factory (`module:attribute` or `path/to/file.py:attribute`,"
        " e.g. `hookloop.models.gpt:recipe`); every other key is an argument of that factory,"
        " checked against its signature (see `hookloop.recipe`)."
    ),
    "handlers": (
        "The run's own handlers, attached after the shipped ones: a list of entries"
        " `{target: module:attribute | path/to/file.py:attribute, <its arguments>}`, each naming a"
        " handler class or a factory returning an object with `attach(trainer)`; the arguments are"
        " checked against its signature, or against its `Config` dataclass (validated like a shipped"
        " section) when the class has one (see `hookloop.handlers.handler_entries`)."
    ),
}


def render(schema: type | None = None) -> str:
    """The whole reference page for ``schema`` (default :class:`handlers.RunConfig`) as Markdown."""
    from hookloop.handlers.run_config import RunConfig

    schema = schema or RunConfig
    sources = doc_sources()
    hints = typing.get_type_hints(schema)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config dataclasses by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every section of the config `hookloop train` reads, every field with its type, default and",
        "meaning (`hookloop config CONFIG` prints a config resolved, with the same notes). A run config",
        "is YAML or TOML (`hookloop.handlers.load_run_config(path, overrides)`); dotted overrides",
        "set one field (`step_scheduler.max_steps=100`); `null` (or `~`, `None`, `none`) sets a field",
        "that may be null. Each section validates itself before anything is built; every error",
        "names the field (`hookloop.ConfigError`). How to add a section of your own:",
        "[writing handlers](writing_handlers.md).",
        "",
        "Sections: " + ", ".join(f"[`{f.name}`](#{f.name})" for f in dataclasses.fields(schema)) + ".",
    ]
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        lines += ["", f"## {f.name}", ""]
        if not dataclasses.is_dataclass(tp):
            lines += [
                f"`{f.name}`: {type_name(tp)}, default {_default(f)}. {_FREE_FORM.get(f.name, '')}".rstrip()
            ]
            continue
        source = sources.get(f.name)
        where = f"`{tp.__module__}.{tp.__name__}`"
        if source is not None and source.module.startswith("hookloop.handlers"):
            where += f", read by `{source.name}`"
        lines += [f"Dataclass {where}.", ""]
        summary = _summary(tp)
        if summary:
            lines += [summary, ""]
        lines += _table(tp, source, f.name)
    return "\n".join(lines) + "\n"


def annotated_yaml(cfg: Any) -> str:
    """``cfg`` (a run config instance) as YAML, every field followed by a comment with its meaning
    and, where the value differs, its default: what ``hookloop config CONFIG`` prints."""
    import yaml

    schema = type(cfg)
    sources = doc_sources()
    out = ["# Resolved config: every field, defaults included (hookloop config --markdown: the reference)."]
    for f in dataclasses.fields(schema):
        value = getattr(cfg, f.name)
        out.append(f"{f.name}:")
        if not dataclasses.is_dataclass(value):
            body = yaml.safe_dump(_plain(value), default_flow_style=False, sort_keys=False).rstrip()
            empty = "  []" if isinstance(value, list) else "  {}"
            out += [f"  {line}" for line in body.splitlines()] if value else [empty]
            continue
        docs = field_docs(type(value), sources.get(f.name))
        for sub in dataclasses.fields(value):
            v = _plain(getattr(value, sub.name))
            text = yaml.safe_dump({sub.name: v}, default_flow_style=True, width=10**6).strip()[1:-1]
            note = _md(docs.get(sub.name) or _GENERIC.get(sub.name, "")).replace("\n", " ")
            default = _default(sub).strip("`")
            if default != _yaml(v):
                note = f"{note} (default {default})" if note else f"default {default}"
            out.append(f"  {text}" + (f"  # {note}" if note else ""))
    return "\n".join(out) + "\n"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value
