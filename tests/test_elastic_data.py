"""Elastic data: a run stopped at dp=2, resumed at dp=1 and again at dp=2 trains every step on the
same global batch of samples as an unbroken dp=2 (and dp=1) run, read from the ``data.trace_samples``
files; each sample exactly once, phases switching at the same global step. For the config path
(``MixtureLoader`` with a phase curriculum) and the map-style path (a plain ``DataLoader`` over a
``MixtureSampler``, killed with SIGKILL mid-run)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from hookloop.engine.data import prepare_tokens, read_sample_traces, stdlib_docs_text, stdlib_source_files
from tests.dist_utils import REPO, kill_ranks, run_process, run_torchrun, start_ranks
from tests.user_models import tiny_lm_config, tiny_lm_source

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MY_MODEL = tiny_lm_source(seq_len=8)

# Global batch 8 = local_batch_size 2 x grad_accum 2 x dp 2 = 2 x 4 x 1. Phases: from step 6 only
# code, from step 10 only docs, so a phase landing one step late or early shows in the ids too.
CONFIG = (
    tiny_lm_config(max_steps=12, ckpt_every_steps=2)
    + """
logging:
  log_interval: 4
data:
  datasets: {docs: docs.u8, code: code.u8}
  weights: {docs: 1.0, code: 1.0}
  val_samples: 0
  trace_samples: true
  phases:
    - start_step: 6
      dataset_weights: {docs: 0.0}
    - start_step: 10
      dataset_weights: {code: 0.0}
