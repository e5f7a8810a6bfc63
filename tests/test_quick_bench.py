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
rows = {n: dict(row) for n in names}
rows["hookloop [async]"]["local_runs"] = [0.97, None, 0.93]
result = c.result_json(rows, None, {}, {}, argparse.Namespace(every=10))
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
        "checkpoint_throughput: throughput kept saving every 10 steps, read locally, worst round, 1 process, "
        "hookloop, default handlers [async]",
        "checkpoint_throughput: step without saves / hand-written loop's, same round, 1 process, "
        "hookloop, default handlers [async]",
    ]
    worst = next(f for f in result["figures"] if "read locally" in f["figure"])
    assert (worst["ratio"], worst["target"], worst["met"]) == (0.93, ">= 0.95", False)
    assert headline([{**result, "error": "timed out"}]) == []  # a failed run shows in the table only


KEPT_LOCAL = """
import json, sys
sys.path.insert(0, "benchmarks")
import checkpoint_throughput as c
def stamps(step_of, timed=40, every=10):
    out, t = [0.0], 0.0
    for k in range(2, c.WARMUP + timed + 2):  # the stamp at the end of step k
        t += step_of(k)
        out.append(t)
    return out
drift = lambda k: 0.1 if k < 20 else 0.2  # the machine halves its speed between windows
cost = lambda k: 0.05 if k % 10 == 0 else 0.0  # each save costs half a step at its own step
late = lambda k: 0.05 if k % 10 == 1 else 0.0  # or at the next one (HF Trainer saves there)
print(json.dumps([
    c.kept_local(stamps(drift), 40, 10),
    c.kept_local(stamps(lambda k: 0.1 + cost(k)), 40, 10),
    c.kept_local(stamps(lambda k: drift(k) + late(k)), 40, 10),
    c.kept_local(stamps(drift), 40, 5),
]))
"""


def test_kept_local_reads_a_saves_cost_against_its_own_second():
    """The throughput kept saving, read from the saving run alone: a save's cost in its window counts
    whether it lands on the save's step or the next, and a machine whose speed changes between
    windows (which the run without saves would see elsewhere) does not count as a cost."""
    proc = run_process([sys.executable, "-c", KEPT_LOCAL], timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    no_cost, cost, late_cost, too_short = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(no_cost - 1.0) < 1e-9
    assert abs(cost - 1.0 / 1.05) < 1e-9  # 1 s of steps spends 1.05 s with the save
    # windows at 10 (0.1 s steps) and 20, 30 (0.2 s steps): (1 + 2 + 2) / (1.05 + 2.05 + 2.05)
    assert abs(late_cost - 5.0 / 5.15) < 1e-9
    assert too_short is None  # 5 steps leave too few for the window's own median


BY_OFFSET = """
import json, sys
sys.path.insert(0, "benchmarks")
import checkpoint_throughput as c
def stamps(step_of, timed=40):
    out, t = [0.0], 0.0
    for k in range(2, c.WARMUP + timed + 2):  # the stamp at the end of step k
        t += step_of(k)
        out.append(t)
    return out
burst = lambda k: 0.5 if k == 23 else 0.1  # one step of one window five times as long
cost = lambda k: 0.15 if k % 10 == 0 else 0.1  # each save costs half a step at its own step
runs = [stamps(burst), stamps(lambda k: 0.1)]
print(json.dumps([
    c.kept_local(runs[0], 40, 10),
    c.kept_by_offset(runs, 40, 10),
    c.kept_by_offset([stamps(cost), stamps(lambda k: cost(k) + burst(k) - 0.1)], 40, 10),
    c.kept_by_offset(runs[:1], 40, 10),
]))
"""


def test_kept_by_offset_reads_a_saves_cost_and_not_a_burst_of_noise():
    """The throughput kept read per offset from the save (the median over saves at each offset): a
    burst of slow steps in one window, which the local reading counts as a cost in a run that never
    saves, reads 1; a save's cost at the same offset in every window counts in full, burst or not;
    fewer than five windows give no reading."""
    proc = run_process([sys.executable, "-c", BY_OFFSET], timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    local, no_cost, cost, too_few = json.loads(proc.stdout.strip().splitlines()[-1])
    assert local < 0.99  # the burst reads as a cost locally
    assert abs(no_cost - 1.0) < 1e-9
    assert abs(cost - 1.0 / 1.05) < 1e-9
    assert too_few is None  # one run's three windows
