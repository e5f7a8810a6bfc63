"""Live recovery across replica groups (``fault_tolerance``, torchft): real ``hookloop train``
processes as replica groups of one process each, a real ``hookloop lighthouse``, real SIGKILLs.

- A group SIGKILLed mid-run: the survivor keeps training without reading a checkpoint (one quorum
  line), the restarted group heals from it live and joins (one line each way), a stop signal on the
  healed group stops both at the same step (75 in both ``exit_status.json``), the final weights and
  optimizer state are identical in both groups' checkpoints, and the sample traces account for every
  sample of the global stream exactly once (committed, uncommitted, or dropped with its group).
- A NaN on one group is skipped on both, a run ends on both at the same step, and its checkpoint
  resumes in a plain run without the section, which never imports torchft.
- A group whose settings differ from the live group it would heal from is refused in one line
  naming the field (exit 2, nothing written); the live group trains on.
- No lighthouse, one that never answers, or one that dies: the group ends with 77 in one line and
  ``exit_status.json``, no traceback.
- Config refusals name the field before anything starts; without the section torchft is never
  imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hookloop.engine.data import prepare_tokens, stdlib_docs_text
from hookloop.engine.errors import ConfigError
from tests.dist_utils import REPO, run_process
from tests.forked import forkable, start_forked
from tests.user_models import tiny_lm_config, tiny_lm_source

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None, reason="needs torchft (the torchft extra)"
    ),
]

# Global batch 8 = local_batch_size 2 x grad_accum 2 x 2 groups of one process.
CONFIG = (
    tiny_lm_config(max_steps=100000)
    + """
logging:
  log_interval: 5
nan:
  action: warn
data:
  datasets: {docs: docs.u8}
  val_samples: 0
  trace_samples: true
fault_tolerance:
  enabled: true
  num_replica_groups: 2
  timeout_s: 10
  quorum_timeout_s: 60
handlers:
  - {target: "hookloop.handlers.ema:WeightEMA", enabled: true, decay: 0.9}
"""
)
PER_GROUP = 4  # samples a group trains on per step
WAIT_S = 120.0  # the longest any wait on a process takes (a loaded machine starts Python slowly)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("live_recovery")
    (root / "my_models.py").write_text(tiny_lm_source(seq_len=8))
    (root / "run.yaml").write_text(CONFIG)
    prepare_tokens([stdlib_docs_text()[:200_000]], root / "docs.u8")
    return root


class Proc:
    """A process in a session of its own, its output in a file; waits on it are bounded."""

    def __init__(self, cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> None:
        self.log = log
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
        if forkable(cmd):  # a fork of the tests' server (tests/forked.py), stderr into the same file
            self.proc = start_forked(cmd, cwd=cwd, env=full_env, stdout=log, stderr=log)
            return
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = WAIT_S, after: int = 0) -> re.Match:
        """The first match of ``pattern`` in the output (from offset ``after``), waiting at most
        ``timeout`` seconds; fails when the process ends without it."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            match = re.compile(pattern, re.M).search(text, after)
            if match:
                return match
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.log.name} exited {self.proc.returncode} before {pattern!r}:\n{text[-3000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"{self.log.name}: no {pattern!r} within {timeout:.0f} s:\n{text[-3000:]}")
            time.sleep(0.1)

    def last_step(self) -> int:
        steps = re.findall(r"^step (\d+)/", self.text(), re.M)
        return int(steps[-1]) if steps else 0

    def wait_step(self, step: int, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.last_step() < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{self.log.name} did not reach step {step}:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def exit_code(self, timeout: float = WAIT_S) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """Every process started in the block, SIGKILLed (with its session) on the way out."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()


@contextlib.contextmanager
def lighthouse_here(min_replicas: int) -> Iterator[str]:
    """A lighthouse in this process (no interpreter to start); its address."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=2000, heartbeat_timeout_ms=500
    )
    try:
        yield "http://127.0.0.1:" + server.address().rstrip("/").rsplit(":", 1)[1]
    finally:
        server.shutdown()


def lighthouse(project: Path, started: list[Proc], min_replicas: int, name: str) -> str:
    """``hookloop lighthouse`` started as a user does; its address."""
    cmd = [sys.executable, "-m", "hookloop", "lighthouse", "--bind", "127.0.0.1:0"]
    cmd += ["--min-replicas", str(min_replicas), "--heartbeat-timeout-ms", "500", "--join-timeout-ms", "2000"]
    lh = Proc(cmd, project, project / f"{name}-lighthouse.log")
    started.append(lh)
    return lh.wait_for(r"^lighthouse: (http://127\.0\.0\.1:\d+)").group(1)


def group(
    project: Path, started: list[Proc], g: int, address: str, run: str, *overrides: str, log: str = ""
) -> Proc:
    cmd = [sys.executable, "-m", "hookloop", "train", "run.yaml", f"train.run_dir=runs/{run}"]
    cmd += [f"fault_tolerance.replica_group_id={g}", f"fault_tolerance.lighthouse={address}", *overrides]
    proc = Proc(cmd, project, project / f"{run}-g{g}{log}.log")
    started.append(proc)
    return proc


def exit_status(run_dir: Path) -> dict:
    return json.loads((run_dir / "exit_status.json").read_text())


def checkpoint_tensors(path: str, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer), by its flattened key."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from hookloop.engine.checkpoint_format.safe_read import SafeReader

    state: dict = {}
    planner = _EmptyStateDictLoadPlanner()
    _load_state_dict(state, storage_reader=SafeReader(path), planner=planner, no_dist=True)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)

    walk("", state)
    return flat


