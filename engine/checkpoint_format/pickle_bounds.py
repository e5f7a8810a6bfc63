"""The bounded unpickler every checkpoint pickle is read with: the resource rules of
:mod:`hookloop.engine.checkpoint_format.dcp_pickles` (nesting, values per call, keys per hash value, memo
indices, no sets or out-of-band buffers) checked on every opcode that nests, calls, fills in or
hashes something. Which globals resolve and what a call or BUILD may do is the subclasses' part
(the index's allowlist, the entry checker's inert stand-ins)."""

from __future__ import annotations

import io
import itertools
import pickle
from typing import Any

import torch

__all__ = [
    "MAX_CALL_VALUES",
    "MAX_DEPTH",
    "MAX_SAME_HASH",
    "ATOMS",
    "BoundedUnpickler",
    "PickleRefused",
    "show",
    "walk",
]

#: The deepest nesting of tuples.
MAX_DEPTH = 32
#: The most values one call may receive, nested ones included (a shape of up to 127 dimensions, a
#: path of up to 128 parts), and the most fields one BUILD may fill in.
MAX_CALL_VALUES = 128
#: The most keys of one dictionary (or values of one call) that may share a hash value.
MAX_SAME_HASH = 8
_MEMO_LIMIT = 1 << 32
ATOMS = (str, bytes, int, float, bool, complex, type(None))


class PickleRefused(pickle.UnpicklingError):
    """A checkpoint pickle broke one of the rules above; the message says which."""


def show(obj: Any) -> str:
    text = getattr(obj, "__qualname__", None) or type(obj).__name__
    return f"{getattr(obj, '__module__', '?')}.{text}"[:200]


def walk(value: Any, what: str) -> bool:
    """Refuse ``value`` (a call's arguments) when it holds more than :data:`MAX_CALL_VALUES` values,
    nested ones included, or more than :data:`MAX_SAME_HASH` different atoms with one hash value. Stops at the
    limit, so it costs at most that many steps whatever ``value`` is (cycles too). True when every
    container in it is a tuple: nothing in it can change, so the verdict holds for good."""
    atoms: list[Any] = []
    pending, seen, frozen = [value], 0, True
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is tuple or kind is torch.Size:
            children: Any = item
        elif kind is list:
            children, frozen = item, False
        elif kind is dict:
            pairs = itertools.islice(item.items(), MAX_CALL_VALUES + 1)
            children, frozen = [x for pair in pairs for x in pair], False
        else:
            if isinstance(item, ATOMS):
                atoms.append(item)
            continue
        seen += len(children)
        if seen > MAX_CALL_VALUES:
            raise PickleRefused(f"passes more than {MAX_CALL_VALUES} values to {what}")
        pending.extend(children)
    buckets: dict[int, list[Any]] = {}
    for atom in atoms:
        same = buckets.setdefault(hash(atom), [])
        if atom not in same:  # equal values are one key of whatever the callee builds
            same.append(atom)
            if len(same) > MAX_SAME_HASH:
                raise PickleRefused(
                    f"passes more than {MAX_SAME_HASH} different values with one hash to {what}"
                )
    return frozen


class BoundedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with the bounds of this module on every opcode that nests, calls,
    fills in or hashes something. Subclasses decide which globals resolve, what calls and BUILD do,
    and which dictionary keys are allowed."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._depths: dict[int, int] = {}  # id(tuple) -> how deep it nests
        self._hashes: dict[int, dict[int, int]] = {}  # id(dict) -> {key hash: keys with it}
        self._checked: set[int] = set()  # id(tuple) of call arguments already found within bounds
        self._alive: list[Any] = []  # everything keyed by id() above stays alive: ids stay theirs

    # ------------------------------------------------------------------ nesting
    def _nest(self, value: tuple) -> tuple:
        """Record how deep tuple ``value`` nests (only from 2 levels on: a tuple not recorded nests
        one level), refusing more than :data:`MAX_DEPTH`."""
        get = self._depths.get
        inner = 0
        for item in value:
            d = get(id(item))
            if d is None:
                d = 1 if isinstance(item, tuple) else 0
            if d > inner:
                inner = d
        if inner:
            if inner >= MAX_DEPTH:
                raise PickleRefused(f"nests tuples more than {MAX_DEPTH} levels deep")
            self._depths[id(value)] = inner + 1
            self._alive.append(value)
        return value

    def load_tuple(self) -> None:
        items = self.pop_mark()  # before naming self.append: popping the mark replaces it
        self.append(self._nest(tuple(items)))

    def load_tuple1(self) -> None:
        item = self.stack[-1]
        value = (item,)
        if isinstance(item, tuple):  # else it nests one level, which is not recorded
            self._nest(value)
        self.stack[-1] = value

    def load_tuple2(self) -> None:
        a, b = self.stack[-2:]
        value = (a, b)
        if isinstance(a, tuple) or isinstance(b, tuple):
            self._nest(value)
        self.stack[-2:] = [value]

    def load_tuple3(self) -> None:
        self.stack[-3:] = [self._nest((self.stack[-3], self.stack[-2], self.stack[-1]))]

    def load_set(self) -> None:
        raise PickleRefused("builds a set, which no checkpoint pickle holds")

    # ------------------------------------------------------------------ dictionaries
    def check_key(self, key: Any) -> None:
        raise NotImplementedError

    def _insert(self, target: Any, key: Any, value: Any) -> None:
        if type(key) is not str or type(target) is not dict:
            # A string's hash is keyed per process (SipHash): no pickle can make many strings
            # share one. Other keys' hashes can be crafted, so they are counted.
            self.check_key(key)
            counts = self._hashes.get(id(target))
            if counts is None:
                counts = self._hashes[id(target)] = {}
                self._alive.append(target)
            h = hash(key)
            counts[h] = counts.get(h, 0) + 1
            if counts[h] > MAX_SAME_HASH:
                raise PickleRefused(f"has more than {MAX_SAME_HASH} keys with one hash value in a dictionary")
            self.set_item(target, key, value)
        else:
            target[key] = value

    def set_item(self, target: Any, key: Any, value: Any) -> None:
        if type(target) is not dict:
            raise PickleRefused(f"sets an item of a {show(type(target))}, which is not a dictionary")
        target[key] = value

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._insert(self.stack[-1], key, value)

    def _insert_items(self, opcode: str, target: Any = None) -> Any:
        items = self.pop_mark()
        if target is None:  # SETITEMS: the dictionary below the mark
            target = self.stack[-1]
        if len(items) % 2:
            raise PickleRefused(f"{opcode} has a key without a value")
        insert = self._insert
        for i in range(0, len(items), 2):
            insert(target, items[i], items[i + 1])
        return target

    def load_setitems(self) -> None:
        self._insert_items("SETITEMS")

    def load_dict(self) -> None:
        self.append(self._insert_items("DICT", {}))

    # ------------------------------------------------------------------ memo
    def load_put(self) -> None:
        index = int(self.readline()[:-1])
        if not 0 <= index < _MEMO_LIMIT:
            raise PickleRefused(f"uses memo index {index}, outside [0, 2**32)")
        self.memo[index] = self.stack[-1]

    # ------------------------------------------------------------------ calls
    def call(self, opcode: str, fn: Any, args: tuple, kwargs: dict | None = None) -> Any:
        raise NotImplementedError

    def _checked_call(self, opcode: str, fn: Any, args: Any, kwargs: Any = None) -> Any:
        if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
            raise PickleRefused(f"{opcode} with arguments that are not a tuple")
        if id(args) not in self._checked or kwargs:
            if walk(args, f"{opcode} of {show(fn)}") and not kwargs:
                self._checked.add(id(args))  # the same arguments again (from the memo): known good
                self._alive.append(args)
            if kwargs:
                walk(kwargs, f"{opcode} of {show(fn)}")
        result = self.call(opcode, fn, args, kwargs)
        if isinstance(result, tuple) and type(result) is not torch.Size:  # a Size holds numbers only
            self._nest(result)
        return result

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._checked_call("REDUCE", self.stack[-1], args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._checked_call("NEWOBJ", self.stack[-1], args)

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._checked_call("NEWOBJ_EX", self.stack[-1], args, kwargs)

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self.append(self._checked_call("INST/OBJ", klass, tuple(args)))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        parts = state if type(state) is tuple and len(state) == 2 else (state,)  # (dict, slots)
        if any(type(part) in (dict, tuple, list) and len(part) > MAX_CALL_VALUES for part in parts):
            raise PickleRefused(f"passes more than {MAX_CALL_VALUES} values to BUILD of a {show(type(inst))}")
        self.build(inst, state)

    def build(self, inst: Any, state: Any) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ refused outright
    def get_extension(self, code: int) -> None:
        raise PickleRefused(f"uses extension code {code}")

    def load_next_buffer(self) -> None:
        raise PickleRefused("uses an out-of-band buffer")

    for _opcode, _method in (
        (pickle.TUPLE, load_tuple),
        (pickle.TUPLE1, load_tuple1),
        (pickle.TUPLE2, load_tuple2),
        (pickle.TUPLE3, load_tuple3),
        (pickle.EMPTY_SET, load_set),
        (pickle.ADDITEMS, load_set),
        (pickle.FROZENSET, load_set),
        (pickle.SETITEM, load_setitem),
        (pickle.SETITEMS, load_setitems),
        (pickle.DICT, load_dict),
        (pickle.PUT, load_put),
        (pickle.REDUCE, load_reduce),
        (pickle.NEWOBJ, load_newobj),
        (pickle.NEWOBJ_EX, load_newobj_ex),
        (pickle.BUILD, load_build),
        (pickle.NEXT_BUFFER, load_next_buffer),
        (pickle.READONLY_BUFFER, load_next_buffer),
    ):
        dispatch[_opcode[0]] = _method
    del _opcode, _method
