"""Ctrl-C: the first one stops after the current step with a checkpoint and exit code 75 (no
traceback); a second one interrupts at once."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from tests.dist_utils import REPO
from tests.forked import reap, start_forked

SCRIPT = REPO / "tests" / "scripts" / "sigint_train.py"


def _run(tmp_path, presses: int) -> tuple[int, dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = start_forked([sys.executable, str(SCRIPT), str(tmp_path)], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, reap(proc)
            time.sleep(0.05)
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            reap(proc)
    result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), {})
    return proc.returncode, result, err


def test_first_ctrl_c_stops_after_the_step_with_a_checkpoint_and_75(tmp_path):
    code, result, err = _run(tmp_path, presses=1)
    assert code == 75, err
    assert result["saved"] == result["step"] >= 5
    assert "Traceback" not in err
    assert "press Ctrl-C again" in err
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert status["code"] == 75 and status["step"] == result["step"]


def test_second_ctrl_c_interrupts_at_once(tmp_path):
    code, result, err = _run(tmp_path, presses=2)
    assert code == 130, err
    assert result["interrupted"] is True
    status = json.loads((tmp_path / "exit_status.json").read_text())
    assert status["code"] == 130
