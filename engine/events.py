"""The events a :class:`~engine.Trainer` fires, the order handlers run in, and the registry that
holds them: one module for events, filters, priorities and dispatch.

Where ignite already has the moment, the name is an alias of ignite's member, so an ignite handler
and a hookloop handler attached to "the same" event see one firing, not two. The moments ignite
lacks are members of :class:`StepEvents`, fired from inside the step body.

Where each event fires, as a sketch of the loop (``state.step`` is 1-based from STEP_START on)::

    fire(TRAIN_START)                      # resume happens here (checkpointer runs first)
    agree()                                # every rank got through TRAIN_START (engine/run_start.py)
    fire(RUN_STARTED)                      # the run has started: from here on handlers may write
                                           # to the run directory (nothing is written before)
    while not done:
        state.epoch += 1
        fire(EPOCH_START)
        for microbatches in steps_of(data):    # grad_accum_steps microbatches each
            state.step += 1
            fire(STEP_START)                   # microbatches fetched, nothing computed
            for i, mb in enumerate(microbatches):
                loss = loss_fn(model(x), y) / len(microbatches)
                loss.backward()                # gradients sync on the last microbatch only
                fire(MICROBATCH)               # state.microbatch == i, state.microbatch_loss
            state.loss = this rank's mean over microbatches      # tensors, read only if asked
            state.grad_norm = total norm of the unclipped gradients
            fire(BEFORE_OPTIMIZER_STEP)        # gradients unclipped; control.request_skip() vetoes
            agree()                            # ONE all-reduce: loss, norm, tokens, samples summed
                                               # over ranks with skip/stop/checkpoint/exit-code
                                               # votes and handler slots (engine/agreement.py)
            if not control.decided.skip:       # agreed: any rank's veto is every rank's
                clip; optimizer.step(); lr_scheduler.step()
            optimizer.zero_grad()
            fire(STEP_END)                     # state.loss = mean over ranks; validation
            if stop agreed (or, only when some rank has a handler here that declared
                asks_after_agreement = True, or a function, a second small all-reduce agrees
                a stop asked for after agree()): stop
        fire(EPOCH_END)
    fire(TRAIN_END)
    # on an error: fire(EXCEPTION); unless a handler handled it, fire(TRAIN_FAILED) and re-raise

Every ignite filter works on every event: ``Events.STEP_END(every=10)``, ``Events.MICROBATCH(once=3)``,
``Events.STEP_START(event_filter=f)``.

Order within one event: handlers run phase by phase, and inside a phase by order, higher first;
equal places run in attach order. :class:`Priority` is the order table, and it names the *phases*
of an event, not handlers: every handler, shipped or a user's, takes a :class:`Place` inside a phase
(``Priority.ACT + 1``: in the act phase, just before its order-0 handlers). An order lies strictly
between -1000 and +1000 (:data:`ORDER_LIMIT`), so a place never leaves its phase; one that would is
refused (:class:`PlaceError`). A plain number is an order inside DEFAULT (``priority=5`` is
``Priority.DEFAULT + 5``), as ignite-style code passes it. From first to last:

- ``ENGINE_FIRST``: the trainer's own bookkeeping (clear the last run's flags, enter the step).
- ``CLOCK``: timers and profilers start (and, on the step's end, stop) around everyone else's work.
  A handler here reads clocks and writes only its own timings.
- ``RESTORE``: the run's state comes back: a resume or a rollback loads model, optimizer and handler
  state; at the end of a run, the last save is written and drained. Handlers after it see the
  restored step.
- ``OBSERVE``: read what the step did and put derived numbers into the state: health, metrics,
  validation (``VALIDATION``, the trainer's own slot), the data mixture's phase.
- ``DECIDE``: turn what was observed into requests: this step's cadence flags, limits, a rank's
  verdict on its gradients.
- ``ACT``: carry out what was requested and agreed: save a checkpoint.
- ``DEFAULT``: a user's handler unless it asks for another place: on STEP_END it sees the step's
  metrics, validation and save, and runs before the step is recorded.
- ``RECORD``: loggers write the step; a handler after them sees the step as recorded.
- ``CLEANUP``: after every handler's work: wait for background work the next part of the loop
  needs finished, export traces.
- ``ENGINE_LAST``: the trainer's own end of an event: agree on a stop asked for in it, act on it.

The engine knows its handlers only by these phases; which handler sits where, event by event, is
what :meth:`EventRegistry.describe` prints (``trainer.describe()``, ``hookloop check CONFIG --order``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import numbers
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ignite.engine import Events as IgniteEvents
from ignite.engine.events import CallableEventWithFilter, EventEnum, EventsList, RemovableEventHandle

from hookloop.engine import ignite_adapter

__all__ = [
    "ORDER_LIMIT",
    "PHASES",
    "EventHandle",
    "EventRegistry",
    "Events",
    "Place",
    "PlaceError",
    "Priority",
    "StepEvents",
    "STEP_EVENT_TO_ATTR",
    "every",
]


class StepEvents(EventEnum):
    """Moments that ignite's loop has no member for; the trainer fires them itself."""

    MICROBATCH = "microbatch"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    VALIDATION_END = "validation_end"
    CHECKPOINT_SAVED = "checkpoint_saved"
    ROLLBACK = "rollback"
    TRAIN_FAILED = "train_failed"
    RUN_STARTED = "run_started"


