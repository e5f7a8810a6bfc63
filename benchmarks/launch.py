"""Run a function on several gloo ranks: torchrun's environment, a hard timeout, and every process
killed on the way out. The benchmarks use it, and the tests start their ranks through it too."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous port of one run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives ``rank`` of ``world_size`` (rendezvous on ``port``)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }


def _rank_main(
    fn: Callable, rank: int, world_size: int, port: int, env: dict, args: tuple, results: Any
) -> None:
    os.environ.update({**rank_env(rank, world_size, port), **env})
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # the parent reports it; this rank leaves
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, env: dict | None = None
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (one thread each, ``env``
    added to their environment) that join one process group from the torchrun environment; each
    rank's result, in rank order. ``fn`` must be importable by name (a module-level function).
    Raises when a rank fails or the run takes longer than ``timeout`` seconds; no process outlives
    the call."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, env or {}, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout  # for the run as a whole, not for each rank's result
    try:
        while len(done) < world_size:
            try:
                rank, status, payload = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise TimeoutError(
                    f"ranks did not finish within {timeout:.0f}s (done: {sorted(done)})"
                ) from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            done[rank] = payload
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [done[r] for r in range(world_size)]
