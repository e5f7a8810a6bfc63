"""Start real multi-process (gloo) runs from tests, always with a hard timeout and cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.launch import free_port, rank_env, run_ranks

REPO = Path(__file__).resolve().parents[1]


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, env: dict | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined into one
    process group by the usual torchrun environment. Returns each rank's result, in rank order.
    Raises if a rank fails or the whole run exceeds ``timeout`` (every process is killed)."""
    return run_ranks(fn, world_size, *args, timeout=timeout, env=env)


def run_torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float = 180.0,
    env: dict | None = None,
    cwd: str | Path | None = None,
    module: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``script`` (with ``module``: the module of that name, ``-m script``) under ``torchrun
    --nproc-per-node nproc``; kill the whole process group on timeout. Returns the completed
    process (check ``returncode``, ``stdout``, ``stderr``)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        *(["-m"] if module else []),
        str(script),
        *args,
    ]
    return run_process(cmd, timeout=timeout, env=env, cwd=cwd)


def run_process(
    cmd: Sequence[str], *, timeout: float = 180.0, env: dict | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the group and raise TimeoutError."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd or REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(
            f"{cmd} did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
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


def start_ranks(cmd: Sequence[str], world_size: int, *, env: dict | None = None) -> list[subprocess.Popen]:
    """Start ``cmd`` once per rank with torchrun's environment (one process group on a free port),
    each in its own session so :func:`kill_ranks` can end it; each rank's own exit code is seen."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        full_env = {**os.environ, **rank_env(rank, world_size, port), "PYTHONPATH": str(REPO), **(env or {})}
        procs.append(
            subprocess.Popen(
                list(cmd),
                cwd=REPO,
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def kill_ranks(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every process still running (and its session), and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