# The state counter each custom event's filters read (``every=``, ``once=``); the trainer
# increments each one right before it fires the event.
STEP_EVENT_TO_ATTR = {
    StepEvents.MICROBATCH: "microbatches_seen",
    StepEvents.BEFORE_OPTIMIZER_STEP: "iteration",
    StepEvents.VALIDATION_END: "validations",
    StepEvents.CHECKPOINT_SAVED: "checkpoints_saved",
    StepEvents.ROLLBACK: "rollbacks",
    StepEvents.TRAIN_FAILED: "epoch",
    StepEvents.RUN_STARTED: "epoch",
}


class Events:
    """All trainer events. Aliases of ignite's members where ignite has the moment."""

    TRAIN_START = IgniteEvents.STARTED
    RUN_STARTED = StepEvents.RUN_STARTED
    EPOCH_START = IgniteEvents.EPOCH_STARTED
    STEP_START = IgniteEvents.ITERATION_STARTED
    MICROBATCH = StepEvents.MICROBATCH
    BEFORE_OPTIMIZER_STEP = StepEvents.BEFORE_OPTIMIZER_STEP
    STEP_END = IgniteEvents.ITERATION_COMPLETED
    VALIDATION_END = StepEvents.VALIDATION_END
    CHECKPOINT_SAVED = StepEvents.CHECKPOINT_SAVED
    ROLLBACK = StepEvents.ROLLBACK
    EPOCH_END = IgniteEvents.EPOCH_COMPLETED
    TRAIN_END = IgniteEvents.COMPLETED
    EXCEPTION = IgniteEvents.EXCEPTION_RAISED
    TRAIN_FAILED = StepEvents.TRAIN_FAILED
    TERMINATE = IgniteEvents.TERMINATE


#: How far an order may move a place from its phase's own place (order 0), either way, exclusive:
#: every phase has room for orders strictly between -ORDER_LIMIT and +ORDER_LIMIT.
ORDER_LIMIT = 1000.0

# The phases in the order they run, each with the number the registry sorts its order-0 place by.
# The numbers are 10 * ORDER_LIMIT apart, so no order of one phase reaches another phase.
_PHASES: dict[str, float] = {
    "ENGINE_FIRST": math.inf,
    "CLOCK": 5e4,
    "RESTORE": 4e4,
    "OBSERVE": 3e4,
    "DECIDE": 2e4,
    "ACT": 1e4,
    "DEFAULT": 0.0,
    "RECORD": -1e4,
    "CLEANUP": -2e4,
    "ENGINE_LAST": -math.inf,
}
#: The phases of an event, first to last.
PHASES = tuple(_PHASES)
_ENGINE_OWN = ("ENGINE_FIRST", "ENGINE_LAST")


