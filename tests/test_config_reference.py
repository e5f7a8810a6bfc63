"""docs/configuration.md is generated from the config dataclasses and must match them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

from hookloop.handlers.config_reference import COMMAND, doc_sources, field_docs, render
from hookloop.train import TrainingConfig
from tests.dist_utils import REPO

PAGE = REPO / "docs" / "configuration.md"


def test_committed_page_is_current():
    assert PAGE.read_text() == render(TrainingConfig), (
        f"docs/configuration.md is stale: regenerate it with `{COMMAND}`"
    )


def test_every_field_is_described():
    sources = doc_sources()
    hints = typing.get_type_hints(TrainingConfig)
    missing = []
    for section in dataclasses.fields(TrainingConfig):
        cls = hints[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        docs = field_docs(cls, sources.get(section.name))
        missing += [
            f"{section.name}.{f.name}"
            for f in dataclasses.fields(cls)
            if f.name != "enabled" and not docs.get(f.name)
        ]
    assert not missing, (
        f"fields without a description: {missing}; add a trailing '# ...' comment to the field (or an "
        f"Args: entry in its handler's docstring), then run `{COMMAND}`"
    )


def test_command_prints_the_page(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "hookloop", "config", "--markdown"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out == PAGE.read_text()
    assert "| `step_scheduler.max_steps` | int or null | `null` |" in out
    assert "| `nan.max_consecutive` | int | `5` | bad steps in a row" in out
