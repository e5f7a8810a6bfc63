"""Start real multi-process (gloo) runs from tests, always with a hard timeout and cleanup."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.launch import free_port, rank_env
from tests.forked import descendants, finish, forkable, kill_tree, reap, run_forked, start_forked

REPO = Path(__file__).resolve().parents[1]
#: The hard timeout (seconds) of a test's multi-process run (:func:`run_distributed`,
#: :func:`run_torchrun`), for the run as a whole. On the 2-core CI machine at load 17-20 a 2-rank
#: pipeline resume run once took 180-195 s (each rank then imported torch and the engine itself,
#: about 9 s of CPU; forked ranks no longer do): the 150 s several tests gave failed runs that were
#: only slow. The suite's per-test bound (setup.cfg, 600 s) stays above it: a hung run still fails
#: here, its ranks killed.
RUN_TIMEOUT = 450.0


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = RUN_TIMEOUT, env: dict | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks joined into one process group by
    the usual torchrun environment (``benchmarks.launch.run_ranks``'s contract: one thread each, a
    module-level ``fn``, picklable arguments and results). The ranks are forks of one process that
    imported ``fn``'s module once (``tests/scripts/fork_ranks.py``). Returns each rank's result, in
    rank order. Raises if a rank fails or the whole run exceeds ``timeout`` (every process is killed)."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        spec = Path(tmp) / "spec"
        ranks = {"world_size": world_size, "port": free_port(), "env": env or {}, "fn": fn, "args": args}
        spec.write_bytes(pickle.dumps(ranks))
        proc = _fork_ranks(spec, timeout)
        results = []
        for rank in range(world_size):
            out = Path(f"{spec}.rank{rank}")
            status, payload = pickle.loads(out.read_bytes()) if out.exists() else (None, None)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}\n{_tail(proc)}")
            results.append(payload)
        if proc.returncode != 0 or len(results) < world_size:
            raise RuntimeError(f"the ranks failed (exit {proc.returncode}):\n{_tail(proc)}")
    return results


def rank_exit_codes(stderr: str) -> list[int]:
    """The exit codes of the failed ranks a launch lists: torchrun's ``exitcode  : N`` lines or
    ``fork_ranks: rank R exited with code N`` (the forked launcher, :func:`run_torchrun`)."""
    return [int(c) for c in re.findall(r"(?:exitcode\s*:\s*|rank \d+ exited with code )(-?\d+)", stderr)]


def _tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"stdout:\n{proc.stdout[-n:]}\nstderr:\n{proc.stderr[-n:]}"


def _fork_ranks(spec: Path, timeout: float, cwd: str | Path | None = None, env: dict | None = None):
    proc = run_process(
        [sys.executable, "-m", "tests.scripts.fork_ranks", str(spec)], timeout=timeout, cwd=cwd, env=env
    )
    sys.stdout.write(proc.stdout)  # the ranks' output, shown with a failing test's report
    sys.stderr.write(proc.stderr)
    return proc


def run_torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float = RUN_TIMEOUT,
    env: dict | None = None,
    cwd: str | Path | None = None,
    module: bool = False,
    launcher: str = "forked",
) -> subprocess.CompletedProcess:
    """Run ``script`` (with ``module``: the module of that name, ``-m script``) on ``nproc`` ranks
    with the environment ``torchrun --nproc-per-node nproc`` gives them; kill every process on
    timeout. Returns the completed launch (check ``returncode``, ``stdout``, ``stderr``).

    ``launcher="forked"`` (the default) starts the ranks as forks of one process that imported the
    engine once (``tests/scripts/fork_ranks.py``: torchrun's environment and agent store, its way of
    ending the other ranks when one fails; exit 1 when a rank failed). ``launcher="torchrun"`` runs
    torchrun itself: for what its agent does (its own output, exit codes, signals it forwards)."""
    target = ["-m", str(script)] if module else [str(script)]
    if launcher == "torchrun":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *target, *args,
        ]  # fmt: skip
        return run_process(cmd, timeout=timeout, env=env, cwd=cwd)
    if launcher != "forked":
        raise ValueError(f"launcher={launcher!r}: use 'forked' or 'torchrun'")
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        spec = Path(tmp) / "spec"
        argv = [*target, *map(str, args)]
        spec.write_bytes(pickle.dumps({"world_size": nproc, "port": free_port(), "env": {}, "argv": argv}))
        return _fork_ranks(spec, timeout, cwd=cwd, env=env)


def run_process(
    cmd: Sequence[str],
    *,
    timeout: float = 180.0,
    env: dict | None = None,
    cwd: str | Path | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; on timeout kill it and raise TimeoutError. A ``python``
    command runs as a fork of a server that imported torch once (``tests/forked.py``) unless
    ``fresh``: what must see a new interpreter (import-time settings and claims) asks for one. A
    None in ``env`` leaves that variable out (``OMP_NUM_THREADS`` is 1 unless ``env`` says)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    if not fresh and forkable(cmd):
        return run_forked(cmd, cwd=cwd or REPO, env=full_env, timeout=timeout)
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd or REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = finish(proc, timeout, cmd)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def full_snapshot(trainer: Any) -> dict:
    """Every parameter and optimizer-state tensor of ``trainer``, gathered to full tensors (also
    under FSDP2), keyed ``p.<name>`` and ``o.<param>.<state>``: what bitwise comparisons use."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    out = {f"p.{k}": v.clone() for k, v in msd.items()}
    for fqn, s in osd["state"].items():
        out.update({f"o.{fqn}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


def to_numpy(d: dict) -> dict:
    """Tensors as numpy arrays, to return from a spawned rank (tensors would travel through shared
    memory the finished worker takes away)."""
    return {k: v.numpy().copy() for k, v in d.items()}


def from_numpy(d: dict) -> dict:
    import torch

    return {k: torch.from_numpy(v) for k, v in d.items()}


def start_ranks(cmd: Sequence[str], world_size: int, *, env: dict | None = None) -> list[Any]:
    """Start ``cmd`` once per rank with torchrun's environment (one process group on a free port),
    each in its own session so :func:`kill_ranks` can end it; each rank's own exit code is seen. A
    ``python`` command's ranks are forks of the fork server (``tests/forked.py``; ``subprocess.Popen``'s
    ``pid``, ``poll``, ``wait``, ``communicate`` and ``returncode``)."""
    port = free_port()
    procs: list[Any] = []
    try:
        for rank in range(world_size):
            full_env = {**os.environ, **rank_env(rank, world_size, port), "PYTHONPATH": str(REPO)}
            full_env.update(env or {})
            if forkable(cmd):
                procs.append(start_forked(cmd, cwd=REPO, env=full_env))
                continue
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    cwd=REPO,
                    env=full_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )  # fmt: skip
            )
    except BaseException:
        kill_ranks(procs)
        raise
    return procs