class PlaceError(ValueError):
    """A handler's place that would leave its phase: an order at or beyond :data:`ORDER_LIMIT`
    (``Priority.ACT + 1e9``), an order on the trainer's own ``ENGINE_FIRST`` / ``ENGINE_LAST``, or
    a plain-number priority outside ``DEFAULT``'s orders."""


class Place(float):
    """Where a handler runs on an event: a phase of :class:`Priority` and an order inside it (the
    rules are the module docstring's). ``Priority.ACT + 1`` runs just before ``Priority.ACT`` and
    ``Priority.ACT - 1`` just after it, both still in ACT. A place is the number the trainer sorts
    handlers by (a ``float``), so places compare with each other and with plain numbers."""

    __slots__ = ("phase", "order")
    phase: str
    order: float

    def __new__(cls, phase: str, order: float = 0.0) -> Place:
        return cls._make(phase, order, lambda: f"Place({phase!r}, {order!r})")

    @classmethod
    def _make(cls, phase: str, order: float, written: Callable[[], str]) -> Place:
        if phase not in _PHASES:
            raise ValueError(f"{phase!r} is not a phase; the phases, first to last: {', '.join(PHASES)}")
        if isinstance(order, bool) or not isinstance(order, numbers.Real) or math.isnan(order):
            raise TypeError(f"{written()}: an order is a number, got {order!r}")
        order = float(order)
        if order != 0.0 and (phase in _ENGINE_OWN or not abs(order) < ORDER_LIMIT):
            raise PlaceError(_leaves_phase(phase, written()))
        place = super().__new__(cls, _PHASES[phase] + order)
        place.phase, place.order = phase, order
        return place

    @classmethod
    def of(cls, priority: float) -> Place:
        """The place ``priority`` names: a :class:`Place` as it is, a plain number ``n`` as
        ``Priority.DEFAULT + n`` (refused unless it stays inside DEFAULT)."""
        if isinstance(priority, Place):
            return priority
        if isinstance(priority, bool) or not isinstance(priority, numbers.Real) or math.isnan(priority):
            raise TypeError(f"priority must be a place (see engine.Priority) or a number, got {priority!r}")
        written = f"priority={priority!r} (a plain number is an order inside DEFAULT)"
        return cls._make("DEFAULT", priority, lambda: written)

    def __add__(self, other: Any) -> Place:
        return self._moved(other, 1, "+")

    __radd__ = __add__

    def __sub__(self, other: Any) -> Place:
        return self._moved(other, -1, "-")

    def _moved(self, other: Any, sign: int, op: str) -> Place:
        if isinstance(other, Place):
            raise TypeError(f"{self!r} {op} {other!r}: a place takes a number (an order), not another place")
        if isinstance(other, bool) or not isinstance(other, numbers.Real):
            return NotImplemented
        return Place._make(self.phase, self.order + sign * other, lambda: f"{self!r} {op} {other!r}")

    def __repr__(self) -> str:
        if not self.order:
            return f"Priority.{self.phase}"
        n = abs(self.order)
        return f"Priority.{self.phase} {'+' if self.order > 0 else '-'} {int(n) if n.is_integer() else n}"

    __str__ = __repr__

    def __reduce__(self) -> tuple:
        return (Place, (self.phase, self.order))


def _leaves_phase(phase: str, written: str) -> str:
    """What a :class:`PlaceError` says: the place, its phase, the phase's room and the fix."""
    if phase in _ENGINE_OWN:
        return (
            f"{written}: {phase} is the trainer's own place and has no orders; to run before every "
            f"other handler use Priority.CLOCK + n, after every other Priority.CLEANUP - n "
            f"(n < {ORDER_LIMIT:g})"
        )
    i = PHASES.index(phase)
    earlier, later = PHASES[i - 1], PHASES[i + 1]
    before = f"nothing but the trainer runs before {phase}"
    if earlier not in _ENGINE_OWN:
        before = (
            f"to run before {phase}'s handlers, place the handler at the end of {earlier} "
            f"(Priority.{earlier} - n)"
        )
    after = f"nothing but the trainer runs after {phase}"
    if later not in _ENGINE_OWN:
        after = f"to run after them, at the start of {later} (Priority.{later} + n)"
    return (
        f"{written} leaves the {phase} phase: an order inside a phase lies strictly between "
        f"-{ORDER_LIMIT:g} and +{ORDER_LIMIT:g} ({phase} runs after {earlier} and before {later}); "
        f"{before}; {after}"
    )


