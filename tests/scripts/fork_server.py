"""Starts test commands as forks of an interpreter that imported torch once.

``tests/forked.py`` starts one per test process. It imports the heavy third-party modules every
command pays for (torch, torch.distributed.checkpoint, ignite, torch._dynamo, which every optimizer
imports) and nothing of hookloop's, so a
command still runs its own imports of the project. Then, for each request (one JSON line on stdin:
``argv`` after the interpreter -- ``["-c", CODE]``, ``["-m", MODULE, *args]`` or
``[SCRIPT, *args]`` --, ``cwd``, ``env``, ``stdout`` and ``stderr`` file paths), it forks a child
that becomes what ``python ARGV`` would be: its own session, that directory and environment,
``sys.path`` rebuilt from that environment's ``PYTHONPATH``, stdin from /dev/null, stdout and
stderr to the files, ``sys.argv`` and ``__main__`` as the interpreter sets them; the child's exit
runs what interpreter shutdown runs (non-daemon threads joined, atexit callbacks, streams flushed).

Each request has an ``id``; several commands may run at once (a test's background run and the
command it then starts beside it). Replies on stdout, one JSON line each: ``{"id": I, "pid": N}``
when the child started, ``{"id": I, "returncode": N}`` when it ended (``-signal`` if a signal ended
it, as ``subprocess`` reports). A ``stdout`` that is a FIFO (a test that reads the output as it
comes) is opened first, before anything else the child does.

The server exits 3 instead of forking if importing started a thread: a fork of a process that runs
other threads can leave the child holding a lock no thread will release.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import sys
import tempfile
import threading
import traceback
import types
from typing import NoReturn

import ignite.engine  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

_OWN_PATH = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
_BASE_PATH = [p for p in sys.path[1:] if p not in _OWN_PATH]  # stdlib and site-packages


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _become(request: dict) -> None:
    """The process state ``python ARGV`` starts with, in this directory and environment."""
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC  # first: a reader waits on a FIFO's other end
    fds = [os.open(os.devnull, os.O_RDONLY), os.open(request["stdout"], write)]
    same = request["stderr"] == request["stdout"]  # stderr=subprocess.STDOUT
    fds.append(os.dup(fds[1]) if same else os.open(request["stderr"], write))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is read again
    argv = request["argv"]
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.abspath(argv[0]))
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def _run(argv: list[str]) -> None:
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def run_as_python(argv: list[str]) -> int:
    """``python ARGV`` in this process (import path already set): its exit status, an uncaught
    exception printed as the interpreter prints it."""
    try:
        _run(argv)
        return 0
    except SystemExit as e:
        return _exit_code(e)
    except BaseException:
        traceback.print_exc()
        return 1


def exit_now(code: int) -> NoReturn:
    """End this forked process with ``code`` after what interpreter shutdown does (non-daemon
    threads joined, atexit callbacks, streams flushed)."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _child(request: dict) -> NoReturn:
    """Become ``python ARGV`` and exit with its status."""
    code = 1
    try:
        _become(request)
        code = run_as_python(request["argv"])
    except BaseException:
        traceback.print_exc()
    exit_now(code)


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    running: dict[int, int] = {}  # pid -> request id
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        while running:  # reap what ended, in any order: several commands may run at once
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply({"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})
        ready, _, _ = select.select([stdin], [], [], 0.01 if running else None)
        if not ready:
            continue
        data = os.read(stdin, 1 << 16)
        if not data:  # the tests ended: so does the server (what still runs is theirs to end)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if os_threads() != 1:
                sys.exit(3)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            running[pid] = request["id"]
            _reply({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    main()
