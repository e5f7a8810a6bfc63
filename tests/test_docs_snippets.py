"""Every ```python block of README.md and of every docs/*.md page runs as written.

Pages are discovered, not listed. Each block runs as ``python -c BLOCK`` would, from its own
temporary directory outside the repository (so a snippet that only works from the repository root
fails here), with the repository importable the way an installed checkout is, one OpenMP thread and
a hard timeout; ``TMPDIR`` points into that directory, so ``tempfile`` output lands there too (the
process is forked from an interpreter that imported torch once: ``tests/forked.py``).

First-line markers:

- ``# torchrun --nproc-per-node N``: the block is a script for several processes; it runs under
  torchrun with N gloo ranks (the whole process group is killed on a timeout).
- ``# after the commands above``: the block reads what the ```bash block before it made (a run
  directory); the bash block runs first, from a directory laid out like the repository root, then
  the python block in the same directory.
- ``# not run``: a true fragment (it needs names from the text around it). Allowed only as a small
  minority: every page needs a runnable block, and fragments are capped over all pages.
- ``# file: NAME`` (a ```python or ```yaml block): a file the page's commands use; it is written as
  ``NAME`` into the directory a walkthrough's bash block runs in (a python one also runs as a block).

The ```bash blocks are checked too: the scripts, modules and config files they name exist, every
``section.field=value`` override names a real run-config field, and every command that starts a
run gets a run directory of its own. A training command is ``examples/train_*.py``, ``hookloop
train CONFIG`` or ``-m hookloop train CONFIG``; its run directory is its last ``train.run_dir=``
override, else the config's ``train.run_dir`` (``runs/<config file stem>`` when null; a config
the page does not hold is taken as null, and ``<run dir>/config.yaml``, the config a run saved, as
that run's). A later training command on the same page that trains in a run directory an earlier
one trained in must say that it resumes: ``# resumes`` in the comment on its own line, e.g.
``hookloop train my_run.yaml   # resumes: nothing left to train``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
import tempfile
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
_BLOCK = re.compile(r"^```(python|bash|yaml)\n(.*?)^```", re.S | re.M)
FILE = re.compile(r"^# file: (\S+)\n")
RESUMES = re.compile(r"#.*\bresumes\b")


def blocks_of(text: str, lang: str = "python") -> list[str]:
    return [body for kind, body in _BLOCK.findall(text) if kind == lang]


def blocks(page: Path, lang: str = "python") -> list[str]:
    return blocks_of(page.read_text(), lang)


def page_files(text: str) -> dict[str, str]:
    """The files a page holds: ``# file: NAME`` blocks, by name."""
    return {m.group(1): body for _, body in _BLOCK.findall(text) if (m := FILE.match(body))}


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
            elif kind == "python" and body.startswith(AFTER_BASH):
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
    for name, body in page_files(page.read_text()).items():  # the page's own files (# file: NAME)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
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
    config ``hookloop train`` reads (every shipped section), and the
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


# ------------------------------------------------------------------ one run directory per new run
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_OVERRIDE = re.compile(r"^[a-z_]+\.[\w.]+=")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_TRAIN_SCRIPT = re.compile(r"(^|/)examples/train_\w+\.py$")


