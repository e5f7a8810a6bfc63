"""``benchmarks/run.py --quick`` writes its smoke-sized figures to results/quick.json and leaves the
committed RESULTS.md and results/latest.json byte for byte as they were."""

import json
import sys

from tests.dist_utils import REPO, run_process

BENCH = REPO / "benchmarks"


def test_quick_run_leaves_committed_results_alone():
    committed = [BENCH / "RESULTS.md", BENCH / "results" / "latest.json"]
    before = {p: p.read_bytes() if p.exists() else None for p in committed}
    quick = BENCH / "results" / "quick.json"
    quick.unlink(missing_ok=True)
    proc = run_process([sys.executable, str(BENCH / "run.py"), "--quick", "--only", "event_bus"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert {p: p.read_bytes() if p.exists() else None for p in committed} == before
    result = json.loads(quick.read_text())
    assert result["quick"] is True
    assert [r["benchmark"] for r in result["results"]] == ["event_bus"]
    assert "event_bus: " in proc.stdout  # the table is printed


SIDE_BY_SIDE = """
import argparse, json, sys
sys.path.insert(0, "benchmarks")
import checkpoint_throughput as c
row = dict(saves_s=1.1, no_saves_s=1.0, kept=0.91, median_step_ms=50.0, vs_hand=1.02, after=1, after_low=1)
names = ["hand-written loop + dcp.save [dcp]", "HF Trainer [save_steps]", "hookloop [async]"]
result = c.result_json({n: dict(row) for n in names}, None, {}, {}, argparse.Namespace(every=10))
print(json.dumps(result))
"""


def test_the_side_by_side_rows_name_the_hand_loop_hf_and_hookloops_default_handlers():
    """run.py prints, under its table, checkpoint_throughput's step over the hand loop's (HF Trainer and
    hookloop's default handlers) and the throughput kept saving (hand loop, HF, hookloop), picked by
    the names that benchmark emits: its result built from made-up rows, no benchmark run."""
    from benchmarks.run import headline

    proc = run_process([sys.executable, "-c", SIDE_BY_SIDE], timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [row[0] for row in headline([result])]
    assert rows == [
        "checkpoint_throughput: throughput kept saving every 10 steps / not saving, 1 process, "
        "hand-written loop + dcp.save [dcp]",
        "checkpoint_throughput: throughput kept saving every 10 steps / not saving, 1 process, "
        "HF Trainer [save_steps]",
        "checkpoint_throughput: step without saves / hand-written loop's, same round, 1 process, "
        "HF Trainer [save_steps]",
        "checkpoint_throughput: throughput kept saving every 10 steps / not saving, 1 process, "
        "hookloop, default handlers [async]",
        "checkpoint_throughput: step without saves / hand-written loop's, same round, 1 process, "
        "hookloop, default handlers [async]",
    ]
    assert headline([{**result, "error": "timed out"}]) == []  # a failed run shows in the table only