def assert_same_state(a: str, b: str, tmp: Path) -> None:
    ta, tb = checkpoint_tensors(a, tmp), checkpoint_tensors(b, tmp)
    assert sorted(ta) == sorted(tb) and any("optim" in k for k in ta)
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert different == [], different[:5]


def trace_rows(run_dir: Path, group: int) -> list[dict]:
    """The trace lines of a group's files, each with ``"written_by": group``."""
    rows = []
    for path in sorted(run_dir.glob("samples-rank*.jsonl")):
        lines = [{**json.loads(line), "written_by": group} for line in path.read_text().splitlines()]
        steps = [row["step"] for row in lines]
        assert steps == sorted(set(steps)), f"{path}: a step twice or out of order"
        rows += lines
    return rows


def val_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}


def global_stream(project: Path, steps: int, monkeypatch) -> list[list[str]]:
    """The ids of each step's global batch (steps 1..steps), from one rank's view of the stream."""
    from hookloop.run_data import build_data
    from hookloop.train import load_training_config

    monkeypatch.chdir(project)
    cfg = load_training_config("run.yaml", ["fault_tolerance.enabled=false"])
    sampler = build_data(cfg, 0, 1, write_cache=False).sampler
    names, locate = sampler.mixture.names, sampler.mixture.locate
    ids = []
    for index in itertools.islice(iter(sampler), steps * 2 * PER_GROUP):
        source, local = locate(index)
        ids.append(f"{names[source]}:{local}")
    return [ids[i : i + 2 * PER_GROUP] for i in range(0, len(ids), 2 * PER_GROUP)]


def test_a_killed_group_heals_live_while_the_other_keeps_training(project, tmp_path, monkeypatch):
    with processes() as started:
        address = lighthouse(project, started, 1, "kill")
        g0 = group(project, started, 0, address, "kill")
        g1 = group(project, started, 1, address, "kill")
        both = g0.wait_for(r"2 of 2 live .* at step (\d+)$")
        g1.wait_step(int(both.group(1)) + 20)
        g1.kill()  # SIGKILL, mid-step or between steps
        lost = g0.wait_for(r"1 of 2 live \(groups 0; lost group 1\) at step (\d+)$", timeout=30)
        lost_at = int(lost.group(1))
        g0.wait_step(lost_at + 30)  # the survivor trains on alone
        g1b = group(project, started, 1, address, "kill", log="-restarted")
        healed_at = int(g1b.wait_for(r"healed from replica group 0 at step (\d+)").group(1))
        g0.wait_for(r"2 of 2 live \(groups 0, 1; group 1 joined\) at step (\d+)$")
        g1b.wait_step(healed_at + 10)
        os.kill(g1b.proc.pid, signal.SIGTERM)  # a stop asked on one group stops both at one step
        assert g1b.exit_code() == 75, g1b.text()[-3000:]
        assert g0.exit_code() == 75, g0.text()[-3000:]

    run = project / "runs/kill"
    s0, s1 = exit_status(run / "replica_group_0"), exit_status(run / "replica_group_1")
    assert s0["code"] == s1["code"] == 75 and s0["step"] == s1["step"] > healed_at > lost_at
    out0, out1 = g0.text(), g1b.text()
    # The survivor never restarted nor read a checkpoint; each quorum change is one line.
    after_kill = out0[out0.index("lost group 1") :]
    assert out0.count("lost group 1") == 1 and after_kill.count("group 1 joined") == 1
    assert "resumed from" not in out0 and "rolled back" not in out0
    assert f"start: healed from replica group 0 (step {healed_at})" in out1
    assert "resumed from" not in out1  # from the peer, not from disk (it saved none)
    # Identical weights and optimizer state: the final save of both groups.
    assert_same_state(s0["checkpoint"], s1["checkpoint"], tmp_path)

    # Every sample of the global stream, step by step: each line holds its group's share of that
    # step's global batch, so no draw is in two lines (nothing is retrained, committed or not); the
    # share of a group absent from a step's quorum is in no line (dropped: never drawn).
    rows = trace_rows(run / "replica_group_0", 0) + trace_rows(run / "replica_group_1", 1)
    last = s0["step"]
    stream = global_stream(project, last, monkeypatch)
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    assert sorted(by_step) == list(range(1, last + 1))
    died = max(row["step"] for row in rows if row["written_by"] == 1 and row["step"] <= lost_at) + 1
    for step, lines in by_step.items():  # the lines of a step: disjoint parts of its draws
        ids = [i for row in lines for i in row["ids"]]
        assert len(set(ids)) == len(ids) == PER_GROUP * len(lines) and set(ids) <= set(stream[step - 1])
        live = lines[0]["groups"]
        assert all(row["groups"] == live for row in lines)
        if len(lines) == 2:
            assert live == [0, 1] and all(row["committed"] for row in lines), (step, lines)
        elif step != died:  # alone: before the other joined, or while group 1 was down
            assert live == [lines[0]["written_by"]], (step, lines)
        else:  # the kill's step: group 1 died before its quorum, or after it (maybe after its commit)
            assert lines[0]["written_by"] == 0 and live in ([0], [0, 1]), (step, lines)
    assert len(by_step[died]) == 1
    assert [step for step, lines in by_step.items() if not lines[0]["committed"]] in ([], [died])
    assert all(len(by_step[step]) == 2 for step in range(healed_at + 1, last + 1))
    assert all(len(by_step[step]) == 1 for step in range(died, healed_at + 1))


