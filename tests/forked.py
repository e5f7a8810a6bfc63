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
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def finish(proc: Any, timeout: float, what: object) -> tuple[str, str]:
    """``proc``'s output once it ended (a ``subprocess.Popen`` or a :class:`ForkedProcess`); past
    ``timeout`` seconds its session is killed and TimeoutError raised, naming ``what``; on Ctrl-C
    or SIGTERM of the tests (``conftest.py``) the command goes too."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = reap(proc)
        said = f"stdout:\n{out}\nstderr:\n{err}"
        raise TimeoutError(f"{what} did not finish within {timeout}s\n{said}") from None
    except BaseException:
        reap(proc)
        raise


class ForkServer:
    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
            bufsize=0,  # unbuffered: readline takes one reply, select sees the next one still waiting
        )  # fmt: skip
        self.outputs = Path(tempfile.mkdtemp(prefix="forked-output-"))  # not in the command's directory
        self._ids = itertools.count()
        self._replies: dict[int, dict] = {}  # request id -> what the server said of it so far

    def _read(self, timeout: float) -> bool:
        """Take one reply (False when none came within ``timeout`` seconds)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, timeout))
        if not ready:
            return False
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended ({self.proc.wait(timeout=10)})")
        reply = json.loads(line)
        self._replies.setdefault(reply.pop("id"), {}).update(reply)
        return True

    def reply(self, rid: int, key: str, timeout: float | None) -> Any:
        """The server's ``key`` for request ``rid`` (None if it did not come within ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while key not in self._replies.get(rid, {}):
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if not self._read(left) and deadline is not None and time.monotonic() >= deadline:
                return None
        return self._replies[rid][key] if key != "returncode" else self._replies.pop(rid)[key]

    def start(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: dict,
        stream: bool = False,
        stdout: Path | None = None,
        stderr: Path | None = None,
    ) -> ForkedProcess:
        """Start ``python ARGV`` as a fork; ``stream``: its stdout is a FIFO the caller reads as
        it comes (``.stdout``), else a file read at the end (``stdout``, ``stderr``: these files,
        which stay)."""
        rid = next(self._ids)
        out = stdout or self.outputs / f"{rid}.stdout"
        err = stderr or self.outputs / f"{rid}.stderr"
        if stream:
            os.mkfifo(out)
        for path in {stdout, stderr} - {None}:  # there from the start, as Popen's open files are
            path.write_bytes(b"")
        request = {
            "id": rid,
            "argv": list(argv),
            "cwd": str(cwd),
            "env": env,
            "stdout": str(out),
            "stderr": str(err),
        }
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        pid = self.reply(rid, "pid", START_S)
        if pid is None:
            raise RuntimeError(f"the fork server did not start a command within {START_S} s")
        return ForkedProcess(self, rid, pid, [sys.executable, *argv], out, err, stream)

    def run(
        self, argv: Sequence[str], *, cwd: Path, env: dict, timeout: float
    ) -> subprocess.CompletedProcess:
        proc = self.start(argv, cwd=cwd, env=env)
        out, err = finish(proc, timeout, list(argv)[:3])
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.outputs, ignore_errors=True)


class ForkedProcess:
    """A command the fork server started, as much of ``subprocess.Popen`` as the tests use: ``pid``
    (also its session and process group), ``poll``, ``wait``, ``communicate`` (its output, read
    from files once it ended), ``returncode``; with ``stream``, ``stdout`` reads its output as it
    comes (text lines)."""

    def __init__(
        self, server: ForkServer, rid: int, pid: int, args: list[str], out: Path, err: Path, stream: bool
    ) -> None:
        self._server, self._rid, self.pid, self.args = server, rid, pid, args
        self._out, self._err = out, err
        self.returncode: int | None = None
        self.stdout = open(out, errors="replace") if stream else None  # noqa: SIM115 -- closed on exit

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.reply(self._rid, "returncode", 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.reply(self._rid, "returncode", timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self.stdout is not None:
            out = self.stdout.read()
            self.stdout.close()
        else:
            out = self._out.read_text(errors="replace")
        err = self._err.read_text(errors="replace")
        for path in (self._out, self._err):
            if path.parent == self._server.outputs:
                path.unlink(missing_ok=True)
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SERVER: ForkServer | None = None


def server() -> ForkServer:
    """This test process's fork server (started on first use)."""
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER


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
    return server().run(list(cmd[1:]), cwd=Path(cwd), env=env, timeout=timeout)


def start_forked(
    cmd: Sequence[str],
    *,
    cwd: str | Path,
    env: dict,
    stream: bool = False,
    stdout: Path | None = None,
    stderr: Path | None = None,
) -> ForkedProcess:
    """Start ``cmd`` (``forkable``) in the background as a fork of this test process's server, with
    exactly ``env``, in a session of its own (:meth:`ForkServer.start`); the caller ends it
    (``reap``)."""
    return server().start(list(cmd[1:]), cwd=Path(cwd), env=env, stream=stream, stdout=stdout, stderr=stderr)
