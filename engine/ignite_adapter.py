"""Every place hookloop relies on ignite's internals, in one module.

The :class:`~engine.Trainer` is an ignite ``Engine`` and keeps ignite's run loop (``run``,
``terminate``, epochs, ``state_dict``, the timers). What it changes, it changes here, through
these private hooks of ``ignite.engine.Engine``:

- ``_fire_event``: the single dispatch hook; hookloop's own registry runs the handlers.
- ``_setup_dataloader_iter``: ignite creates an epoch's iterator here; hookloop groups the
  microbatches of ``state.dataloader`` into optimizer steps.
- ``_handle_exception``: where ignite routes errors; hookloop's one error path.
- ``_init_iter`` / ``_dataloader_iter``: the loop's position inside an epoch, set when a checkpoint
  puts the run back at a saved step.
- ``_allowed_events``: the events registered with ``register_events``.
- ``_event_handlers``: ignite's table of ``(handler, args, kwargs)`` lists by event, which ignite's
  time profilers read and edit (insert first/last, wrap in place). Here it is a live view of the
  registry, so what they do takes effect in hookloop's dispatch.
- ``_is_done``, ``_internal_run_generator``, ``_check_and_set_max_epochs`` /
  ``_check_and_set_max_iters``: whether a run is finished, and extending one (``run()`` continues
  an unfinished run, as ignite does).
- ``_internal_run`` / ``_internal_run_legacy``: ignite's loop over the current state. The trainer's
  ``run()`` sets the state up itself (:mod:`engine.run_limits`: ignite's rules plus a step and an
  epoch limit together) and starts the loop here.
- ``every_event_filter``'s closure: a plain ``every=N`` filter is read as the number N so the
  registry can skip whole runs of filtered-out handlers with one modulo.
- ``ignite.distributed.utils._model`` / ``_need_to_sync``: the computation model behind ``idist``,
  which every ignite metric reduces through (``sync_all_reduce``, ``idist.all_reduce`` /
  ``all_gather`` / ``broadcast``). :func:`ignite_world` points it at one process group for a block
  (validation: the data-parallel ranks) through ignite's public ``ComputationModel`` base.

``tests/test_ignite_contract.py`` pins each behaviour relied on; ``setup.cfg`` bounds
pytorch-ignite to the versions that test passes on (:data:`SUPPORTED_IGNITE`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, MutableMapping, MutableSequence
from typing import Any

import torch
import torch.distributed as dist
from ignite.distributed.comp_models.base import ComputationModel
from ignite.engine import Engine, Events
from ignite.engine.events import CallableEventWithFilter

__all__ = ["SUPPORTED_IGNITE", "IgniteAdapter", "base_event", "every_of", "ignite_world"]

SUPPORTED_IGNITE = ">=0.5.5,<0.6"


def every_of(event_filter: Callable | None) -> int | None:
    """N when ``event_filter`` is ignite's plain ``every=N`` filter, else None."""
    if event_filter is None or not getattr(event_filter, "__qualname__", "").endswith(
        "every_event_filter.<locals>.wrapper"
    ):
        return None
    cells = dict(zip(event_filter.__code__.co_freevars, event_filter.__closure__ or ()))
    every = cells["every"].cell_contents if "every" in cells else None
    return every if isinstance(every, int) and not isinstance(every, bool) and every > 0 else None


def base_event(event: CallableEventWithFilter) -> Any:
    """The registered event a filtered event (``Events.STEP_END(every=10)``) stands for.

    ignite compares events by name, so the filtered object finds its member in any registry."""
    return _EVENTS_BY_NAME.get(event.name, event)


_EVENTS_BY_NAME: dict[str, Any] = {}


def remember_events(*events: Any) -> None:
    """Record members so :func:`base_event` can map filtered events back to them."""
    for event in events:
        _EVENTS_BY_NAME.setdefault(event.name, event)


remember_events(*Events)


