"""Every benchmark runs once in its --quick form, so none can rot. No timing is asserted."""

import json
import math
import sys

import pytest

from benchmarks.run import BENCHMARKS
from tests.dist_utils import REPO, run_process


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_runs_and_reports_figures(name, tmp_path):
    out = tmp_path / "result.json"
    script = REPO / "benchmarks" / BENCHMARKS[name]
    proc = run_process([sys.executable, str(script), "--quick", "--json", str(out)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == name
    assert result["figures"], "a benchmark must report at least one figure"
    for figure in result["figures"]:
        assert figure["figure"]
        numbers = [figure.get(k) for k in ("hookloop", "reference", "ratio") if figure.get(k) is not None]
        assert numbers and all(math.isfinite(v) and v >= 0 for v in numbers), figure
