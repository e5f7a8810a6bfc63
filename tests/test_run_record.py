"""The run directory is the user's record: a refused or failed start changes nothing in it, one run
holds it at a time (a lock a dead run never keeps), and under torchrun a config error is said once.

Every test runs real ``hookloop train`` processes on a tiny model of the user's own; a run that must
stay alive while another start is tried waits in a hook of its own for a file the test writes, so
what the test sees never depends on timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.launch import free_port
from tests.dist_utils import REPO, kill_tree, rank_exit_codes, run_process, run_torchrun
from tests.forked import ForkedProcess, start_forked
from tests.user_models import tiny_lm_source

MODEL = tiny_lm_source(seq_len=16)

HOOKS = """
import os
import time
from pathlib import Path

from hookloop import Events
from hookloop.engine import ConfigError


class Refuse:
    '''Refuses the start at TRAIN_START (after the resume), on one rank or on all.'''

    def __init__(self, rank: int = -1):
        self.rank = rank

    def attach(self, trainer):
        trainer.add_event_handler(Events.TRAIN_START, self.refuse)

    def refuse(self):
        if self.rank < 0 or int(os.environ.get("RANK", "0")) == self.rank:
            raise ConfigError("handlers[0].rank", "refused by the test's hook")


class Hold:
    '''At step ``step``, says so in ``here`` (rank 0) and waits until ``go`` exists (at most 120 s).'''

    def __init__(self, here: str, go: str, step: int = 3):
        self.here, self.go, self.step = Path(here), Path(go), step

    def attach(self, trainer):
        trainer.add_event_handler(Events.STEP_END(once=self.step), self.hold)

    def hold(self):
        if int(os.environ.get("RANK", "0")) == 0:
            self.here.write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not self.go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class Losses:
    '''A record file of its own, as docs/writing_handlers.md shows: one line per step, each step once.'''

    def __init__(self, path: str):
        self.path = path

    def attach(self, trainer):
        from hookloop.engine import RecordFile

        def open_records():
            self.records = RecordFile(self.path)
            self.records.cut(trainer.state.step)

        trainer.add_event_handler(Events.RUN_STARTED, open_records)
        trainer.add_event_handler(Events.STEP_END, lambda: self.records.write({"step": trainer.state.step}))
        trainer.add_event_handler(Events.TRAIN_END, lambda: self.records.close())
"""

CONFIG = """
model:
  target: my_models.py:build
  dim: 8
train:
  seq_len: 16
  local_batch_size: 2
step_scheduler:
  global_batch_size: 2
  max_steps: 4
  ckpt_every_steps: 2
lr:
  warmup_steps: 0
logging:
  log_interval: 1
  console: false
data:
  cache_dir: data
"""


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "my_models.py").write_text(MODEL)
    (tmp_path / "my_hooks.py").write_text(HOOKS)
    (tmp_path / "my_run.yaml").write_text(CONFIG)
    return tmp_path


def hookloop(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-m", "hookloop", *args], cwd=cwd, timeout=timeout)


def start(*args: str, cwd: Path) -> ForkedProcess:
    """``hookloop train`` in the background (a fork, ``tests/forked.py``), output to files beside
    the project."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "hookloop", "train", *args]
    proc = start_forked(cmd, cwd=cwd, env=env, stdout=cwd / "background.out", stderr=cwd / "background.err")
    return proc