class HandlerList(MutableSequence):
    """One event's handlers as ignite lists them: ``(handler, args, kwargs)`` in firing order, where
    ``args`` starts with a weak reference to the engine when the handler takes it. Reading, editing
    in place, inserting and deleting act on the registry."""

    def __init__(self, engine: Any, event: Any) -> None:
        self._engine = engine
        self._event = base_event(event) if isinstance(event, CallableEventWithFilter) else event

    def _entries(self) -> list:
        return self._engine.events.entries(self._event)

    def _as_tuple(self, entry: Any) -> tuple:
        args = (weakref.ref(self._engine), *entry.args) if entry.pass_engine else entry.args
        return entry.func, args, entry.kwargs

    def _unpack(self, item: tuple) -> tuple:
        func, args, kwargs = item
        args = tuple(args)
        if args and isinstance(args[0], weakref.ref):  # ignite's mark of a handler given the engine
            return func, args[1:], kwargs, True
        return func, args, kwargs, False

    def __len__(self) -> int:
        return len(self._entries())

    def __getitem__(self, index: Any) -> Any:
        entries = self._entries()
        if isinstance(index, slice):
            return [self._as_tuple(e) for e in entries[index]]
        return self._as_tuple(entries[index])

    def __setitem__(self, index: Any, item: Any) -> None:
        if isinstance(index, slice):
            raise TypeError("assign ignite handler entries one index at a time")
        self._engine.events.replace_entry(self._entries()[index], *self._unpack(item))

    def __delitem__(self, index: Any) -> None:
        entries = self._entries()
        for entry in entries[index] if isinstance(index, slice) else [entries[index]]:
            self._engine.events.remove_entry(entry)

    def insert(self, index: int, item: Any) -> None:
        self._engine.events.insert_at(self._event, index, *self._unpack(item))

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, HandlerList)) else NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class HandlerTable(MutableMapping):
    """ignite's ``engine._event_handlers`` (a ``defaultdict(list)``) over the registry: any event
    gives its :class:`HandlerList`; iterating lists the events that have handlers."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getitem__(self, event: Any) -> HandlerList:
        return HandlerList(self._engine, event)

    def __setitem__(self, event: Any, handlers: Any) -> None:
        items = list(handlers)
        view = HandlerList(self._engine, event)
        del view[:]
        for item in items:
            view.append(item)

    def __delitem__(self, event: Any) -> None:
        del HandlerList(self._engine, event)[:]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._engine.events.events())

    def __len__(self) -> int:
        return len(self._engine.events.events())

    def __contains__(self, event: object) -> bool:
        return bool(self._engine.events.any_for(event))


class IgniteAdapter(Engine):
    """ignite's ``Engine`` with hookloop's dispatch, data grouping and error path plugged in.

    Subclasses provide ``events`` (an :class:`~engine.events.EventRegistry`), ``_step_iterator(data)``
    and ``error_path`` (an :class:`~engine.error_path.ErrorPath`).
    """

    events: Any
    watchdog: Any = None

    @property  # type: ignore[override]
    def _event_handlers(self) -> HandlerTable:
        return HandlerTable(self)

    @_event_handlers.setter
    def _event_handlers(self, _value: Any) -> None:
        pass  # ignite's constructor sets its own table; the registry holds the handlers

    def register_events(self, *event_names: Any, event_to_attr: dict | None = None) -> None:
        super().register_events(*event_names, event_to_attr=event_to_attr)
        remember_events(*(e for e in event_names if isinstance(e, CallableEventWithFilter)))

    def is_registered_event(self, event: Any) -> bool:
        return event in self._allowed_events

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # The hot path of every event: kept to one call into the registry.
        self.last_event_name = event_name
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.feed()
        self.events.fire(event_name, event_args, event_kwargs)

    #: Run an event's handlers (what ignite's loop does for its own events) and feed the progress
    #: watchdog: the public name of the dispatch hook.
    dispatch = _fire_event

    def _setup_dataloader_iter(self) -> None:
        self._dataloader_iter = self._step_iterator(self.state.dataloader)

    def _handle_exception(self, e: BaseException) -> None:
        self.error_path.on_error(e)  # handled (returns) or re-raised, see engine.error_path

    def position_loop(self, steps_in_epoch: int | None) -> None:
        """Re-enter the current epoch with ``steps_in_epoch`` steps already done in it (None: at the
        next epoch's start); the data iterator is created afresh from ``state.dataloader``."""
        self._init_iter = steps_in_epoch
        self._dataloader_iter = None

    #: Restart the live data iterator now (from ``state.dataloader`` and the data position).
    restart_data = _setup_dataloader_iter

    def start_loop(self, data: Any, continuing: bool) -> Any:
        """ignite's ``run`` after its state set-up: the loop over the current state (a new run, or
        one to continue, or an interrupted run's generator). Returns the state."""
        if continuing and self.should_terminate:  # a terminated run restarts its epoch's count
            self._init_iter = 0
        if self._dataloader_iter is None:
            self.state.dataloader = data
        return self._internal_run() if self.interrupt_resume_enabled else self._internal_run_legacy()

    def forget_run(self) -> None:
        """Drop an interrupted run's generator: the next loop starts from the state as set."""
        self._internal_run_generator = None

    def extend_max_epochs(self, max_epochs: int) -> None:
        """Raise the epoch limit of the current run (ignite's check: not below the epoch reached)."""
        self._check_and_set_max_epochs(max_epochs)

    def extend_max_iters(self, max_iters: int) -> None:
        """Raise the step limit of the current run (ignite's check: not below the step reached)."""
        self._check_and_set_max_iters(max_iters)

    def limits_reached(self) -> bool:
        """Whether the state is at its step or epoch limit (ignite's rule)."""
        return self._is_done(self.state)

    @property
    def run_finished(self) -> bool:
        """Whether ignite regards the run as done (a later ``run()`` then starts afresh)."""
        return self._is_done(self.state) and self._internal_run_generator is None


class GroupModel(ComputationModel):
    """``idist``'s computation model over one process group: its ranks are ``idist``'s world
    (``get_rank`` / ``get_world_size`` count inside it) and every collective without a ``group=``
    runs over it; ``None`` is this rank alone (every collective returns its input).

    Built from a group that exists, it runs no collective of its own: ignite's own model, built
    lazily at the first ``idist`` call from the process group, creates a world-wide group and
    all-reduces over it, which hangs when only some ranks get there (a pipeline's last stage)."""

    name = "hookloop-group"
    available_backends = ()

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self._size = 1 if group is None else dist.get_world_size(group)
        self._rank = 0 if group is None else dist.get_rank(group)
        backend = None if group is None else dist.get_backend(group)
        self._backend = backend
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None

    def _compute_nproc_per_node(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self._size

    def get_nproc_per_node(self) -> int:
        return self._size

    def get_nnodes(self) -> int:
        return 1

    def get_node_rank(self) -> int:
        return 0

    def device(self) -> torch.device:
        return self._device or torch.device("cpu")

    def backend(self) -> str | None:
        return self._backend

    def finalize(self) -> None:
        pass

    @staticmethod
    def create_from_context() -> None:
        return None

    @staticmethod
    def create_from_backend(backend: str, **kwargs: Any) -> ComputationModel:
        raise NotImplementedError("GroupModel wraps an existing process group: GroupModel(group)")

    @staticmethod
    def spawn(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("GroupModel wraps an existing process group; launch with torchrun")

    def _group(self, group: Any) -> Any:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError(
                f"inside ignite_world, pass a torch ProcessGroup as group= (or none), got {group!r}"
            )
        return self.group if group is None else group

    def _do_all_reduce(self, tensor: torch.Tensor, op: str = "SUM", group: Any | None = None) -> torch.Tensor:
        ops = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
               "MAX": dist.ReduceOp.MAX, "AND": dist.ReduceOp.BAND, "OR": dist.ReduceOp.BOR}  # fmt: skip
        if op not in ops:
            raise ValueError(f"Unsupported reduction operation: '{op}'")
        target = self._group(group)
        if target is not None and dist.get_world_size(target) > 1:
            dist.all_reduce(tensor, ops[op], group=target)
        return tensor

    def _do_all_gather(self, tensor: torch.Tensor, group: Any | None = None) -> torch.Tensor:
        target = self._group(group)
        if tensor.ndimension() == 0:
            tensor = tensor.unsqueeze(0)
        if target is None or dist.get_world_size(target) == 1:
            return tensor
        output = [torch.zeros_like(tensor) for _ in range(dist.get_world_size(target))]
        dist.all_gather(output, tensor, group=target)
        return torch.cat(output, dim=0)

    def _do_all_gather_object(self, tensor: Any, group: Any | None = None) -> list[Any]:
        target = self._group(group)
        if target is None or dist.get_world_size(target) == 1:
            return [tensor]
        output: list[Any] = [None] * dist.get_world_size(target)
        dist.all_gather_object(output, tensor, group=target)
        return output

    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.group is not None and self._size > 1:  # src counts inside the group
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.group is not None and self._size > 1:
            dist.barrier(group=self.group)

    def _do_new_group(self, ranks: list[int], **kwargs: Any) -> Any:
        raise NotImplementedError(
            "idist.new_group inside ignite_world: make the group before validation (dist.new_group "
            "on every rank) and pass it as group="
        )

    def _rank_not_in_group(self, group: Any) -> bool:
        return group is not None and group == dist.GroupMember.NON_GROUP_MEMBER


@contextlib.contextmanager
def ignite_world(group: Any) -> Iterator[GroupModel]:
    """Within the block, ``ignite.distributed`` (``idist``) has ``group``'s ranks as its world (None:
    this rank alone): an ignite metric's ``compute()`` reduces over them, whatever the rest of the
    process group does. The model ``idist`` had before comes back afterwards, unchanged."""
    from ignite.distributed import utils as idist_utils

    saved = idist_utils._model, idist_utils._need_to_sync
    model = GroupModel(group)
    idist_utils._model, idist_utils._need_to_sync = model, False
    try:
        yield model
    finally:
        idist_utils._model, idist_utils._need_to_sync = saved
