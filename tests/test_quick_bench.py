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
