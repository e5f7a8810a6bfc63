"""The host copy of a ``mode="async"`` save, written while it is still being made.

From the second save on, the host buffers of the state exist already (one per tensor, kept from
one save to the next): the writer thread copies the tensors into them one by one while DCP, on a
thread of its own, writes each one as soon as its copy is done. The copy then costs the save's
durable time only what it takes beyond the write: on 2 cores, copying 200 MB first and writing it
after took the copy's 40-60 ms longer. Training still waits for the whole copy only (``staged``).

Only for a state whose tensors are plain CPU tensors (the first save, a CUDA or sharded tensor, or a
changed layout go through DCP's stager, copy first, as before).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hookloop.engine.intra_op import use_one_intra_op_thread
from hookloop.handlers.checkpoint.dcp_calls import quiet_single_process

__all__ = ["HostCopy", "stage_then_save"]


def _plain(value: Any) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.device.type == "cpu"


class _WaitingPlanner(DefaultSavePlanner):
    """DCP's planner that hands a tensor to the writer only once its copy is done."""

    def __init__(self, copied: dict[int, threading.Event], all_copied: threading.Event) -> None:
        super().__init__()
        self.copied, self.all_copied = copied, all_copied

    def resolve_data(self, write_item: Any) -> Any:
        # An item this save did not copy by name (not one of its buffers) waits for every copy:
        # nothing is handed to the writer before the state it holds was copied.
        event = self.copied.get(id(self.state_dict.get(write_item.index.fqn)))
        (event or self.all_copied).wait()
        return super().resolve_data(write_item)

    def wait_copied(self) -> None:
        """Wait until every tensor is copied (the NaN/Inf check reads them all)."""
        self.all_copied.wait()


class HostCopy:
    """The host buffers of ``mode="async"`` saves, and saving through them (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._writer: ThreadPoolExecutor | None = None

    def _pairs(self, value: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]] | None:
        """``[(path, tensor)]`` of every tensor in ``value``; None when one is not a plain CPU tensor."""
        if isinstance(value, torch.Tensor):
            return [(path, value)] if _plain(value) else None
        found: list[tuple[tuple, torch.Tensor]] = []
        items: Any = ()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        for key, child in items:
            more = self._pairs(child, (*path, key))
            if more is None:
                return None
            found += more
        return found

    def _fits(self, pairs: list[tuple[tuple, torch.Tensor]]) -> bool:
        if len(pairs) != len(self._buffers):
            return False
        for path, tensor in pairs:
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                return False
        return True

    def save(
        self, state_dict: dict[str, Any], staged: Future, stage: Callable[[dict[str, Any]], Any], kwargs: dict
    ) -> None:
        """On the writer thread: copy ``state_dict`` to host memory and resolve ``staged`` once it is
        copied, and write the copy with DCP (``kwargs``: ``dcp.save``'s); overlapped when the buffers
        of an earlier save fit, else through ``stage`` (DCP's stager) first."""
        pairs = self._pairs(state_dict)
        if pairs is None or not self._fits(pairs):
            self._keep(stage_then_save(stage, state_dict, staged, kwargs))
            return
        copied = {id(self._buffers[path]): threading.Event() for path, _ in pairs}
        all_copied = threading.Event()
        host = self._host(state_dict, ())
        written = self._writer_thread().submit(_save, host, _WaitingPlanner(copied, all_copied), kwargs)
        error: BaseException | None = None
        try:
            with torch.no_grad():
                for path, tensor in pairs:
                    buffer = self._buffers[path]
                    buffer.copy_(tensor)
                    copied[id(buffer)].set()
        except BaseException as e:  # noqa: BLE001 - raised below, once the write stopped
            error = e
        finally:
            for event in copied.values():
                event.set()
            all_copied.set()
        if error is not None:  # nothing may write into the save's directory once it failed
            staged.set_exception(error)
            with contextlib.suppress(BaseException):
                written.result()
            self._buffers = {}
            raise error
        staged.set_result(None)
        written.result()

    def _keep(self, host: Any) -> None:
        pairs = self._pairs(host)
        self._buffers = dict(pairs) if pairs is not None else {}

    def _host(self, value: Any, path: tuple) -> Any:
        """``value`` with the buffers in place of its tensors, and deep copies of everything else."""
        if isinstance(value, torch.Tensor):
            return self._buffers[path]
        if isinstance(value, dict):
            return {key: self._host(child, (*path, key)) for key, child in value.items()}
        if isinstance(value, list):
            return [self._host(child, (*path, i)) for i, child in enumerate(value)]
        return copy.deepcopy(value)

    def _writer_thread(self) -> ThreadPoolExecutor:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(
                1, thread_name_prefix="hookloop-checkpoint-dcp", initializer=use_one_intra_op_thread
            )
        return self._writer

    def close(self) -> None:
        """Stop the DCP thread and release the buffers (no save may be in flight)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._buffers = {}


def stage_then_save(
    stage: Callable[[dict[str, Any]], Any], state_dict: dict[str, Any], staged: Future, kwargs: dict[str, Any]
) -> Any:
    """Copy ``state_dict`` to host memory with ``stage`` (DCP's stager), resolve ``staged`` once it is
    copied (from then on training may change the state), then write the copy with DCP (``kwargs``:
    ``dcp.save``'s); the copy."""
    try:
        with torch.no_grad():
            host = stage(state_dict)
    except BaseException as e:
        staged.set_exception(e)
        raise
    staged.set_result(None)
    with quiet_single_process():
        dcp.save(host, **kwargs)
    return host


def _save(host: dict[str, Any], planner: _WaitingPlanner, kwargs: dict[str, Any]) -> None:
    with quiet_single_process():
        dcp.save(host, planner=planner, **kwargs)
