"""The plain-value rule for sequence ids and namespaces.

A sequence id or a namespace keys dicts inside the shard actors (block tables,
the prefix tree's roots) and will be written into snapshots and cache events.
So it must be a *plain value*: its hash and equality are Python's own, it
cannot raise, it never equals a value of another kind, and it serializes
stably. The plain values are:

- an exact ``str``, ``int`` or ``bytes`` (not a subclass: not ``bool``, not
  an ``IntEnum`` or ``StrEnum`` member, not a ``str`` subclass with its own
  ``__eq__``; convert those yourself with ``str(x)``, ``int(x)`` or ``x.value``);
- a numpy integer, ``numpy.str_`` or ``numpy.bytes_`` scalar (exact numpy
  types), normalized to the ``int``, ``str`` or ``bytes`` of the same value;
- an exact ``tuple`` of plain values or ``None``, nested at most
  :data:`MAX_ID_DEPTH` deep (a tagged tuple such as ``("lora", 7)`` is the
  recommended namespace);
- ``None``, as a namespace only (the default namespace); a sequence id is never
  ``None``.

Anything else (floats, NaN, bools, lists, tensors, objects with a custom
``__eq__`` or ``__hash__``) is :class:`~akv.errors.InvalidInput`. Subclasses are
refused rather than converted: converting would call the subclass's own
methods, and it would silently merge, say, ``Color.RED`` with ``1``.

The check runs in the caller's task before any message is sent, so no
exception that an id could raise ever reaches an actor's loop.
"""

from __future__ import annotations

import reprlib
from collections.abc import Collection, Hashable
from itertools import chain
from typing import Any

import numpy as np

from akv.errors import InvalidInput

#: Deepest nesting of tuples accepted in an id (the id itself is depth 1).
MAX_ID_DEPTH = 16

#: The exact types a plain id (or an element of a tuple id) has.
PLAIN_TYPES = frozenset((str, int, bytes))
#: numpy's integer scalar types (exact), normalized to ``int``.
NUMPY_INTEGER_TYPES = frozenset(np.dtype(code).type for code in np.typecodes["AllInteger"])
_FLAT_ELEMENT_TYPES = PLAIN_TYPES | {type(None)}
_NUMPY: dict[type, type] = dict.fromkeys(NUMPY_INTEGER_TYPES, int)
_NUMPY[np.str_] = str
_NUMPY[np.bytes_] = bytes

_REPR = reprlib.Repr()  # short reprs of whatever a caller passed (keywords need Python 3.12)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40
_RULE = "a str, int, bytes or a tuple of these (see akv.core.ids)"


def safe_repr(value: Any) -> str:
    """A short repr (:mod:`reprlib`) of anything a caller passed, for an error message.

    Args:
        value: Any object.

    Returns:
        E.g. ``"nan"`` or ``"[0, 1, 2, 3, 4, 5, ...]"``; ``"<unprintable>"``
        where even that raises.
    """
    try:
        return _REPR.repr(value)
    except Exception:  # a caller's object whose repr or iteration raises still gets its typed error
        return "<unprintable>"


def describe(value: Any) -> str:
    """``type repr`` of anything a caller passed, for an error message (see :func:`safe_repr`).

    Args:
        value: Any object.

    Returns:
        E.g. ``"float nan"`` or ``"list [0, 1, 2, 3, 4, 5, ...]"``.
    """
    return f"{type(value).__name__} {safe_repr(value)}"


def plain_id(value: Any, what: str, *, allow_none: bool = False) -> Hashable:
    """Return ``value`` as a plain value (see the module docstring), or raise.

    O(1) for a ``str`` or ``int``; a tuple costs one pass over its elements.

    Args:
        value: A sequence id or namespace from a caller.
        what: What ``value`` is, for the message (e.g. ``"seq_id of free()"``).
        allow_none: Accept ``None`` (namespaces).

    Returns:
        ``value`` itself if it is already plain, else the normalized value
        (numpy scalars become ``int``, ``str`` or ``bytes``).

    Raises:
        InvalidInput: ``value`` is not a plain value.
    """
    kind = type(value)
    if kind in PLAIN_TYPES or (value is None and allow_none):
        return value
    if kind is tuple:
        return _plain_tuple(value, what, 1)
    if kind in _NUMPY:
        return _NUMPY[kind](value)
    raise InvalidInput(_message(value, what, allow_none))


def all_plain(values: Collection) -> bool:
    """Whether every element of ``values`` is already a plain id, checked without a Python call per element.

    True when they are all exact ``str``, ``int`` or ``bytes``, or all exact
    tuples of those and ``None`` (the ``(request_id, beam)`` shape): two C
    passes over the types. False says only "look closer" (nested tuples, numpy
    scalars, mixes of tuples and scalars, or a value that is not plain).

    Args:
        values: Sequence ids (a list, or a dict's keys).

    Returns:
        Whether no element needs :func:`plain_id`.
    """
    kinds = set(map(type, values))
    if kinds <= PLAIN_TYPES:
        return True
    return kinds == {tuple} and set(map(type, chain.from_iterable(values))) <= _FLAT_ELEMENT_TYPES


def plain_ids(values: list, what: str) -> list:
    """Return a list of sequence ids with every element plain (see :func:`plain_id`).

    Args:
        values: Sequence ids (a list the caller's collection was copied into).
        what: What the list is, for the message.

    Returns:
        ``values`` itself when :func:`all_plain` says so, else a new list of
        normalized ids.

    Raises:
        InvalidInput: An element is not a plain value.
    """
    if all_plain(values):
        return values
    return [plain_id(value, f"an id in {what}") for value in values]


def _plain_tuple(value: tuple, what: str, depth: int) -> tuple:
    """A tuple id with each element plain or ``None``; ``depth`` counts enclosing tuples."""
    if depth > MAX_ID_DEPTH:
        raise InvalidInput(f"{what} nests tuples more than {MAX_ID_DEPTH} deep")
    if set(map(type, value)) <= PLAIN_TYPES:
        return value
    items = []
    for item in value:
        kind = type(item)
        if kind in PLAIN_TYPES or item is None:
            items.append(item)
        elif kind is tuple:
            items.append(_plain_tuple(item, what, depth + 1))
        elif kind in _NUMPY:
            items.append(_NUMPY[kind](item))
        else:
            raise InvalidInput(f"{what} holds {describe(item)}; a tuple id holds {_RULE}, or None")
    return tuple(items)


def _message(value: Any, what: str, allow_none: bool) -> str:
    """Why ``value`` is refused as ``what``."""
    if value is None:
        return f"{what} must be {_RULE}, not None"
    rule = f"{_RULE} or None" if allow_none else _RULE
    if getattr(type(value), "__hash__", None) is None:
        return f"{what} must be hashable and plain: {rule}; got {describe(value)}"
    return f"{what} must be {rule}; got {describe(value)}"