def test_a_nan_on_one_group_is_skipped_on_both_and_the_checkpoint_resumes_without_torchft(project, tmp_path):
    # Microbatches 20 and 21 are step 11's (2 a step): NaN on group 0 only. Both groups must be
    # there from the start (min_replicas 2), so every step is trained by both.
    with processes() as started, lighthouse_here(2) as address:
        common = ("step_scheduler.max_steps=16", "fault_tolerance.min_replicas=2")
        common += ("data.val_samples=16", "step_scheduler.val_every_steps=8")
        nan = ("fault_injection.enabled=true", "fault_injection.kind=nan")
        nan += ("fault_injection.microbatches=[20,21]",)
        g0 = group(project, started, 0, address, "nan", *common, *nan)
        g1 = group(project, started, 1, address, "nan", *common)
        assert g0.exit_code() == 0, g0.text()[-3000:]
        assert g1.exit_code() == 0, g1.text()[-3000:]
    run = project / "runs/nan"
    s0, s1 = exit_status(run / "replica_group_0"), exit_status(run / "replica_group_1")
    assert s0["step"] == s1["step"] == 16
    for out in (g0.text(), g1.text()):
        skipped = re.findall(r"step (\d+): .*step skipped on every rank", out)
        assert skipped == ["11"], out[-3000:]
    assert_same_state(s0["checkpoint"], s1["checkpoint"], tmp_path)
    val = [val_losses(run / f"replica_group_{g}") for g in (0, 1)]  # each group on the whole set
    assert sorted(val[0]) == [8, 16] and val[0] == val[1]
    rows = trace_rows(run / "replica_group_0", 0) + trace_rows(run / "replica_group_1", 1)
    assert all(row["committed"] and row["groups"] == [0, 1] for row in rows) and len(rows) == 32

    # The checkpoint of a group resumes in a plain run: no fault_tolerance section, and a torchft
    # that fails when imported, so any import of it would end the run.
    fake = tmp_path / "no_torchft"
    (fake / "torchft").mkdir(parents=True)
    (fake / "torchft" / "__init__.py").write_text("raise ImportError('torchft imported by a plain run')\n")
    plain = Proc(
        [
            sys.executable,
            "-m",
            "hookloop",
            "train",
            "run.yaml",
            "fault_tolerance.enabled=false",
            "train.run_dir=runs/plain",
            "step_scheduler.max_steps=18",
            "data.trace_samples=false",
            f"checkpoint.resume={run / 'replica_group_0' / 'checkpoints'}",
        ],
        project,
        project / "plain.log",
        env={"PYTHONPATH": f"{fake}{os.pathsep}{REPO}"},
    )
    try:
        assert plain.exit_code() == 0, plain.text()[-3000:]
    finally:
        plain.kill()
    assert "resumed from" in plain.text() and "(step 16)" in plain.text()
    assert exit_status(project / "runs/plain")["step"] == 18


