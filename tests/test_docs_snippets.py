"""Every ```python block of README.md and of every docs/*.md page runs as written.

Pages are discovered, not listed. Each block runs in a fresh interpreter from its own temporary
directory outside the repository (so a snippet that only works from the repository root fails
here), with the repository importable the way an installed checkout is, one OpenMP thread and a
hard timeout; ``TMPDIR`` points into that directory, so ``tempfile`` output lands there too.

First-line markers:

- ``# torchrun --nproc-per-node N``: the block is a script for several processes; it runs under
  torchrun with N gloo ranks (the whole process group is killed on a timeout).
- ``# after the commands above``: the block reads what the ```bash block before it made (a run
  directory); the bash block runs first, from a directory laid out like the repository root, then
  the python block in the same directory.
- ``# not run``: a true fragment (it needs names from the text around it). Allowed only as a small
  minority: every page needs a runnable block, and fragments are capped over all pages.

The ```bash blocks are checked too: the scripts, modules and config files they name exist, and every
``section.field=value`` override names a real run-config field.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO, free_port, run_process

PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
TIMEOUT_S = 150
NOT_RUN = "# not run"
AFTER_BASH = "# after the commands above"
WALKTHROUGH_TIMEOUT_S = 420
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+)\n")
MAX_FRAGMENT_SHARE = 0.15
GENERATED = {"configuration.md"}  # reference pages written by a script (tests/test_config_reference.py)
_BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)


def blocks(page: Path, lang: str = "python") -> list[str]:
    return [body for kind, body in _BLOCK.findall(page.read_text()) if kind == lang]


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


CASES = [
    pytest.param(page, i, block, id=f"{_name(page)}[{i}]")
    for page in PAGES
    for i, block in enumerate(blocks(page))
    if not block.startswith((NOT_RUN, AFTER_BASH))
]


def _walkthroughs() -> list:
    """(page, bash block, python block) for every python block that follows up a bash block."""
    out = []
    for page in PAGES:
        bash = None
        for kind, body in _BLOCK.findall(page.read_text()):
            if kind == "bash":
                bash = body
            elif body.startswith(AFTER_BASH):
                assert bash is not None, f"{_name(page)}: '{AFTER_BASH}' block with no bash block before it"
                out.append(pytest.param(page, bash, body, id=f"{_name(page)}[{len(out)}]"))
    return out


def test_pages_are_found():
    names = {_name(p) for p in PAGES}
    assert {"README.md", "docs/concepts.md", "docs/writing_handlers.md", "docs/configuration.md"} <= names


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in GENERATED], ids=_name)
def test_every_page_has_a_runnable_block(page):
    found = blocks(page)
    opened = page.read_text().count("```python\n")
    assert opened == len(found), (
        f"{_name(page)}: {opened - len(found)} ```python block(s) not closed on a line of its own"
    )
    assert any(not b.startswith(NOT_RUN) for b in found), f"{_name(page)} has no runnable ```python block"


def test_fragments_are_a_small_minority():
    every = [b for p in PAGES for b in blocks(p)]
    fragments = [b for b in every if b.startswith(NOT_RUN)]
    share = len(fragments) / max(1, len(every))
    assert share <= MAX_FRAGMENT_SHARE, (
        f"{len(fragments)} of {len(every)} python blocks are '{NOT_RUN}' fragments; make them runnable"
    )


@pytest.mark.parametrize(("page", "index", "block"), CASES)
def test_block_runs(page, index, block, tmp_path):
    env = {
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    multi = TORCHRUN.match(block)
    if multi:
        script = tmp_path / "snippet.py"
        script.write_text(block)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={multi.group(1)}",
            f"--master-port={free_port()}",
            str(script),
        ]
    else:
        cmd = [sys.executable, "-c", block]
    where = f"{_name(page)} block {index}"
    try:
        proc = run_process(cmd, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    except TimeoutError as e:
        pytest.fail(f"{where} ran longer than {TIMEOUT_S}s\n{str(e)[-4000:]}")
    assert proc.returncode == 0, (
        f"{where} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(("page", "bash", "block"), _walkthroughs())
def test_walkthrough_runs(page, bash, block, tmp_path):
    for entry in ("examples", "setup.cfg"):  # what the commands read from the repository root
        (tmp_path / entry).symlink_to(REPO / entry)
    env = {"TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    where = f"{_name(page)}: the bash block before '{AFTER_BASH}'"
    try:
        proc = run_process(["bash", "-e", "-c", bash], timeout=WALKTHROUGH_TIMEOUT_S, env=env, cwd=tmp_path)
        assert proc.returncode == 0, f"{where} exited {proc.returncode}\n{proc.stderr[-4000:]}"
        proc = run_process([sys.executable, "-c", block], timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    except TimeoutError as e:
        pytest.fail(f"{where} ran too long\n{str(e)[-4000:]}")
    assert proc.returncode == 0, (
        f"{_name(page)} block after the bash block exited {proc.returncode}\n{proc.stderr[-3000:]}"
    )


def _referenced(command: str) -> list[str]:
    """Problems with one shell command of the README: missing scripts, modules or config files."""
    problems = []
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # a quote split across lines (a heredoc, a multi-line string)
        words = command.split()
    for i, word in enumerate(words):
        if word.endswith((".py", ".yaml", ".toml", ".sh")) and "=" not in word:
            if not (REPO / word).exists():
                problems.append(f"{word} does not exist")
        if word == "-m" and i + 1 < len(words) and words[i + 1] not in ("pytest", "torch.distributed.run"):
            sys.path.insert(0, str(REPO))
            try:
                if importlib.util.find_spec(words[i + 1]) is None:
                    problems.append(f"module {words[i + 1]} does not exist")
            finally:
                sys.path.remove(str(REPO))
    return problems


def _commands(page: Path) -> list[str]:
    """The shell commands of a page's ```bash blocks (comment lines and continuation joined)."""
    out = []
    for block in blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out += re.split(r"&&|;|\|", line)
    return out


def test_readme_commands_name_existing_files():
    commands = _commands(REPO / "README.md")
    assert commands, "README.md has no ```bash block"
    problems = [p for c in commands for p in _referenced(c)]
    assert not problems, problems
    extras = re.findall(r'-e "\.\[(\w+)\]"', (REPO / "README.md").read_text())
    setup = (REPO / "setup.cfg").read_text()
    assert extras and all(re.search(rf"^{e} =", setup, re.M) for e in extras), extras


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "bash")], ids=_name)
def test_commands_use_real_config_fields(page):
    """Every ``section.field=value`` override in a page's commands names a real field of the
    config ``hookloop train`` reads (every shipped section plus ``fault``), and the
    scripts and modules the commands name exist."""
    import dataclasses
    import typing

    from hookloop.train import TrainingConfig

    hints = typing.get_type_hints(TrainingConfig)
    commands = _commands(page)
    problems = [p for c in commands for p in _referenced(c) if "examples/" in c or "engine" in c]
    for key in re.findall(r"(?<![\w/.-])([a-z_]+)\.([a-z_]+)=", " ".join(commands)):
        section, name = key
        cls = hints.get(section)
        if cls is None or not dataclasses.is_dataclass(cls):
            if section != "model":
                problems.append(f"{section}.{name}: no such config section")
        elif name not in {f.name for f in dataclasses.fields(cls)}:
            problems.append(f"{section}.{name}: no such field (see docs/configuration.md)")
    assert not problems, f"{_name(page)}: {problems}"