class _PhaseTable(type):
    """Points code that looks up a handler's place on the engine's table to where such names live."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"Priority has no {name!r}: the engine's table names the phases of an event "
            f"({', '.join(PHASES)}, and VALIDATION, the trainer's own place); the shipped handlers' "
            "places are named by the handlers package (hookloop.handlers), each inside one of these phases"
        )


class Priority(metaclass=_PhaseTable):
    """The phases of an event, in the order they run (see the module docstring for what a handler
    in each phase may rely on and may do). Each is a :class:`Place` (order 0 of its phase).
    ``ENGINE_FIRST`` and ``ENGINE_LAST`` are the trainer's own and take no order. ``VALIDATION`` is
    the trainer's own place in ``OBSERVE`` (it validates at STEP_END when asked)."""

    ENGINE_FIRST = Place("ENGINE_FIRST")
    CLOCK = Place("CLOCK")
    RESTORE = Place("RESTORE")
    OBSERVE = Place("OBSERVE")
    VALIDATION = OBSERVE
    DECIDE = Place("DECIDE")
    ACT = Place("ACT")
    DEFAULT = Place("DEFAULT")
    RECORD = Place("RECORD")
    CLEANUP = Place("CLEANUP")
    ENGINE_LAST = Place("ENGINE_LAST")


@dataclasses.dataclass(slots=True, weakref_slot=True, eq=False)
class _Entry:
    """One registered handler: what to call, how, when (filter) and in which order (priority)."""

    event: Any
    func: Callable
    original: Callable
    args: tuple
    kwargs: dict
    priority: Place
    seq: float
    every: int | None
    filter: Callable | None
    attr: str | None
    pass_engine: bool
    removed: bool = False


class EventHandle(RemovableEventHandle):
    """What ``add_event_handler`` returns: ignite's ``RemovableEventHandle`` (``event_name``, the weak
    references ``handler()`` and ``engine()``, ``remove()``, a context manager) whose ``remove()``
    detaches exactly the registrations it made, even when the same handler is attached twice.

    Like ignite's, it holds the engine, the handler and its registrations weakly: a handle does not
    keep a trainer alive, and once the trainer is gone ``remove()`` does nothing."""

    def __init__(self, event_name: Any, handler: Callable, engine: Any, entries: list[_Entry]) -> None:
        self.event_name = event_name
        self.handler = _weak(handler)
        self.engine = weakref.ref(engine)
        self._entries = [weakref.ref(entry) for entry in entries]

    def entries(self) -> list[_Entry]:
        """The registrations still attached."""
        return [
            entry for entry in (ref() for ref in self._entries) if entry is not None and not entry.removed
        ]

    @property
    def priority(self) -> Place:
        entries = self.entries()
        return entries[0].priority if entries else Priority.DEFAULT

    def remove(self) -> None:
        engine = self.engine()
        if engine is None:
            return
        for entry in self.entries():
            engine.events.remove_entry(entry)

    def __enter__(self) -> EventHandle:
        return self

    def __exit__(self, *args: Any) -> None:
        self.remove()


def _weak(handler: Callable) -> Callable[[], Callable | None]:
    """A weak reference to ``handler``; a callable that cannot be referenced weakly is held."""
    try:
        return weakref.ref(handler)
    except TypeError:
        return lambda: handler