def _split_comment(line: str) -> tuple[str, str]:
    """``(code, comment)`` of one shell line: the comment starts at a ``#`` outside quotes that
    begins a word."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def _default_config(script: str) -> str:
    """The config an example training script reads without ``--config`` (its ``DEFAULT_CONFIG``)."""
    spec = importlib.util.spec_from_file_location("_docs_example", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return os.path.relpath(module.DEFAULT_CONFIG, REPO)


def _training_command(words: list[str]) -> tuple[str, list[str]] | None:
    """``(config, overrides)`` when ``words`` start a training run, else None."""
    overrides = [w for w in words if _OVERRIDE.match(w)]
    for i, word in enumerate(words):
        if _TRAIN_SCRIPT.search(word):
            rest = words[i + 1 :]
            for j, arg in enumerate(rest):
                if arg == "--config" and j + 1 < len(rest):
                    return rest[j + 1], overrides
                if arg.startswith("--config="):
                    return arg.split("=", 1)[1], overrides
            return _default_config(word), overrides
        if os.path.basename(word) == "hookloop" and words[i + 1 : i + 2] == ["train"]:
            config = next((w for w in words[i + 2 :] if not w.startswith("-") and "=" not in w), None)
            return (config, overrides) if config else None
    return None


def _run_dir(config: str, overrides: list[str], files: dict[str, str], trained: set[str]) -> str:
    for override in reversed(overrides):
        if override.startswith("train.run_dir="):
            return os.path.normpath(override.split("=", 1)[1])
    parent = os.path.normpath(os.path.dirname(config))
    if os.path.basename(config) == "config.yaml" and parent in trained:
        return parent  # the config a run saved trains that run
    from hookloop.train import load_training_config

    if (REPO / config).is_file():
        return os.path.normpath(load_training_config(REPO / config, world_size=1).train.run_dir)
    if config in files:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / config
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[config])
            return os.path.normpath(load_training_config(path, world_size=1).train.run_dir)
    return os.path.join("runs", Path(config).stem)


def training_runs(text: str) -> list[tuple[str, str, bool]]:
    """``(command, run directory, marked '# resumes')`` for every training command in the ```bash
    blocks of a page's text, in order."""
    files = page_files(text)
    out: list[tuple[str, str, bool]] = []
    for block in blocks_of(text, "bash"):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            code, comment = _split_comment(line)
            resumes = bool(RESUMES.search(comment))
            code = _VARIABLE.sub(
                lambda m, known=variables: known.get(m.group(1) or m.group(2), m.group(0)), code
            )
            for command in re.split(r"&&|\|\||[;|&]", code):
                try:
                    words = shlex.split(command)
                except ValueError:  # a line of a heredoc or a quote split across lines
                    continue
                if words and all(_ASSIGNMENT.match(w) for w in words):
                    variables.update(w.split("=", 1) for w in words)
                    continue
                found = _training_command(words)
                if found is not None:
                    trained = {run_dir for _, run_dir, _ in out}
                    run_dir = _run_dir(*found, files, trained)
                    out.append((command.strip(), run_dir, resumes))
    return out


def run_dir_clashes(text: str) -> list[str]:
    """Training commands of a page that would train in a run directory an earlier command of the
    page trained in, without saying they resume (``# resumes``)."""
    first: dict[str, str] = {}
    problems = []
    for command, run_dir, resumes in training_runs(text):
        if run_dir in first and not resumes:
            problems.append(
                f"{command!r} trains in {run_dir}, where {first[run_dir]!r} trained before: give it "
                f"its own train.run_dir=..., or mark it '# resumes' if resuming is the point"
            )
        first.setdefault(run_dir, command)
    return problems


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "bash")], ids=_name)
def test_each_new_run_has_its_own_run_directory(page):
    problems = run_dir_clashes(page.read_text())
    assert not problems, f"{_name(page)}: {problems}"


def _page(*bash_blocks: str) -> str:
    return "".join(f"Text.\n\n```bash\n{block}```\n\n" for block in bash_blocks)


def test_run_directory_check_finds_a_planted_duplicate():
    # The example script and the command train examples/configs/gpt_tiny.yaml: runs/gpt_tiny.
    planted = _page(
        "python examples/train_gpt.py\n",
        "torchrun --nproc-per-node 2 -m hookloop train examples/configs/gpt_tiny.yaml \\\n"
        "    distributed.dp_mode=fsdp\n",
    )
    runs = training_runs(planted)
    assert [run_dir for _, run_dir, _ in runs] == ["runs/gpt_tiny", "runs/gpt_tiny"]
    problems = run_dir_clashes(planted)
    assert len(problems) == 1 and "runs/gpt_tiny" in problems[0] and "dp_mode=fsdp" in problems[0]
    # Marked as a resume, or given its own directory, it passes.
    assert not run_dir_clashes(planted.replace("dp_mode=fsdp\n", "dp_mode=fsdp  # resumes it under FSDP2\n"))
    assert not run_dir_clashes(planted.replace("dp_mode=fsdp\n", "dp_mode=fsdp train.run_dir=runs/fsdp\n"))
    # A marker in the command's own line only; a comment line of its own marks nothing.
    assert run_dir_clashes(planted.replace("torchrun", "# resumes\ntorchrun"))


def test_run_directory_check_resolves_overrides_variables_and_the_pages_files():
    text = (
        _page(
            'ARGS="train.run_dir=runs/demo step_scheduler.max_steps=60"\n'
            "hookloop train examples/configs/hf_tiny.yaml $ARGS &\n"
            "python examples/train_hf.py $ARGS\n"
            "python examples/train_gpt.py --config examples/configs/gpt_mixture.yaml && "
            "hookloop train my_run.yaml\n"
            "hookloop check my_run.yaml && hookloop config my_run.yaml\n"
            "hookloop train runs/mine/config.yaml step_scheduler.max_steps=300\n"
        )
        + "```yaml\n# file: my_run.yaml\ntrain:\n  run_dir: runs/mine\n"
        + "step_scheduler:\n  max_steps: 10\n```\n"
    )
    runs = training_runs(text)
    assert [run_dir for _, run_dir, _ in runs] == [
        "runs/demo",
        "runs/demo",
        "runs/gpt_mixture",
        "runs/mine",
        "runs/mine",
    ]
    problems = run_dir_clashes(text)
    assert len(problems) == 2 and "runs/demo" in problems[0] and "runs/mine" in problems[1], problems
    # The same commands without a file for my_run.yaml: runs/my_run, a directory of its own.
    assert [d for _, d, _ in training_runs(text.split("```yaml")[0])][3] == "runs/my_run"
