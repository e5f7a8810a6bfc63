"""Every ```python block of the documentation pages below runs as written.

Each block runs in its own interpreter with the repository on ``PYTHONPATH`` and one OpenMP
thread, under a hard timeout. Blocks that write files run in a temporary working directory (and
``TMPDIR`` points there too, so ``tempfile`` directories land in it); the others run from the
repository root. A block whose first line is ``# not run`` is a fragment and is skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ("nan_detector.md", "checkpoint.md", "requeue.md", "observability.md")
TIMEOUT_S = 120
NOT_RUN = "# not run"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_WRITES = ("tempfile", "open(", ".write_", ".mkdir(", "makedirs(", "run_dir")


def blocks(page: str) -> list[str]:
    return _BLOCK.findall((REPO / "docs" / page).read_text())


CASES = [
    pytest.param(page, i, block, id=f"{page}[{i}]") for page in PAGES for i, block in enumerate(blocks(page))
]


@pytest.mark.parametrize("page", PAGES)
def test_every_page_has_runnable_blocks(page):
    found = blocks(page)
    assert found, f"docs/{page} has no ```python block"
    assert any(not b.startswith(NOT_RUN) for b in found), f"docs/{page} has only '{NOT_RUN}' blocks"


@pytest.mark.parametrize(("page", "index", "block"), CASES)
def test_block_runs(page, index, block, tmp_path):
    if block.startswith(NOT_RUN):
        pytest.skip(f"docs/{page} block {index} is a fragment ({NOT_RUN})")
    writes = any(marker in block for marker in _WRITES)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", block],
        cwd=tmp_path if writes else REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the block's own children go down with it on a timeout
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"docs/{page} block {index} ran longer than {TIMEOUT_S}s\n{out[-2000:]}\n{err[-3000:]}")
    where = f"docs/{page} block {index} exited {proc.returncode}"
    assert proc.returncode == 0, f"{where}\n{out[-2000:]}\n{err[-3000:]}"
