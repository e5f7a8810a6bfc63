"""What one rank's failure tells the others, so every rank names the error that ended the run.

A rank whose run fails with an error of its own (a handler's exception, an out-of-memory error, a
second Ctrl-C) records it under ``hookloop/failed/<rank>`` in the process group's store, a channel no
collective uses, before it leaves. A rank whose collective then fails because that peer is gone
reads the record (:func:`crashed_peer`) and fails as that crash, naming the rank and the error, with
the failed rank's exit code (1 for an exception), instead of as a lost peer (77, which a job script
requeues): only a peer that vanished or went silent without a word is 77.

Without a process group of more than one rank nothing is recorded or read. Each store operation
is bounded (a store hosted by a stopped process does not answer); a rank clears its own record when
a run starts, so a record of an earlier attempt never names a new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.errors import PeerCrashed, exit_code_of

__all__ = ["PREFIX", "clear_failure", "crashed_peer", "record_failure"]

PREFIX = "hookloop/failed/"
#: How long one store operation may take before the record is given up.
STORE_TIMEOUT_S = 5.0


def _bounded(operation: Callable[[Any], Any]) -> Any:
    """``operation(store)``, at most :data:`STORE_TIMEOUT_S`; None without a store, on an error or
    when the store does not answer."""
    store = parallel.process_group_store() if parallel.world_size() > 1 else None
    if store is None:
        return None
    return parallel.bounded_call(lambda: operation(store), STORE_TIMEOUT_S, "hookloop-failure-record")


def record_failure(error: BaseException, where: str = "") -> None:
    """Tell the other ranks that this rank's run fails with ``error`` (``where``: e.g. the event)."""
    message = str(error).splitlines()[0][:300] if str(error) else ""
    record = {
        "rank": parallel.rank(),
        "error": f"{type(error).__name__}: {message}" if message else type(error).__name__,
        "where": where,
        "exit_code": exit_code_of(error),
    }
    key = f"{PREFIX}{parallel.rank()}"
    _bounded(lambda store: store.set(key, json.dumps(record)))


def clear_failure() -> None:
    """Forget this rank's record of an earlier run (a run starts)."""
    key = f"{PREFIX}{parallel.rank()}"
    _bounded(lambda store: store.delete_key(key) if store.check([key]) else None)


def crashed_peer(cause: BaseException) -> PeerCrashed | None:
    """The error of the lowest rank that recorded one, as a :class:`PeerCrashed` (``cause``: this
    rank's failed collective, for the message), or None when no peer recorded one."""
    keys = [f"{PREFIX}{rank}" for rank in range(parallel.world_size()) if rank != parallel.rank()]

    def read(store: Any) -> dict | None:
        for key in keys:
            if store.check([key]):
                return json.loads(store.get(key))
        return None

    record = _bounded(read)
    if not record:
        return None
    where = f" in {record['where']}" if record.get("where") else ""
    return PeerCrashed(
        f"rank {record['rank']} failed{where}: {record['error']} (this rank's collective then failed: "
        f"{str(cause).splitlines()[0][:200]})",
        rank=int(record["rank"]),
        exit_code=int(record.get("exit_code", 1)),
    )