def wait_for(path: Path, proc: Any = None, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the background run ended ({proc.returncode}) before {path.name} appeared")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def settled_snapshot(directory: Path, timeout: float = 60) -> dict[str, bytes]:
    """``snapshot`` of a live run once its background writes have finished (two readings 0.5 s
    apart equal): a held run may still be writing the save of the step before."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            first = snapshot(directory)
            time.sleep(0.5)
            if first == snapshot(directory):
                return first
        except FileNotFoundError:  # a file renamed or removed between listing and reading
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{directory} kept changing for {timeout}s")


def hold_entry(project: Path, step: int = 3) -> str:
    here, go = project / "held", project / "go"
    return f"handlers=[{{target: 'my_hooks.py:Hold', here: '{here}', go: '{go}', step: {step}}}]"


def metric_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def test_a_refused_resume_changes_nothing_and_the_saved_config_continues(project):
    first = hookloop("train", "my_run.yaml", cwd=project)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = project / "runs" / "my_run"
    before = snapshot(run_dir)
    assert "config.yaml" in before and "exit_status.json" in before and "progress.jsonl" in before
    for refused, field in (
        (["model.dim=12"], "model.dim"),  # another model width: refused at the resume, by name
        (  # another global batch: refused by a handler at TRAIN_START, after the resume loaded
            ["train.local_batch_size=4", "step_scheduler.global_batch_size=4"],
            "step_scheduler.global_batch_size",
        ),
        (["handlers=[{target: 'my_hooks.py:Refuse'}]"], "handlers[0].rank"),  # a user's hook
    ):
        proc = hookloop("train", "my_run.yaml", *refused, "step_scheduler.max_steps=6", cwd=project)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"config error: {field}: "), proc.stderr
        assert snapshot(run_dir) == before, f"{refused} changed the run directory"
    # The documented way on still continues the run, from the saved config.
    more = hookloop("train", str(run_dir / "config.yaml"), "step_scheduler.max_steps=6", cwd=project)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stderr and "(step 4)" in more.stderr
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_refused_start_leaves_no_new_run_directory(project):
    proc = hookloop(
        "train", "my_run.yaml", "train.run_dir=runs/new/deeper", "handlers=[{target: 'my_hooks.py:Refuse'}]",
        cwd=project,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "config error: handlers[0].rank: refused by the test's hook"
    ], proc.stderr
    assert not (project / "runs").exists()


def test_a_second_start_on_a_live_run_is_refused_and_the_first_finishes(project):
    run_dir = project / "runs" / "my_run"
    first = start("my_run.yaml", "step_scheduler.max_steps=6", "step_scheduler.ckpt_every_steps=1",
                  hold_entry(project), cwd=project)  # fmt: skip
    try:
        wait_for(project / "held", first)  # the first run is at step 3, a save of it in flight
        lock = json.loads((run_dir / ".hookloop.lock").read_text())
        assert lock["pid"] == first.pid
        second = hookloop("train", "my_run.yaml", "step_scheduler.max_steps=6", cwd=project, timeout=120)
        assert first.poll() is None  # refused while the first one holds the directory
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith("config error: train.run_dir: ") and "runs/my_run" in lines[0]
        assert f"pid {first.pid}" in lines[0] and lock["host"] in lines[0] and lock["started"] in lines[0]
        (project / "go").write_text("")
        assert first.wait(timeout=150) == 0, (project / "background.err").read_text()[-3000:]
    finally:
        kill_tree(first.pid)
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["code"] == 0 and status["step"] == 6
    assert not (run_dir / ".hookloop.lock").exists()  # released at the end
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if "step_" in p.name)
    assert saved[-1] == "step_00000006"


def test_a_sigkilled_runs_lock_does_not_block_the_next_start(project):
    run_dir = project / "runs" / "my_run"
    first = start("my_run.yaml", "checkpoint.mode=sync", hold_entry(project), cwd=project)
    try:
        wait_for(project / "held", first)  # at step 3: the checkpoint of step 2 is complete
        assert json.loads((run_dir / ".hookloop.lock").read_text())["pid"] == first.pid
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        kill_tree(first.pid)
    assert (run_dir / ".hookloop.lock").exists()  # left behind by the killed run
    again = hookloop("train", "my_run.yaml", cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "(step 2)" in again.stderr
    assert not (run_dir / ".hookloop.lock").exists()


def record_steps(path: Path, event: str | None = None) -> list[int]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["step"] for r in rows if event is None or r.get("event") == event]


def test_after_a_sigkill_and_a_resume_every_record_holds_each_step_once(project):
    run_dir, own = project / "runs" / "my_run", project / "losses.jsonl"
    losses = f"{{target: 'my_hooks.py:Losses', path: '{own}'}}"
    hold = f"{{target: 'my_hooks.py:Hold', here: '{project / 'held'}', go: '{project / 'go'}', step: 7}}"
    args = ["my_run.yaml", "checkpoint.mode=sync", "step_scheduler.max_steps=8"]
    args.append("step_scheduler.ckpt_every_steps=4")
    records = {
        "metrics": lambda: metric_steps(run_dir),
        "progress": lambda: record_steps(run_dir / "progress.jsonl", "progress"),
        "own": lambda: record_steps(own),
    }
    first = start(*args, f"handlers=[{hold}, {losses}]", cwd=project)
    try:
        wait_for(project / "held", first)  # at step 7: the checkpoint of step 4 is complete
        deadline = time.monotonic() + 30  # steps 5 and 6 reach every file within a second
        while any(6 not in read() for read in records.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        kill_tree(first.pid)
    for name, read in records.items():  # the killed run's steps after its checkpoint are there
        assert read()[:6] == [1, 2, 3, 4, 5, 6], name
    again = hookloop("train", *args, f"handlers=[{losses}]", cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 4)" in again.stderr
    assert {name: read() for name, read in records.items()} == {name: list(range(1, 9)) for name in records}
    assert record_steps(run_dir / "metrics.jsonl") == list(range(1, 9))  # every line: each step once


@pytest.mark.distributed
def test_under_torchrun_a_config_error_at_train_start_on_one_rank_is_said_once(project):
    refuse_on_rank_1 = "handlers=[{target: 'my_hooks.py:Refuse', rank: 1}]"
    args = ["train", "my_run.yaml", "train.local_batch_size=1", refuse_on_rank_1]
    proc = run_torchrun("hookloop", 2, args, module=True, cwd=project)
    assert proc.returncode != 0
    said = "config error: handlers[0].rank: refused by the test's hook"
    assert proc.stderr.count(said) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # the forked launcher adds none of its own
    assert rank_exit_codes(proc.stderr) == [2, 2], proc.stderr  # both workers exit 2
    assert not (project / "runs").exists()


@pytest.mark.distributed
def test_under_torchrun_a_second_start_on_a_live_run_is_refused_by_every_rank(project):
    run_dir = project / "runs" / "my_run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    common = ["-m", "hookloop", "train", "my_run.yaml", "train.local_batch_size=1"]
    with open(project / "first.err", "w") as err:
        first = subprocess.Popen(
            [*launch, f"--master-port={free_port()}", *common, hold_entry(project)],
            cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(project / "held", first)
        holder = json.loads((run_dir / ".hookloop.lock").read_text())
        before = settled_snapshot(run_dir)
        second = run_torchrun("hookloop", 2, common[2:], module=True, cwd=project)
        assert first.poll() is None
        assert second.returncode != 0
        assert second.stderr.count("config error: train.run_dir: ") == 1, second.stderr
        assert f"pid {holder['pid']}" in second.stderr
        assert rank_exit_codes(second.stderr) == [2, 2], second.stderr
        assert snapshot(run_dir).keys() >= before.keys()
        (project / "go").write_text("")
        assert first.wait(timeout=180) == 0, (project / "first.err").read_text()[-3000:]
    finally:
        kill_tree(first.pid)
    assert metric_steps(run_dir) == [1, 2, 3, 4]


HANG_AT_START = """
import sys
import time

import torch

from hookloop import Events, Trainer

model = torch.nn.Linear(4, 1)
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                  run_dir=sys.argv[1], hang_timeout_s=2)
trainer.add_event_handler(Events.TRAIN_START, lambda: time.sleep(120))  # a resume that never ends
trainer.run([(torch.randn(2, 4), torch.randn(2, 1))] * 2, max_steps=2)
"""


def test_a_hang_before_the_run_started_leaves_the_run_directory_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "exit_status.json").write_text('{"code": 75}\n')  # the last job's record
    before = snapshot(run_dir)
    (tmp_path / "hang.py").write_text(HANG_AT_START)
    proc = run_process([sys.executable, str(tmp_path / "hang.py"), str(run_dir)], cwd=tmp_path, timeout=90)
    assert proc.returncode == 77, proc.stderr[-3000:]
    assert "Thread" in proc.stderr and "hang.py" in proc.stderr, proc.stderr[-3000:]  # the stacks, on stderr
    assert snapshot(run_dir) == before


def test_nothing_is_written_through_a_symbolic_link_in_the_run_directory(project):
    """A link in the run directory (to a user's file, to a directory, to nowhere) is never written
    through: the lock or an appended file at a link refuses the run in one line naming it; a file
    the run replaces whole (config.yaml) replaces the link, not its target."""
    run_dir, outside = project / "runs" / "my_run", project / "outside"
    outside.mkdir()
    notes, directory, nowhere = outside / "notes.txt", outside / "a_directory", outside / "nowhere"
    notes.write_text("a user's notes")
    directory.mkdir()
    (directory / "kept.txt").write_text("kept")
    before = snapshot(outside)

    def refused(name: str, target: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / name).symlink_to(target)
        proc = hookloop("train", "my_run.yaml", cwd=project)
        assert proc.returncode == 2, proc.stderr[-3000:]
        said = [line for line in proc.stderr.splitlines() if not line.startswith("[hookloop]")]
        assert said == [
            f"config error: train.run_dir: runs/my_run/{name} is a symbolic link (to {target}); a run writes "
            "no file through a link: remove the link"
        ], proc.stderr
        assert (run_dir / name).is_symlink() and os.readlink(run_dir / name) == str(target)
        assert snapshot(outside) == before and not nowhere.exists()
        (run_dir / name).unlink()

    for target in (notes, nowhere, directory):
        refused(".hookloop.lock", target)
        assert [p.name for p in run_dir.iterdir()] == []  # refused before anything was written
    refused("metrics.jsonl", notes)
    config = run_dir / "config.yaml"
    config.unlink()  # the refused run's, now a link
    config.symlink_to(notes)
    proc = hookloop("train", "my_run.yaml", cwd=project)  # resumes from the refused run's first save
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not config.is_symlink() and "max_steps: 4" in config.read_text()
    assert snapshot(outside) == before and not nowhere.exists()
    assert metric_steps(run_dir)[-1] == 4


def test_after_a_rollback_a_sigkill_and_a_resume_progress_holds_no_line_of_the_killed_run(project):
    run_dir = project / "runs" / "my_run"
    hold = f"{{target: 'my_hooks.py:Hold', here: '{project / 'held'}', go: '{project / 'go'}', step: 7}}"
    fault = ["fault_injection.enabled=true", "fault_injection.kind=transient", "fault_injection.step=6"]
    args = ["my_run.yaml", "checkpoint.mode=sync", "step_scheduler.max_steps=8", *fault]
    args += ["step_scheduler.ckpt_every_steps=4", "nan.max_consecutive=1"]
    first = start(*args, f"handlers=[{hold}]", cwd=project)
    try:
        wait_for(project / "held", first)  # step 6 was NaN: rolled back to step 4, now at step 7
        deadline = time.monotonic() + 30
        while "rollback" not in record_events(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        kill_tree(first.pid)
    assert ("rollback", 4) in record_events(run_dir)  # the killed run's lines: 5, rollback to 4, 5, ...
    again = hookloop("train", *args, cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 4)" in again.stderr  # resumed from the checkpoint of step 4, the rollback's too
    events = record_events(run_dir)
    resumed = events.index(("resume", 4))
    assert all(step <= 4 for _, step in events[:resumed]), events  # nothing the killed run wrote after it


def record_events(run_dir: Path) -> list[tuple[str, int]]:
    lines = (run_dir / "progress.jsonl").read_text().splitlines()
    return [(r["event"], r["step"]) for r in map(json.loads, lines)]
