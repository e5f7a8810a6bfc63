"""The ranks of one multi-process test run, forked from one process that imported their code once.

``python -m tests.scripts.fork_ranks SPEC`` (``tests/dist_utils.py`` writes SPEC and runs this
command through the fork server, ``tests/forked.py``). SPEC is a pickle of a dict:

- ``world_size``, ``port`` (the rendezvous port), ``env`` (added to each rank's environment), and
- either ``fn`` and ``args``: ``fn(rank, world_size, *args)`` on every rank, as
  ``benchmarks.launch.run_ranks`` runs it (one thread, torchrun's variables); each rank pickles
  ``("ok", result)`` or ``("error", traceback)`` to ``<SPEC>.rank<r>``; the first rank that fails
  ends the others at once (SIGKILL);
- or ``argv``: ``python ARGV`` on every rank with the environment torchrun gives its workers (its
  agent's store hosted here, on ``port``, as torchrun's agent hosts it); the first rank that fails
  ends the others as torchrun does (SIGTERM :data:`SETTLE_S` later, SIGKILL 30 s after that), and
  this command exits 1 naming each failed rank's exit code.

A rank is still a process of its own (its own pid, environment, gloo connections and exit status),
but it did not import torch, the engine and the test's own module again: that import was about 8 s
of CPU per rank, most of a short multi-process test. What must see a fresh interpreter or torchrun
itself (its agent's output, restarts, several nodes) runs torchrun (``run_torchrun(...,
launcher="torchrun")``).

Nothing here starts a thread before the last fork: the command exits 3 if importing the ranks' code
started one (a fork of a process that runs other threads can leave the child holding a lock no
thread releases).
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import time
import traceback
import uuid
from typing import NoReturn

from benchmarks.launch import rank_env
from tests.scripts.fork_server import exit_now, os_threads, run_as_python

# What every `argv` rank imports anyway (the fork server imported torch and ignite already).
PRELOAD = ("hookloop.engine", "hookloop.handlers", "hookloop.cli")
GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL of the ranks left
#: How long the others may still exit on their own after the first failure before their SIGTERM
#: (torchrun sees a failure at its next poll, every 0.1 s; ranks that fail together, each with its
#: own refusal, must not be cut short by that race).
SETTLE_S = 1.0


def _rank_env(spec: dict, rank: int, run_id: str) -> dict[str, str]:
    n = spec["world_size"]
    env = rank_env(rank, n, spec["port"])
    if "argv" in spec:  # the rest of what torchrun's agent sets for a one-node launch
        env.update(
            GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default", ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(n), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_USE_AGENT_STORE="True",
        )  # fmt: skip
    return {**env, **spec["env"]}


def _write(path: str, value: object) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)


def _run_fn(spec: dict, rank: int, out: str) -> int:
    import torch

    torch.set_num_threads(1)
    try:
        result = ("ok", spec["fn"](rank, spec["world_size"], *spec["args"]))
    except BaseException:
        result = ("error", traceback.format_exc())
    try:
        _write(out, result)
    except Exception:  # a result that does not pickle is this rank's failure
        _write(out, ("error", traceback.format_exc()))
        result = ("error", "")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result[0] == "ok" else 1


def _rank(spec: dict, spec_path: str, rank: int, run_id: str) -> NoReturn:
    """Become rank ``rank`` and exit with its status."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(_rank_env(spec, rank, run_id))
        if "argv" in spec:
            argv = spec["argv"]
            module = argv[0] == "-m"
            sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
            code = run_as_python(argv)
        else:
            code = _run_fn(spec, rank, f"{spec_path}.rank{rank}")
    except BaseException:
        traceback.print_exc()
    exit_now(code)


def _signal(pids: dict[int, int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main(spec_path: str) -> int:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)  # imports the module of `fn`
    launch = "argv" in spec
    if launch:
        for name in PRELOAD:
            importlib.import_module(name)
    if os_threads() != 1:
        print(f"fork_ranks: importing the ranks' code started {os_threads() - 1} thread(s)", file=sys.stderr)
        return 3
    run_id = uuid.uuid4().hex[:12]
    sys.stdout.flush()
    sys.stderr.flush()
    running: dict[int, int] = {}
    for rank in range(spec["world_size"]):
        pid = os.fork()
        if pid == 0:
            _rank(spec, spec_path, rank, run_id)
        running[pid] = rank
    store = None
    if launch:  # torchrun's agent hosts the store its workers rendezvous on (TORCHELASTIC_USE_AGENT_STORE)
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", spec["port"], spec["world_size"], is_master=True,
            timeout=timedelta(seconds=900), wait_for_workers=False,
        )  # fmt: skip
    failed: dict[int, int] = {}
    term_at = kill_at = None
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if term_at is not None and now >= term_at:
                _signal(running, signal.SIGTERM)
                term_at, kill_at = None, now + GRACE_S
            if kill_at is not None and now >= kill_at:
                _signal(running, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.02)
            continue
        code = os.waitstatus_to_exitcode(status)
        rank = running.pop(pid)
        if code != 0:
            failed[rank] = code
            if term_at is None and kill_at is None:  # the first failure ends the others
                if launch:  # after ranks failing with it (a refusal every rank makes) report their own
                    term_at = time.monotonic() + SETTLE_S
                else:
                    _signal(running, signal.SIGKILL)
                    kill_at = float("inf")
    del store
    for rank, code in sorted(failed.items()):
        print(f"fork_ranks: rank {rank} exited with code {code}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