def test_a_group_with_other_settings_is_refused_by_name_before_its_first_step(project):
    # Three groups (a global batch of 12): group 0 trains; groups 1 and 2 join it with another
    # learning rate and another model width, and are refused before they receive anything.
    three = ("fault_tolerance.num_replica_groups=3", "step_scheduler.global_batch_size=12")
    with processes() as started, lighthouse_here(1) as address:
        g0 = group(project, started, 0, address, "mixed", *three)
        g0.wait_step(5)
        g1 = group(project, started, 1, address, "mixed", *three, "optimizer.lr=0.003")
        g2 = group(project, started, 2, address, "mixed", *three, "model.dim=12")
        for proc, line in (
            (g1, "config error: optimizer.lr: is 0.003 here but 0.0003 on replica group 0"),
            (g2, "config error: model.dim: is 12 here but 8 on replica group 0"),
        ):
            assert proc.exit_code() == 2, proc.text()[-3000:]
            assert proc.text().strip().splitlines()[-1].startswith(line), proc.text()[-3000:]
            assert "step 1/" not in proc.text() and "Traceback" not in proc.text()
        at = g0.last_step()
        g0.wait_step(at + 5)  # the live group trains on
        os.kill(g0.proc.pid, signal.SIGTERM)
        assert g0.exit_code() == 75, g0.text()[-3000:]
    run = project / "runs/mixed"
    assert sorted(p.name for p in run.iterdir()) == ["replica_group_0"]  # the refused wrote nothing


def test_groups_resumed_at_one_step_without_a_heal_compare_their_settings_too(project):
    # Both groups save step 4 and end; started again (one with another learning rate), both resume
    # step 4, so neither heals: the quorum's exchange of settings refuses both by name.
    both = ("fault_tolerance.min_replicas=2",)
    with processes() as started, lighthouse_here(2) as address:
        first = [
            group(project, started, g, address, "same", *both, "step_scheduler.max_steps=4") for g in [0, 1]
        ]
        assert [g.exit_code() for g in first] == [0, 0], first[1].text()[-3000:]
        before = [exit_status(project / f"runs/same/replica_group_{g}") for g in (0, 1)]
        again = [
            group(project, started, g, address, "same", *both, "step_scheduler.max_steps=6", *lr, log="+")
            for g, lr in ((0, ()), (1, ("optimizer.lr=0.003",)))
        ]
        for proc, line in (
            (again[0], "config error: optimizer.lr: is 0.0003 here but 0.003 on replica group 1"),
            (again[1], "config error: optimizer.lr: is 0.003 here but 0.0003 on replica group 0"),
        ):
            assert proc.exit_code() == 2, proc.text()[-3000:]
            assert proc.text().strip().splitlines()[-1].startswith(line), proc.text()[-3000:]
            assert "healed from" not in proc.text() and "step 5/" not in proc.text()
    assert [exit_status(project / f"runs/same/replica_group_{g}") for g in (0, 1)] == before


def test_no_lighthouse_a_silent_one_or_a_lost_one_ends_the_group_with_77_in_one_line(project):
    fast = ("fault_tolerance.connect_timeout_s=2", "fault_tolerance.quorum_timeout_s=4")
    with socket.socket() as free, socket.socket() as silent:
        free.bind(("127.0.0.1", 0))  # a port nothing listens on once closed
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connects, never answers
        nobody = f"http://127.0.0.1:{free.getsockname()[1]}"
        mute = f"http://127.0.0.1:{silent.getsockname()[1]}"
        free.close()
        with processes() as started:
            address = lighthouse(project, started, 1, "lost")
            lost = group(project, started, 0, address, "lost", *fast)
            none = group(project, started, 0, nobody, "none", *fast)
            quiet = group(project, started, 0, mute, "quiet", *fast)
            lost.wait_step(5)
            started[0].kill()  # the lighthouse dies mid-run
            killed = time.monotonic()
            assert lost.exit_code() == 77, lost.text()[-3000:]
            assert time.monotonic() - killed < 4 + 30  # quorum_timeout_s, with room for a loaded machine
            for proc, why in (
                (none, "no quorum of replica groups within 2 s (fault_tolerance.connect_timeout_s"),
                (quiet, "no quorum of replica groups within 4 s (fault_tolerance.quorum_timeout_s"),
            ):
                assert proc.exit_code() == 77, proc.text()[-3000:]
                assert proc.text().strip().splitlines() == [proc.text().strip()], proc.text()
                assert proc.text().startswith(f"stopped: {why}"), proc.text()
    assert "Traceback" not in lost.text()
    assert lost.text().strip().splitlines()[-1].startswith("stopped: no quorum of replica groups within 4 s")
    for run, at_step in (("lost", 5), ("none", 0), ("quiet", 0)):
        status = exit_status(project / "runs" / run / "replica_group_0")
        assert status["code"] == 77 and (status["step"] >= 5 if at_step else status["step"] == 0), status
    assert not (project / "runs/none/replica_group_0/config.yaml").exists()  # it never started


