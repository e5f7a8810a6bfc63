"""``python ...`` commands of the tests, started as forks of a server that imported torch once.

Importing torch, its checkpoint package and ignite takes about 3 s of CPU in a fresh interpreter;
most commands the tests start are short, so that import was most of the suite's time. A command
this module runs is still a process of its own with its own session, directory, environment,
exit status and output (``tests/scripts/fork_server.py`` says what it sets up and
``tests/test_forked.py`` checks each part), but it did not pay for torch again.

What must see a truly fresh interpreter runs as a plain subprocess (``run_process(...,
fresh=True)``): what torch or the OpenMP runtime read at import time (``OMP_NUM_THREADS``), what
a process's start-up environment shows to others (``/proc/PID/environ``), import-time claims
("importing X does not import Y"), interpreter flags.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "scripts" / "fork_server.py"
START_S = 120  # the server's own start (importing torch) and one fork


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from ``/proc``."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and, first, the session of each of its descendants (torchrun
    starts every worker in a session of its own, out of reach of a kill of the launcher's group)."""
    for child in descendants(pid):
        for kill, target in ((os.killpg, child), (os.kill, child)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for kill in (os.killpg, os.kill):  # its session, then the process if it left it
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def reap(proc: subprocess.Popen) -> tuple[str, str]:
    """Kill ``proc`` and every descendant (:func:`kill_tree`) and collect what it wrote. Bounded: a
    pipe still held open by a process out of reach (another session's orphan) is closed after 30 s
    instead of waited on."""
    if proc.poll() is None:  # a reaped pid may belong to another process by now
        kill_tree(proc.pid)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait(timeout=30)
        return "", ""
    return out or "", err or ""


class ForkServer:
    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
            bufsize=0,  # unbuffered: readline takes one reply, select sees the next one still waiting
        )  # fmt: skip
        self.outputs = Path(tempfile.mkdtemp(prefix="forked-output-"))  # not in the command's directory

    def _reply(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended ({self.proc.wait(timeout=10)})")
        return json.loads(line)

    def run(
        self, argv: Sequence[str], *, cwd: Path, env: dict, timeout: float
    ) -> subprocess.CompletedProcess:
        out, err = self.outputs / "stdout", self.outputs / "stderr"
        request = {"argv": list(argv), "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        started = self._reply(START_S)
        if started is None:
            raise RuntimeError(f"the fork server did not start a command within {START_S} s")
        try:
            ended = self._reply(timeout)
        except BaseException:  # Ctrl-C or SIGTERM of the tests (conftest.py): the command goes too
            kill_tree(started["pid"])
            raise
        if ended is None:
            kill_tree(started["pid"])
            self._reply(START_S)
            raise TimeoutError(
                f"{list(argv)[:3]} did not finish within {timeout}s\n"
                f"stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}"
            )
        cmd = [sys.executable, *argv]
        return subprocess.CompletedProcess(cmd, ended["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.outputs, ignore_errors=True)


_SERVER: ForkServer | None = None


def forkable(cmd: Sequence[str]) -> bool:
    """Whether ``cmd`` is ``python -c``, ``python -m`` or ``python SCRIPT`` with no other flag."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    return cmd[1] in ("-c", "-m") or not cmd[1].startswith("-")


def run_forked(
    cmd: Sequence[str], *, cwd: str | Path, env: dict, timeout: float
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``forkable``) as a fork of this test process's server, with exactly ``env``;
    on timeout the command's session is killed and TimeoutError raised."""
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER.run(list(cmd[1:]), cwd=Path(cwd), env=env, timeout=timeout)