def kill_ranks(procs: Sequence[Any]) -> None:
    """SIGKILL every process still running (its session and descendants), and reap it."""
    for p in procs:
        if p.poll() is None:
            reap(p)


_NODES_MARK = "HOOKLOOP_TEST_NODES"


def marked_processes(name: str, value: str) -> list[int]:
    """Every process whose environment holds ``name=value``."""
    mark = f"{name}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


class TorchrunNodes:
    """``nnodes`` torchrun launchers on this machine, each a simulated node of one c10d rendezvous
    (a free port, a rendezvous id of its own): ``torchrun --nnodes N --nproc-per-node P
    --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID``. Node 0 hosts the rendezvous
    store (``is_host``), as the first node of a real job does. Each launcher runs in a session of its
    own and writes ``node<i>.out`` / ``node<i>.err`` in ``log_dir`` (no pipe to fill up). Use it as a
    context manager: on the way out every launcher and every worker is killed, whatever happened."""

    def __init__(
        self,
        script: str | Path,
        nnodes: int,
        nproc: int,
        args: Sequence[str] = (),
        *,
        log_dir: str | Path,
        module: bool = False,
        env: dict | None = None,
        launcher_args: Sequence[str] = (),
    ) -> None:
        import uuid

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.rdzv_id = f"test-{uuid.uuid4().hex[:12]}"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
        full_env[_NODES_MARK] = self.rdzv_id  # inherited by every worker: how close() finds them all
        self.procs: list[subprocess.Popen] = []
        self._files = []
        try:
            for node in range(nnodes):
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                    f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id={self.rdzv_id}", f"--rdzv-conf=is_host={int(node == 0)}", *launcher_args,
                    *(["-m"] if module else []), str(script), *args,
                ]  # fmt: skip
                out = open(self.log_dir / f"node{node}.out", "w")  # noqa: SIM115 -- closed in close()
                err = open(self.log_dir / f"node{node}.err", "w")  # noqa: SIM115
                self._files += [out, err]
                self.procs.append(
                    subprocess.Popen(
                        cmd, cwd=REPO, env=full_env, stdout=out, stderr=err, start_new_session=True
                    )
                )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TorchrunNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def workers(self, node: int) -> list[int]:
        """The worker processes node ``node``'s launcher runs now."""
        return descendants(self.procs[node].pid)

    def ranks(self, node: int) -> list[int]:
        """The global ranks (``RANK``) of node ``node``'s workers, read from their environment."""
        found = []
        for pid in self.workers(node):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            found += [int(v[5:]) for v in env if v.startswith(b"RANK=")]
        return sorted(found)

    def wait(self, timeout: float) -> list[int]:
        """Every launcher's exit status; TimeoutError (after killing everything) when one is still
        running ``timeout`` seconds from now."""
        import time

        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                raise TimeoutError(f"a node did not finish within {timeout}s\n{self.output()}") from None
        return [p.returncode for p in self.procs]

    def err(self, node: int) -> str:
        return (self.log_dir / f"node{node}.err").read_text(errors="replace")

    def out(self, node: int) -> str:
        return (self.log_dir / f"node{node}.out").read_text(errors="replace")

    def output(self, tail: int = 3000) -> str:
        """The end of every node's stderr, for assertion messages."""
        return "\n".join(f"--- node {n} stderr:\n{self.err(n)[-tail:]}" for n in range(len(self.procs)))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
        for pid in marked_processes(_NODES_MARK, self.rdzv_id):  # workers whose launcher is gone
            kill_tree(pid)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for f in self._files:
            f.close()
