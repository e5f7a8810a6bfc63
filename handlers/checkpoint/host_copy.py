"""A ``mode="async"`` save of plain CPU tensors: written from the live state, copied only on demand.

Parameters and optimizer state change only at the next optimizer step, so the writer thread writes
each tensor straight from the live state (to the disk directly for large tensors, else into the
page cache) while the next step's forward and backward run. At the staging wait, right before the
optimizer step, whatever the writer has not reached yet is copied to host buffers in the training
thread (claimed one tensor at a time, so the writer goes on with the next live one meanwhile) and
written from there; training then waits only until the tensor the writer is on is written. A save
thus costs at most one copy of each byte in memory instead of two, and host memory only for what a
short step leaves unwritten (the buffers are kept from one save to the next). The NaN/Inf check
sums each tensor as it is handed to the writer, before the optimizer can change it.

A state with any other tensor (CUDA, sharded) goes through DCP's stager, copy first
(:func:`stage_then_save`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hookloop.engine.checkpoint_format.errors import CheckpointError
from hookloop.engine.checkpoint_format.manifest import finite_or_none
from hookloop.handlers.checkpoint.dcp_calls import SavePlanner, quiet_single_process

__all__ = ["HostCopy", "stage_then_save"]

_PENDING, _LIVE, _COPYING, _COPIED, _FAILED, _NOT_WRITTEN = range(6)


def _plain(value: Any) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.device.type == "cpu"


def _walk(value: Any, path: tuple = ()) -> tuple[Any, list[tuple[tuple, torch.Tensor]]] | None:
    """``(detached, pairs)``: ``value`` with its tensors as they are and deep copies of everything
    else (a scheduler may change a learning rate before the writer gets to it), and ``[(path,
    tensor)]`` of every tensor in it; None when a tensor is not a plain CPU tensor."""
    if isinstance(value, torch.Tensor):
        return (value, [(path, value)]) if _plain(value) else None
    if not isinstance(value, (dict, list)):
        return copy.deepcopy(value), []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    detached: dict[Any, Any] = {}
    pairs: list[tuple[tuple, torch.Tensor]] = []
    for key, child in items:
        walked = _walk(child, (*path, key))
        if walked is None:
            return None
        detached[key] = walked[0]
        pairs += walked[1]
    return (detached if isinstance(value, dict) else list(detached.values())), pairs


class _Item:
    __slots__ = ("path", "tensor", "state", "copy")

    def __init__(self, path: tuple, tensor: torch.Tensor) -> None:
        self.path, self.tensor, self.state = path, tensor, _PENDING
        self.copy: torch.Tensor | None = None


class _LiveSave:
    """Who reads each tensor of one save: the writer (live) or the training thread's copy."""

    def __init__(self, pairs: list[tuple[tuple, torch.Tensor]], staged: Future) -> None:
        self.items = {id(tensor): _Item(path, tensor) for path, tensor in pairs}
        self.staged = staged
        self.cond = threading.Condition()
        self.in_use: _Item | None = None  # the live tensor the writer is writing
        self.finished = False  # the writer reads no live tensor any more
        self.checked: set[str] = set()
        self.finite: bool | None = True

    def take(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """Writer thread: the tensor to write for ``tensor`` (the live one, or its copy)."""
        with self.cond:
            self.in_use = None  # DCP writes one tensor at a time: the previous one is written
            self.cond.notify_all()
            item = self.items.get(id(tensor))
            if item is None:
                return tensor
            while item.state == _COPYING:
                self.cond.wait()
            if item.state == _FAILED:
                raise CheckpointError("the host copy of the state failed; the save is abandoned")
            if item.state == _PENDING:
                item.state, self.in_use = _LIVE, item
            chosen = item.copy if item.state == _COPIED else tensor
        if fqn in self.checked and self.finite:  # before the optimizer may change it
            self.finite = finite_or_none({fqn: chosen}, (fqn,))
        return chosen

    def only(self, planned: set[int]) -> None:
        """Writer thread, once DCP planned the save: tensors this rank does not write (another rank
        writes a replicated one) are never read, so never copied either."""
        with self.cond:
            for key, item in self.items.items():
                if key not in planned and item.state == _PENDING:
                    item.state = _NOT_WRITTEN

    def written(self) -> None:
        """Writer thread: a file is written; staged once no tensor is left to read live."""
        with self.cond:
            self.in_use = None
            self.cond.notify_all()
            if any(item.state == _PENDING for item in self.items.values()):
                return
            self.finished = True
        self._resolve()

    def finish(self) -> None:
        """Writer thread, whatever happened: no live tensor is read from now on."""
        with self.cond:
            self.in_use, self.finished = None, True
            self.cond.notify_all()
        self._resolve()

    def freeze(self, buffers: dict[tuple, torch.Tensor], timeout: float) -> None:
        """Training thread: copy what the writer has not reached (into ``buffers``, reused and
        filled), then wait until the writer is done with the live tensor it is on."""
        todo = [item for item in reversed(list(self.items.values())) if item.state == _PENDING]
        try:
            with torch.no_grad():
                for item in todo:
                    with self.cond:
                        if item.state != _PENDING:
                            continue
                        item.state = _COPYING
                    try:
                        buffer = buffers.get(item.path)
                        if (
                            buffer is None
                            or buffer.shape != item.tensor.shape
                            or buffer.dtype != item.tensor.dtype
                        ):
                            buffer = buffers[item.path] = torch.empty_like(
                                item.tensor, memory_format=torch.contiguous_format
                            )
                        buffer.copy_(item.tensor)
                    except BaseException:
                        with self.cond:
                            item.state = _FAILED
                            self.cond.notify_all()
                        raise
                    with self.cond:
                        item.copy, item.state = buffer, _COPIED
                        self.cond.notify_all()
            with self.cond:
                if not self.cond.wait_for(lambda: self.in_use is None or self.finished, timeout):
                    raise CheckpointError(
                        f"the checkpoint writer did not finish writing a tensor within {timeout:.0f}s "
                        "(wait_timeout_s)"
                    )
        except BaseException as e:
            if not self.staged.done():
                self.staged.set_exception(e)
            raise
        self._resolve()

    def _resolve(self) -> None:
        with self.cond:
            if not self.staged.done():
                self.staged.set_result(None)


class _LivePlanner(SavePlanner):
    """DCP's planner that hands the writer each tensor live or as copied (see :class:`_LiveSave`),
    checking it for NaN/Inf first (``check_inline``, called by the checkpoint's writer)."""

    def __init__(self, live: _LiveSave) -> None:
        super().__init__()
        self.live = live

    def lookup_object(self, index: Any) -> Any:
        value = super().lookup_object(index)
        if isinstance(value, torch.Tensor):
            return self.live.take(index.fqn, value)
        return value

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        state = self.state_dict
        self.live.only({id(state[item.index.fqn]) for item in plan.items if item.index.fqn in state})
        return plan

    def check_inline(self, names: set[str]) -> None:
        self.live.checked = set(names)

    @property
    def finite(self) -> bool | None:
        return self.live.finite

    def written(self) -> None:
        self.live.written()


class HostCopy:
    """The live writes of ``mode="async"`` saves and the host buffers they copy into on demand
    (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._live: _LiveSave | None = None

    def begin(self, state_dict: dict[str, Any], staged: Future) -> dict[str, Any] | None:
        """Training thread, at the save: the state dict to write live (tensors as they are, other
        values copied), or None when a tensor is not a plain CPU tensor (stage with DCP instead)."""
        walked = _walk(state_dict)
        if walked is None:
            self._live = None
            return None
        detached, pairs = walked
        self._live = _LiveSave(pairs, staged)
        return detached

    def save(self, state_dict: dict[str, Any], kwargs: dict[str, Any]) -> None:
        """Writer thread: write ``state_dict`` (from :meth:`begin`) with DCP (``kwargs``: ``dcp.save``'s)."""
        live = self._live
        try:
            with quiet_single_process():
                dcp.save(state_dict, planner=_LivePlanner(live), **kwargs)
        finally:
            live.finish()

    def freeze(self, timeout: float) -> None:
        """Training thread, before the optimizer step: copy what the save in flight has not written
        yet; return once no live tensor is read any more."""
        live = self._live
        if live is not None and not live.staged.done():
            live.freeze(self._buffers, timeout)

    def close(self) -> None:
        """Release the buffers (no save may be in flight)."""
        self._buffers, self._live = {}, None


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
