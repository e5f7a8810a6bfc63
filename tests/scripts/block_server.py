"""Runs documentation blocks in forked children of an interpreter that imported torch once.

Started by ``tests/test_docs_snippets.py`` (one per test process). It imports the heavy third-party
modules every block pays for (torch, torch.distributed.checkpoint, ignite) and nothing of
hookloop's, so a block still runs its own ``import hookloop ...`` lines. Then, for each request
(one JSON line on stdin: ``code``, ``cwd``, ``env``, ``stdout``, ``stderr`` file paths), it forks a
child that becomes what ``python -c CODE`` would be: its own session, that directory and
environment, stdout and stderr to the files, ``sys.argv == ["-c"]``, a fresh ``__main__``; the
child's exit runs what interpreter shutdown runs (non-daemon threads joined, atexit callbacks).

Replies on stdout, one JSON line each: ``{"pid": N}`` when the child started, ``{"returncode": N}``
when it ended (``-signal`` if a signal ended it, as ``subprocess`` reports).

The server refuses to serve (exits 3 on the first request) if importing started a thread: forking
a process that runs other threads can leave the child holding a lock no thread will release.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import threading
import traceback
import types

import ignite.engine  # noqa: F401
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401


def _os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """Become ``python -c request["code"]`` and exit with its status; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is read again
        fds = [os.open(os.devnull, os.O_RDONLY)]
        fds += [
            os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for name in ("stdout", "stderr")
        ]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = ["-c"]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
            code = 1
        threading._shutdown()  # what interpreter shutdown does: join the non-daemon threads
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


def main() -> None:
    reply = sys.stdout
    for line in sys.stdin:
        if _os_threads() != 1:
            sys.exit(3)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
