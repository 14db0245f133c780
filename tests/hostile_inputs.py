"""Caller-side objects that misbehave: hostile ids, collections and mappings for the input-validation tests.

Most raise from the method their docstring names, as a buggy or hostile
caller's object would; akv must answer each with a typed error, and no actor
may ever run their code. ``ItemsMapping`` lets a test pass such keys in a
mapping without hashing them itself.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping


class BadEq:
    """Hashes like a live id; its ``__eq__`` raises (a dict lookup that collides calls it)."""

    def __init__(self, like: object = "a") -> None:
        self.like = like

    def __hash__(self) -> int:
        return hash(self.like)

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("BadEq.__eq__")


class BadHash:
    """Its ``__hash__`` raises ValueError."""

    def __hash__(self) -> int:
        raise ValueError("BadHash.__hash__")


class BadStr(str):
    """A str subclass whose ``__eq__`` and ``__hash__`` raise."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("BadStr.__eq__")

    def __hash__(self) -> int:
        raise RuntimeError("BadStr.__hash__")


class BadRepr:
    """Its ``__repr__`` raises (error messages must not call it unguarded)."""

    def __repr__(self) -> str:
        raise RuntimeError("BadRepr.__repr__")


class RaisingInt(int):
    """An int subclass whose ``__int__`` and ``__index__`` raise."""

    def __int__(self) -> int:
        raise RuntimeError("RaisingInt.__int__")

    def __index__(self) -> int:
        raise RuntimeError("RaisingInt.__index__")


class RaisingIter:
    """A collection whose iteration raises."""

    def __iter__(self) -> Iterator:
        raise RuntimeError("RaisingIter.__iter__")


class RaisingLen(list):
    """A list whose ``__len__`` raises (``list(x)`` asks for it first)."""

    def __len__(self) -> int:
        raise RuntimeError("RaisingLen.__len__")


class RaisingMapping(Mapping):
    """A mapping whose iteration raises."""

    def __getitem__(self, key: object) -> object:
        raise KeyError(key)

    def __iter__(self) -> Iterator:
        raise RuntimeError("RaisingMapping.__iter__")

    def __len__(self) -> int:
        return 1


class ItemsMapping(Mapping):
    """A mapping kept as a list of pairs, so the test itself never hashes or compares its keys."""

    def __init__(self, items: list[tuple[object, object]]) -> None:
        self._items = items

    def __getitem__(self, key: object) -> object:
        for k, v in self._items:
            if k is key:
                return v
        raise KeyError("not found")

    def __iter__(self) -> Iterator:
        return iter([k for k, _ in self._items])

    def __len__(self) -> int:
        return len(self._items)


class Color(enum.IntEnum):
    """An ``IntEnum``: an int subclass, so not a plain id."""

    RED = 1
