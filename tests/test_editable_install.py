"""An editable install resolves in a stock editor: go-to-definition on ``hookloop.engine.trainer``
reaches ``engine/trainer.py``.

The repository keeps ``engine/`` and ``handlers/`` at the top and maps them into the package
(setup.cfg, ``package_dir``: ``hookloop.engine`` -> ``engine/``, ``hookloop.handlers`` ->
``handlers/``). setuptools' default editable mode serves such a mapping through an import hook
(a ``.pth`` line that installs a finder), which static resolvers (jedi, pyright/Pylance) never run;
``editable_mode=compat`` puts the repository root on ``sys.path``, where there is no ``hookloop``
at all. ``editable_mode=strict`` builds a tree of links to the sources, laid out as the installed
package, under ``build/__editable__.hookloop-*``, and puts that on ``sys.path``: a plain directory
every resolver reads. README's install command and ``.ci/run`` install so; this test checks the
install of the environment it runs in (and skips, saying why, when that is another mode).
"""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parents[1]
MODE = "--config-settings editable_mode=strict"
INSTALL = re.compile(r"pip install .*-e ")


def test_every_editable_install_command_asks_for_the_strict_mode():
    """README, the docs and .ci/run install alike: a reinstall without the flag (of another extra,
    say) would quietly bring back the import hook."""
    texts = {
        path: path.read_text() for path in [REPO / "README.md", REPO / ".ci" / "run", *REPO.glob("docs/*.md")]
    }
    commands = [
        (path.relative_to(REPO), line.strip())
        for path, text in texts.items()
        for line in text.splitlines()
        if INSTALL.search(line)
    ]
    assert any(path == Path(".ci/run") for path, _ in commands)
    assert sum(path == Path("README.md") for path, _ in commands) >= 2
    assert [(str(path), line) for path, line in commands if MODE not in line] == []


def installed_editable() -> tuple[Path, list[str]]:
    """Where this environment's hookloop was installed from (editable) and the lines of its .pth."""
    # the installed one: the first with pip's record of where it came from (an in-tree
    # hookloop.egg-info, on sys.path when the tests run from the repository root, has none)
    dist = next((d for d in metadata.distributions(name="hookloop") if d.read_text("direct_url.json")), None)
    if dist is None:
        pytest.skip("hookloop is not installed by pip in this environment: nothing for an editor to resolve")
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if not direct_url.get("dir_info", {}).get("editable"):
        pytest.skip(
            "hookloop is installed from a wheel, not editable (as tox installs it): go-to-definition "
            "opens the installed copy, not the repository"
        )
    source = Path(unquote(urlparse(direct_url["url"]).path)).resolve()
    lines = [
        line.strip()
        for file in dist.files or []
        if file.name.endswith(".pth")
        for line in Path(dist.locate_file(file)).read_text().splitlines()
        if line.strip()
    ]
    return source, lines


def test_go_to_definition_reaches_the_repositorys_own_files(tmp_path):
    source, pth = installed_editable()
    if source != REPO:
        pytest.skip(f"hookloop is installed from another checkout ({source}), not from {REPO}")
    if any(line.startswith("import ") for line in pth):
        pytest.skip(
            "hookloop is installed in setuptools' default editable mode, whose import hook static "
            f'resolvers do not run; install as README says: pip install -e ".[dev]" {MODE}'
        )
    jedi = pytest.importorskip("jedi", reason="jedi comes with the dev extra")
    probe = (
        "from hookloop.engine.trainer import Trainer\n"
        "import hookloop.handlers.checkpoint.store\n"
        "import hookloop.models.gpt\n"
        "hookloop.engine.\n"
    )
    environment = jedi.create_environment(sys.executable, safe=False)  # the interpreter an editor is given
    script = jedi.Script(
        probe, path=tmp_path / "probe.py", environment=environment, project=jedi.Project(tmp_path)
    )

    def reached(line: int, column: int) -> list[tuple[Path, int]]:
        names = script.goto(line, column, follow_imports=True)
        return [(Path(name.module_path).resolve(), name.line) for name in names]

    lines = (REPO / "engine" / "trainer.py").read_text().splitlines()
    trainer_class = next(n for n, text in enumerate(lines, 1) if text.startswith("class Trainer"))
    assert reached(1, 36) == [(REPO / "engine" / "trainer.py", trainer_class)]
    assert reached(1, 25) == [(REPO / "engine" / "trainer.py", 1)]
    assert reached(2, 36) == [(REPO / "handlers" / "checkpoint" / "store.py", 1)]
    assert reached(3, 24) == [(REPO / "src" / "hookloop" / "models" / "gpt.py", 1)]
    completions = {c.name for c in script.complete(4, len("hookloop.engine."))}
    assert {"trainer", "events", "checkpoint_format"} <= completions