class EventRegistry:
    """Handlers by event, kept in firing order (priority, then attach order).

    Each entry carries its own priority and filter, so removing and re-adding handlers never loses
    an order or a filter. A plain ``every=N`` filter is evaluated as one modulo for a whole run of
    adjacent handlers that share it, instead of one call per handler.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._entries: dict[Any, list[_Entry]] = {}
        self._plans: dict[int, list] = {}
        self._seq = itertools.count()
        self._version = 0

    def add(self, event: Any, handler: Callable, args: tuple, kwargs: dict, priority: float) -> EventHandle:
        """Attach ``handler`` at ``priority``: a :class:`Place`, or a plain number (an order inside
        DEFAULT, :meth:`Place.of`)."""
        if isinstance(event, EventsList):
            entries = [e for ev in event for e in self.add(ev, handler, args, kwargs, priority).entries()]
            return EventHandle(event, handler, self._engine, entries)
        base, event_filter = _split_filter(event)
        if not self._engine.is_registered_event(base):
            raise ValueError(
                f"Event {event} is not a valid event for this {type(self._engine).__name__}. (Register a "
                "custom event with trainer.register_events(...) before attaching handlers to it.)"
            )
        if not callable(handler):
            raise TypeError(f"{handler!r} is not a callable object: the handler must be callable")
        place = Place.of(priority)  # checked before anything is registered
        every = ignite_adapter.every_of(event_filter) if event_filter is not None else None
        attr = None
        if event_filter is not None:
            attr = self._engine.state.event_to_attr.get(base)
            if attr is None:
                raise ValueError(
                    f"{base!r} has no counter for filters; register it with event_to_attr={{event: 'attr'}}"
                )
        pass_engine = _accepts_engine(handler, base, args, kwargs, self._engine)
        entry = _Entry(
            base, handler, handler, tuple(args), dict(kwargs), place, next(self._seq),
            every, None if every is not None else event_filter, attr, pass_engine,
        )  # fmt: skip
        entries = self._entries.setdefault(base, [])
        entries.append(entry)
        entries.sort(key=lambda e: (-e.priority, e.seq))
        self._changed(base)
        return EventHandle(event, handler, self._engine, [entry])

    def insert_at(
        self, event: Any, index: int, func: Callable, args: tuple, kwargs: dict, pass_engine: bool
    ) -> _Entry:
        """Attach ``func`` so that it runs at ``index`` in ``event``'s current order (what
        ``list.insert`` would do to ignite's handler list): its priority and place among equal
        priorities are taken from its new neighbours."""
        entries = self._entries.setdefault(event, [])
        index = max(0, len(entries) + index) if index < 0 else min(index, len(entries))
        before = entries[index - 1] if index > 0 else None
        after = entries[index] if index < len(entries) else None
        if after is None:
            priority, seq = (before.priority if before else Priority.DEFAULT), next(self._seq)
        elif before is None or before.priority != after.priority:
            priority, seq = after.priority, after.seq - 1  # the first of its priority: any seq below it
        else:
            priority, seq = after.priority, (before.seq + after.seq) / 2
        entry = _Entry(
            event, func, func, tuple(args), dict(kwargs), priority, seq, None, None, None, pass_engine
        )
        entries.insert(index, entry)
        self._changed(event)
        return entry

    def replace_entry(
        self, entry: _Entry, func: Callable, args: tuple, kwargs: dict, pass_engine: bool
    ) -> None:
        """Call ``func`` in ``entry``'s place (same priority and filter), e.g. a timing wrapper. A
        wrapper of the attached handler (``functools.wraps``) still counts as that handler for
        ``has_event_handler`` and ``remove_event_handler``."""
        if getattr(func, "__wrapped__", None) is not entry.original:
            entry.original = func
        entry.func, entry.args, entry.kwargs, entry.pass_engine = func, tuple(args), dict(kwargs), pass_engine
        self._changed(entry.event)

    def remove_entry(self, entry: _Entry) -> None:
        entries = self._entries.get(entry.event, [])
        if entry in entries:
            entries.remove(entry)
            entry.removed = True
            self._changed(entry.event)

    def remove(self, handler: Callable, event: Any) -> None:
        base, _ = _split_filter(event)
        entries = self._entries.get(base)
        if not entries:
            raise ValueError(f"Input event name '{event}' does not exist (no handler is attached to it)")
        matches = [e for e in entries if _same_handler(e.original, handler)]
        if not matches:
            raise ValueError(
                f"Input handler '{handler}' is not found among registered event handlers of {base}"
            )
        for entry in matches:
            self.remove_entry(entry)

    def has(self, handler: Callable, event: Any | None = None) -> bool:
        if event is None:
            events: Iterable = list(self._entries)
        else:
            events = [_split_filter(event)[0]]
        return any(_same_handler(e.original, handler) for ev in events for e in self._entries.get(ev, []))

    def any_for(self, event: Any) -> bool:
        return bool(self._entries.get(event))

    def events(self) -> list[Any]:
        """The events that have handlers attached."""
        return [event for event, entries in self._entries.items() if entries]

    def entries(self, event: Any) -> list[_Entry]:
        """The entries of ``event`` in firing order (a copy)."""
        return list(self._entries.get(event, []))

    def describe(self) -> str:
        """Every event's handlers in the order they run, one line each: the place (phase ± order),
        the handler (``Class.method``, or a function's qualified name) and its filter; the events
        in the order the loop fires them, then any other, in attach order."""
        events = sorted(self.events(), key=lambda e: _RUN_POSITION.get(e, len(_RUN_POSITION)))
        places = {id(e): str(e.priority).removeprefix("Priority.") for v in events for e in self._entries[v]}
        width = max(map(len, places.values()), default=0)
        lines: list[str] = []
        for event in events:
            lines.append(_EVENT_NAMES.get(event) or getattr(event, "name", str(event)))
            for entry in self._entries[event]:
                note = f" (every {entry.every})" if entry.every is not None else ""
                note = note or (" (filtered)" if entry.filter else "")
                lines.append(f"  {places[id(entry)]:<{width}}  {_handler_name(entry.original)}{note}")
        return "\n".join(lines)

    def fire(self, event: Any, event_args: tuple = (), event_kwargs: dict | None = None) -> None:
        """Run ``event``'s handlers in order. A handler added during the firing runs in it too, after
        the ones already there (as in ignite); one removed during the firing no longer runs."""
        plan = self._plans.get(id(event))  # by identity: event members hash slowly (by name)
        if plan is None:
            plan = self._plan(event)
        if not plan:
            return
        version = self._version
        engine = self._engine
        state = engine.state
        for every, attr, entries in plan:
            if every is not None and getattr(state, attr) % every:
                continue
            for entry in entries:  # _call, inlined: this loop is the engine's hot path
                if version != self._version and entry.removed:
                    continue
                if entry.filter is not None and not entry.filter(engine, getattr(state, entry.attr)):
                    continue
                kwargs = {**entry.kwargs, **event_kwargs} if event_kwargs else entry.kwargs
                if entry.pass_engine:
                    entry.func(engine, *event_args, *entry.args, **kwargs)
                else:
                    entry.func(*event_args, *entry.args, **kwargs)
        if version != self._version:
            self._fire_added(event, plan, event_args, event_kwargs)

    def _fire_added(self, event: Any, plan: list, event_args: tuple, event_kwargs: dict | None) -> None:
        done = {id(e) for _, _, entries in plan for e in entries}
        while True:
            added = [e for e in self._entries.get(event, []) if id(e) not in done]
            if not added:
                return
            for entry in added:
                done.add(id(entry))
                if entry.every is not None and getattr(self._engine.state, entry.attr) % entry.every:
                    continue
                self._call(entry, self._engine, self._engine.state, event_args, event_kwargs)

    def fire_entry(self, entry: _Entry, event_args: tuple = ()) -> None:
        """Call one entry as its event would (filter included)."""
        self._call(entry, self._engine, self._engine.state, event_args, None)

    @staticmethod
    def _call(entry: _Entry, engine: Any, state: Any, event_args: tuple, event_kwargs: dict | None) -> None:
        if entry.filter is not None and not entry.filter(engine, getattr(state, entry.attr)):
            return
        kwargs = {**entry.kwargs, **event_kwargs} if event_kwargs else entry.kwargs
        if entry.pass_engine:
            entry.func(engine, *event_args, *entry.args, **kwargs)
        else:
            entry.func(*event_args, *entry.args, **kwargs)

    def _plan(self, event: Any) -> list:
        plan: list = []
        for entry in self._entries.get(event, []):
            key = (entry.every, entry.attr) if entry.every is not None else (None, None)
            if plan and (plan[-1][0], plan[-1][1]) == key:
                plan[-1][2].append(entry)
            else:
                plan.append((key[0], key[1], [entry]))
        if isinstance(event, EventEnum):  # members live as long as their enum: stable ids
            self._plans[id(event)] = plan
        return plan

    def _changed(self, event: Any) -> None:
        self._plans.clear()  # attaching is rare; an equal event object must not keep a stale plan
        self._version += 1


# Each event's name in Events, and its position in the order the loop fires them (describe's order).
_EVENT_NAMES = {event: name for name, event in vars(Events).items() if not name.startswith("_")}
_RUN_ORDER = list(_EVENT_NAMES)
_RUN_ORDER[_RUN_ORDER.index(Events.STEP_START) : _RUN_ORDER.index(Events.STEP_START)] = [
    IgniteEvents.GET_BATCH_STARTED,  # fetching the step's microbatches
    IgniteEvents.GET_BATCH_COMPLETED,
]
_RUN_POSITION = {event: i for i, event in enumerate(_RUN_ORDER)}


def _handler_name(handler: Callable) -> str:
    """``Class.method`` for a bound method (the class of its object), else the qualified name of
    the function (or of a callable object's class); a wrapper (``functools.wraps``) as what it wraps."""
    handler = inspect.unwrap(handler)
    while isinstance(handler, functools.partial):
        handler = handler.func
    if inspect.ismethod(handler):
        owner = handler.__self__ if inspect.isclass(handler.__self__) else type(handler.__self__)
        return f"{owner.__qualname__}.{handler.__name__}"
    name = getattr(handler, "__qualname__", None) or type(handler).__qualname__
    return name.replace("<locals>.", "")


def _split_filter(event: Any) -> tuple[Any, Callable | None]:
    """A filtered event (``Events.STEP_END(every=10)``) -> (``Events.STEP_END``, its filter)."""
    if isinstance(event, CallableEventWithFilter) and not isinstance(event, EventEnum):
        base = ignite_adapter.base_event(event)
        return base, event.filter
    return event, None


def _same_handler(registered: Callable, handler: Callable) -> bool:
    parent = getattr(registered, "_parent", None)  # an ignite-wrapped handler
    if parent is not None and callable(parent):
        registered = parent()
    return registered == handler


def _accepts_engine(handler: Callable, event: Any, args: tuple, kwargs: dict, engine: Any) -> bool:
    """ignite's rule: the handler gets the engine first if its signature accepts it there."""
    event_args: tuple = ()
    if event == IgniteEvents.EXCEPTION_RAISED or event == StepEvents.TRAIN_FAILED:
        event_args = (Exception(),)
    elif event == IgniteEvents.TERMINATE_SINGLE_EPOCH:
        event_args = (0,)
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # a builtin without a signature: call it as ignite would
        return True
    try:
        signature.bind(engine, *event_args, *args, **kwargs)
        return True
    except TypeError:
        pass
    try:
        signature.bind(*event_args, *args, **kwargs)
    except TypeError as e:
        passed = [*event_args, *args, *kwargs]
        raise ValueError(
            f"Error adding {handler} 'handler': takes parameters {list(signature.parameters)} but will be "
            f"called with {passed}({e}). (On {event} a handler is called with the trainer first if its "
            "signature takes it, then the event's arguments and the args given to add_event_handler.)"
        ) from None
    return False


def every(n: int | None, step: int) -> bool:
    """Whether a cadence of ``n`` steps fires at ``step`` (1-based): every multiple of ``n``; never
    when ``n`` is None. The one interval rule of every cadence (save, validate, GC, log): nobody
    counts steps of their own."""
    return n is not None and step > 0 and step % n == 0
