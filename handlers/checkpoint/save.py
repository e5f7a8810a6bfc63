"""One save in flight (:class:`Save`: where it goes, the futures that say when it is staged and
durable, this rank's manifest entries) and the small pieces the writer builds it from: futures
already done or done when several are, and this rank's state file written durably."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hookloop.engine import parallel
from hookloop.engine.checkpoint_format.durable_files import write_durable
from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.manifest import RecordingWriter, manifest_entry
from hookloop.handlers.checkpoint.rank_file import MAX_BYTES

__all__ = ["Save", "all_of", "done_future", "write_rank_file"]


@dataclass(eq=False)
class Save:
    """One save in flight: where it goes, the futures that tell when it is staged/durable, and this
    rank's manifest entries (its state JSON's from ``rank_file``, its DCP files' in
    ``writer.entries`` once done)."""

    step: int
    partial: str
    final: str
    done: Future
    staged: Future | None
    writer: RecordingWriter | None = None
    rank_file: Future | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    index_size: int = 0  # of the published index (.metadata), in bytes: once published

    @property
    def finite(self) -> bool | None:
        """Whether this rank's saved parameters and optimizer state hold no NaN/Inf (checked by its
        DCP writer, beside the write); only once ``done`` has resolved without error."""
        return self.writer.finite if self.writer is not None else None

    @property
    def entries(self) -> dict[str, Any]:
        """This rank's manifest entries; only once ``done`` has resolved without error."""
        own = self.rank_file.result() if self.rank_file is not None else {}
        return {**own, **(self.writer.entries if self.writer is not None else {})}


def done_future(result: Any = None) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


def all_of(futures: list[Future]) -> Future:
    """One future for several: None once all of them are done, or the first failure among them."""
    combined: Future = Future()
    lock = threading.Lock()

    def check(_: Future) -> None:
        with lock:
            if combined.done() or not all(f.done() for f in futures):
                return
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            if failed is None:
                combined.set_result(None)
            else:
                combined.set_exception(failed)

    for future in futures:
        future.add_done_callback(check)
    return combined


def write_rank_file(partial: str, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Write this rank's state JSON durably into ``partial`` (fsynced; its name is made durable
    with the directory when the save is published); its manifest entries. A file larger than a
    resume reads (:data:`rank_file.MAX_BYTES`) fails the save."""
    data = json.dumps(extra).encode("utf-8")
    if len(data) > MAX_BYTES:
        raise CheckpointError(
            f"the state of rank {parallel.rank()} takes {len(data)} bytes, more than the "
            f"{MAX_BYTES} a resume reads: a handler's state_dict() holds too much (keep large tensors "
            "in the model, or in the handler's tensor_state_dict(), which goes through DCP)"
        )
    size, crc = write_durable(os.path.join(partial, name), data)
    return {name: manifest_entry(size, crc, parallel.rank())}