"""
)

TOTAL = 12


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    (root / "my_models.py").write_text(MY_MODEL)
    (root / "run.yaml").write_text(CONFIG)
    prepare_tokens([stdlib_docs_text()[:20_000]], root / "docs.u8")
    prepare_tokens(stdlib_source_files(limit=3), root / "code.u8")
    return root


def train(project: Path, nproc: int, run: str, *overrides: str):
    args = ["train", "run.yaml", f"train.run_dir=runs/{run}", *overrides]
    if nproc == 1:
        return run_process([sys.executable, "-m", "hookloop", *args], cwd=project, timeout=180)
    return run_torchrun("hookloop", nproc, args, module=True, cwd=project)


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def global_batches(run_dir: Path) -> dict[int, list[str]]:
    """``{step: sorted ids over every rank}``; a step twice in one file fails the read."""
    out: dict[int, list[str]] = {}
    for steps in read_sample_traces(run_dir).values():
        for step, ids in steps.items():
            out.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in sorted(out.items())}


def assert_exactly_once(batches: dict[int, list[str]], total: int, per_step: int) -> None:
    assert sorted(batches) == list(range(1, total + 1))
    assert all(len(ids) == per_step for ids in batches.values())
    counts = Counter(i for ids in batches.values() for i in ids)
    assert max(counts.values()) == 1, [i for i, n in counts.items() if n > 1][:5]


def test_mixture_loader_resumes_dp2_dp1_dp2_with_the_same_global_batches(project):
    ok(train(project, 2, "ref2"))
    ok(train(project, 1, "ref1"))
    ref2, ref1 = global_batches(project / "runs/ref2"), global_batches(project / "runs/ref1")
    assert_exactly_once(ref2, TOTAL, 8)
    assert ref1 == ref2  # the global batch of a step does not depend on the number of ranks
    for step, ids in ref2.items():  # the phases switch at their steps
        sources = {i.split(":")[0] for i in ids}
        assert sources == ({"code"} if 6 <= step < 10 else {"docs"} if step >= 10 else sources)

    run = project / "runs/elastic"
    ok(train(project, 2, "elastic", "step_scheduler.max_steps=4"))
    # A run killed after training steps 5 and 6 beyond its last checkpoint (step 4) leaves their
    # lines behind; the resumed run must cut them before it trains those steps again.
    for rank in (0, 1):
        with open(run / f"samples-rank{rank}.jsonl", "a") as f:
            for step in (5, 6):
                f.write(json.dumps({"step": step, "ids": [f"docs:{900 + 10 * rank + step}"]}) + "\n")
    # dp=1 with another split of the same global batch: 4 per microbatch x 2 microbatches
    resumed = train(project, 1, "elastic", "step_scheduler.max_steps=8", "train.local_batch_size=4")
    ok(resumed)
    assert "elastic resume at step 4: data written by 2 data-parallel ranks continues on 1" in resumed.stderr
    ok(train(project, 2, "elastic"))
    traces = read_sample_traces(run)
    assert sorted(traces[0]) == list(range(1, TOTAL + 1))  # rank 0 trained every step
    assert sorted(traces[1]) == [1, 2, 3, 4, 9, 10, 11, 12]  # rank 1 only the dp=2 steps
    assert global_batches(run) == ref2


def test_a_resume_that_changes_the_global_batch_is_refused(project):
    ok(train(project, 2, "grown", "step_scheduler.max_steps=2"))
    proc = train(project, 1, "grown", "step_scheduler.global_batch_size=16")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert line.startswith(
        "config error: step_scheduler.global_batch_size: the checkpoint at step 2 was trained with 8, "
        "this run sets 16; "
    ), line
    assert "set step_scheduler.global_batch_size=8 to resume it" in line
    assert "Traceback" not in proc.stderr
    assert max(read_sample_traces(project / "runs/grown")[0]) == 2  # nothing trained


SCRIPT = REPO / "tests" / "scripts" / "elastic_train.py"


def script(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(run_dir), *args]


def test_map_style_loader_killed_at_dp2_resumes_at_dp1_then_dp2(tmp_path):
    total = 16
    for world, name in ((2, "ref2"), (1, "ref1")):
        cmd = script(tmp_path / name, "--steps", str(total))
        proc = run_torchrun(cmd[1], world, cmd[2:]) if world > 1 else run_process(cmd)
        ok(proc)
    ref2, ref1 = global_batches(tmp_path / "ref2"), global_batches(tmp_path / "ref1")
    assert_exactly_once(ref2, total, 8)
    assert ref1 == ref2

    run = tmp_path / "elastic"
    procs = start_ranks(
        script(run, "--steps", str(total), "--step-sleep", "0.3"), 2, env={"OMP_NUM_THREADS": "1"}
    )
    try:  # SIGKILL both ranks once step 5 trained: steps after the last checkpoint (every 2) are lost
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                traces = read_sample_traces(run) if run.exists() else {}
            except ValueError:  # a line read while it was being written
                traces = {}
            if max(traces.get(0, {0: None}), default=0) >= 5 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
    finally:
        kill_ranks(procs)
    assert all(p.returncode == -9 for p in procs), [p.returncode for p in procs]
    before = max(read_sample_traces(run)[0])
    resumed = run_process(script(run, "--steps", "12"))
    ok(resumed)
    step = int(resumed.stdout.split("RESUMED AT ")[1].split()[0])
    assert 4 <= step <= before
    ok(run_torchrun(SCRIPT, 2, [str(run), "--steps", str(total)]))
    assert global_batches(run) == ref2
    shutil.rmtree(run / "checkpoints")


def test_a_rollback_cuts_the_lines_of_the_steps_it_undoes(project):
    if not (project / "runs/ref1").exists():
        ok(train(project, 1, "ref1"))
    # microbatch 10 is in step 3 (4 microbatches per step at dp=1): NaN, roll back to step 2, rewind
    # the data and train step 3 again on the same samples
    args = ["fault_injection.enabled=true", "fault_injection.kind=nan", "fault_injection.microbatches=[10]"]
    args += ["nan.max_consecutive=1", "nan.skip_data_on_rollback=false"]
    proc = train(project, 1, "rollback", *args)
    ok(proc)
    assert "rolled back to" in proc.stderr
    assert global_batches(project / "runs/rollback") == global_batches(project / "runs/ref1")
