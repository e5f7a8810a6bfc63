"""The fork server the tests start commands with does what a fresh ``python ...`` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.dist_utils import REPO, run_process

CASES = {  # code -> (exit status, what stdout or stderr holds)
    "raise SystemExit(3)": (3, ""),
    "import sys; sys.exit('said and failed')": (1, "said and failed"),
    "1 / 0": (1, "ZeroDivisionError"),
    "import sys; print(sys.argv, __name__, sys.path[0] == '')": (0, "['-c'] __main__ True"),
    "import sys; print(sorted(m for m in sys.modules if m.startswith('hookloop')))": (0, "[]"),
    "import atexit; atexit.register(print, 'at exit')": (0, "at exit"),
    "import threading, time; threading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()": (
        0,
        "joined",
    ),
    "import os, signal; os.kill(os.getpid(), signal.SIGTERM)": (-15, ""),
    "import os; print(os.getsid(0) == os.getpid())": (0, "True"),
}


@pytest.mark.parametrize("code", CASES)
def test_a_command_exits_and_says_what_python_c_would(code, tmp_path):
    status, said = CASES[code]
    proc = run_process([sys.executable, "-c", code], cwd=tmp_path, timeout=60)
    assert proc.returncode == status, (code, proc.stderr)
    assert said in proc.stdout + proc.stderr, (code, proc.stdout, proc.stderr)
    fresh = run_process([sys.executable, "-c", code], cwd=tmp_path, timeout=60, fresh=True)
    assert (fresh.returncode, said in fresh.stdout + fresh.stderr) == (status, True), (code, fresh.stderr)


def test_directory_environment_and_import_path_are_the_commands_own(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "only_here.py").write_text("WHERE = 'lib'\n")
    code = (
        "import os, tempfile, only_here; "
        "print(os.getcwd(), tempfile.gettempdir(), os.environ['MARK'], only_here.WHERE)"
    )
    env = {"TMPDIR": str(tmp_path), "MARK": "m1", "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path / 'lib'}"}
    proc = run_process([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=60)
    assert proc.stdout.split() == [str(tmp_path), str(tmp_path), "m1", "lib"], proc.stderr
    # the next command does not see the last one's path or variables
    proc = run_process([sys.executable, "-c", "import only_here"], cwd=REPO, timeout=60)
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr


def test_modules_and_scripts_run_as_main_with_their_arguments(tmp_path):
    (tmp_path / "tool.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    proc = run_process([sys.executable, str(tmp_path / "tool.py"), "a", "b"], cwd=REPO, timeout=60)
    assert proc.stdout.split() == ["__main__", "['a',", "'b']", str(tmp_path)], proc.stderr
    proc = run_process([sys.executable, "-m", "tool", "x"], cwd=tmp_path, timeout=60)
    assert proc.stdout.split() == ["__main__", "['x']", str(tmp_path)], proc.stderr


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    with pytest.raises(TimeoutError):
        run_process([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path, timeout=1)
    assert run_process([sys.executable, "-c", "print('next')"], cwd=tmp_path, timeout=60).stdout == "next\n"


INNER = """
import sys
from pathlib import Path

from tests.dist_utils import run_process
from tests.user_models import tiny_lm_config, tiny_lm_source

HANG = '''
import os, time
from pathlib import Path
from hookloop import Events

class Hang:
    def __init__(self, here: str):
        self.here = Path(here)

    def attach(self, trainer):
        trainer.add_event_handler(Events.STEP_END(once=1), self.hang)

    def hang(self):
        self.here.write_text(str(os.getpid()))
        time.sleep(600)
'''


def test_a_training_run_that_hangs(tmp_path):
    here = Path(__file__).parent / "training.pid"
    (tmp_path / "my_models.py").write_text(tiny_lm_source())
    (tmp_path / "my_hooks.py").write_text(HANG)
    config = tiny_lm_config(max_steps=10) + f"handlers: [{{target: my_hooks.py:Hang, here: '{here}'}}]\\n"
    (tmp_path / "run.yaml").write_text(config)
    run_process([sys.executable, "-m", "hookloop", "train", "run.yaml"], cwd=tmp_path, timeout=600)
"""


def _marked(mark: str) -> list[int]:
    """The processes whose environment holds ``mark``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile, or not ours
            pass
    return pids


@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigterm_ends_the_tests_with_every_process_they_started(tmp_path, workers):
    (tmp_path / "test_inner.py").write_text(INNER)
    mark = f"HOOKLOOP_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO), mark.split("=")[0]: mark.split("=")[1]}
    pytest_cmd = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q"]
    with open(tmp_path / "pytest.out", "w") as out:
        inner = subprocess.Popen(
            [*pytest_cmd, "-n", workers, str(tmp_path / "test_inner.py")],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "training.pid").exists():
            assert inner.poll() is None and time.monotonic() < deadline, (tmp_path / "pytest.out").read_text()
            time.sleep(0.1)
        training = int((tmp_path / "training.pid").read_text())
        assert training in _marked(mark)
        inner.send_signal(signal.SIGTERM)
        inner.wait(timeout=60)
        deadline = time.monotonic() + 10
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _marked(mark) == [], (tmp_path / "pytest.out").read_text()[-3000:]
        assert "KeyboardInterrupt" in (tmp_path / "pytest.out").read_text()
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