def test_config_refusals_name_the_field_before_anything_starts(project, monkeypatch):
    from hookloop.engine.fault_tolerance import FaultToleranceConfig
    from hookloop.train import load_training_config

    monkeypatch.chdir(project)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    base = ["fault_tolerance.replica_group_id=0", "fault_tolerance.lighthouse=http://127.0.0.1:1"]
    cases = {
        "fault_tolerance.replica_group_id: is null and REPLICA_GROUP_ID is not set": [base[1]],
        "fault_tolerance.lighthouse: is null and TORCHFT_LIGHTHOUSE is not set": [base[0]],
        "fault_tolerance.lighthouse: 'localhost' is not a lighthouse address": [
            base[0],
            "fault_tolerance.lighthouse=localhost",
        ],
        "fault_tolerance.replica_group_id: is 2, but the groups are 0..1": [
            base[1],
            "fault_tolerance.replica_group_id=2",
        ],
        "fault_tolerance.min_replicas: (3) cannot exceed": [*base, "fault_tolerance.min_replicas=3"],
        "distributed.tp_size: (2) is not supported with fault_tolerance.enabled": [
            *base,
            "distributed.tp_size=2",
            "step_scheduler.global_batch_size=16",
        ],
        "distributed.dp_mode: 'fsdp' is not supported": [*base, "distributed.dp_mode=fsdp"],
        "nan.action: 'rollback' is not supported": [*base, "nan.action=rollback"],
        "fault_tolerance.timeout_s: (30.0 s) must be below distributed.hang_timeout_s": [
            *base,
            "fault_tolerance.timeout_s=30",
            "distributed.hang_timeout_s=20",
        ],
        "step_scheduler.global_batch_size: (6) must be a multiple of": [
            *base,
            "step_scheduler.global_batch_size=6",
        ],
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_training_config("run.yaml", overrides, world_size=2 if "tp_size" in message else 1)
        assert message in str(caught.value), (message, str(caught.value))
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    cfg = load_training_config("run.yaml")
    assert (
        cfg.fault_tolerance.group_id() == 1
        and cfg.fault_tolerance.lighthouse_address() == "http://127.0.0.1:29510"
    )
    monkeypatch.setattr("hookloop.engine.fault_tolerance.torchft_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"fault_tolerance.enabled: needs torchft.*hookloop\[torchft\]"):
        FaultToleranceConfig(enabled=True).validate()

    # From the command line: exit 2, one line, no run directory made.
    bad = run_process(
        [
            sys.executable,
            "-m",
            "hookloop",
            "train",
            "run.yaml",
            "train.run_dir=runs/refused",
            *base,
            "fault_tolerance.min_replicas=3",
        ],
        cwd=project,
        timeout=120,
    )
    assert bad.returncode == 2 and "config error: fault_tolerance.min_replicas" in bad.stderr
    assert not (project / "runs/refused").exists()
    lh = run_process(
        [sys.executable, "-m", "hookloop", "lighthouse", "--min-replicas", "0"], cwd=project, timeout=120
    )
    assert lh.returncode == 2 and "--min-replicas" in lh.stderr


def test_the_torchft_adapter_checks_the_version_whose_private_parts_it_reads(monkeypatch, caplog):
    import importlib.metadata

    from hookloop.engine import fault_tolerance

    assert fault_tolerance.check_torchft_version()  # the installed release: no warning
    assert "is installed, but hookloop is tested" not in caplog.text
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.0")
    assert not fault_tolerance.check_torchft_version()
    assert "torchft 0.3.0 is installed, but hookloop is tested with torchft==0.2.0" in caplog.text


def test_without_the_section_nothing_imports_torchft():
    code = (
        "import sys, torch, hookloop, hookloop.engine, hookloop.train, hookloop.handlers.replica_groups\n"
        "from hookloop import Trainer\n"
        "model = torch.nn.Linear(2, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "trainer = Trainer(model, optimizer, torch.nn.functional.mse_loss)\n"
        "trainer.run([(torch.ones(4, 2), torch.ones(4, 1))] * 3, max_epochs=1)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torchft')))\n"
    )
    out = run_process([sys.executable, "-c", code], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
