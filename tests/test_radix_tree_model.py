"""The run-compressed RadixTree against a plain per-block model, as a hypothesis state machine.

The model is the tree's contract in its plainest form: a dict from
``(parent block | root, block token bytes)`` to the block id, one block per
entry, no runs. Chains are drawn as prefixes of cached paths plus new blocks,
so runs are split inside (divergence midway), extended in place (a childless
run continued) and walked under other block ids (the chain stops); batches of
victims are tails of cached paths (bulk truncation), random ids and inner
blocks (refusals). Every rule applies to both; the invariants compare every
block's path, chain, leaf flag and the tree's own consistency check.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from akv.core.radix_tree import RadixTree

BS = 2
MAX_ID = 48
NAMESPACES = (("s0", None), ("s0", "tenant-b"))
TOKENS = st.integers(0, 2)  # few token values: equal blocks under different prefixes are common


def key(t: int) -> bytes:
    """One block of tokens ``(t, 0)`` as the tree's int32 LE bytes."""
    return np.array([t, 0], dtype="<i4").tobytes()


class PlainModel:
    """``(parent, token bytes) -> block``; a namespace's root is ``("root", namespace)``."""

    def __init__(self) -> None:
        self.child: dict[tuple[object, bytes], int] = {}
        self.parent: dict[int, object] = {}
        self.key: dict[int, bytes] = {}

    def insert(self, namespace, parent: int | None, keys: list[bytes], ids: list[int], single: bool = False) -> int:
        """``RadixTree.insert``; with ``single``, one item of ``insert_blocks`` (a negative id fails only when added)."""
        if parent is not None and parent not in self.parent:
            return 0
        if not single and any(b < 0 for b in ids):
            raise ValueError("negative block id")
        node, done = ("root", namespace) if parent is None else parent, 0
        for k, b in zip(keys, ids):
            found = self.child.get((node, k))
            if found is None:
                break
            if found != b:
                return done
            node, done = b, done + 1
        new = ids[done:]
        if any(b in self.parent or b < 0 for b in new) or len(set(new)) != len(new):
            raise ValueError("already in the prefix cache elsewhere, or listed twice")
        for k, b in zip(keys[done:], new):
            self.child[(node, k)] = b
            self.parent[b] = node
            self.key[b] = k
            node = b
        return len(ids)

    def match(self, namespace, keys: list[bytes], below: int | None) -> list[int]:
        if below is not None and below not in self.parent:
            return []
        node, out = ("root", namespace) if below is None else below, []
        for k in keys:
            node = self.child.get((node, k))
            if node is None:
                break
            out.append(node)
        return out

    def is_leaf(self, b: int) -> bool:
        return b in self.parent and all(p != b for p in self.parent.values())

    def remove_leaves(self, ids: list[int]) -> tuple[list[int], list[int]]:
        removed, refused = [], []
        for b in ids:
            if not self.is_leaf(b):
                refused.append(b)
                continue
            del self.child[(self.parent.pop(b), self.key.pop(b))]
            removed.append(b)
        return removed, refused

    def path(self, b: int) -> tuple[object, list[int]]:
        out, node = [], b
        while isinstance(node, int):
            out.append(node)
            node = self.parent[node]
        return node[1], out[::-1]


class RadixTreeMachine(RuleBasedStateMachine):
    """Random inserts, single-block inserts, matches and removals on the tree and the model."""

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(BS)
        self.model = PlainModel()

    def _state(self) -> tuple:
        return sorted(self.tree.block_ids()), {b: self.tree.path(b) for b in self.tree.block_ids()}

    def _chain(self, data, fresh_ids: bool) -> tuple[object, int | None, list[bytes], list[int]]:
        """A chain below a drawn place: part of a cached path (its ids, maybe one replaced), then new blocks."""
        cached = sorted(self.model.parent)
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        parent, keys, ids = None, [], []
        if cached and data.draw(st.booleans(), label="along a cached path"):
            ns, path = self.model.path(data.draw(st.sampled_from(cached), label="cached block"))
            cut = data.draw(st.integers(0, len(path)), label="parent depth")
            parent = path[cut - 1] if cut else None
            take = data.draw(st.integers(0, len(path) - cut), label="cached blocks walked")
            ids = path[cut : cut + take]
            keys = [self.model.key[b] for b in ids]
            if ids and data.draw(st.integers(0, 3), label="rename one") == 0:  # same tokens, another id
                ids[data.draw(st.integers(0, len(ids) - 1), label="renamed")] = self._fresh(data, ids)
        elif cached and data.draw(st.integers(0, 4), label="random parent") == 0:
            parent = data.draw(st.integers(0, MAX_ID), label="parent")
        more = data.draw(st.lists(TOKENS, max_size=6), label="new block tokens")
        keys += [key(t) for t in more]
        for _ in more:
            if fresh_ids or data.draw(st.integers(0, 5), label="odd id"):
                ids.append(self._fresh(data, ids))
            else:  # an id in the tree already, listed twice, or negative
                ids.append(data.draw(st.sampled_from([*cached, *ids, -1]), label="odd block id"))
        return ns, parent, keys, ids

    def _fresh(self, data, taken: list[int]) -> int:
        free = [b for b in range(MAX_ID + 1) if b not in self.model.parent and b not in taken]
        return data.draw(st.sampled_from(free), label="fresh id") if free else MAX_ID + 1 + len(taken)

    @rule(data=st.data(), fresh_ids=st.booleans(), as_array=st.booleans())
    def insert(self, data, fresh_ids: bool, as_array: bool) -> None:
        ns, parent, keys, ids = self._chain(data, fresh_ids)
        tokens = b"".join(keys)
        if as_array:  # callers pass int32 token arrays and block-id arrays too
            tokens, ids_arg = np.frombuffer(tokens, dtype="<i4"), np.array(ids, dtype=np.int64)
        else:
            ids_arg = ids
        try:
            want = self.model.insert(ns, parent, keys, ids)
        except ValueError:
            before = self._state()
            with pytest.raises(ValueError):
                self.tree.insert(ns, parent, tokens, ids_arg)
            assert self._state() == before
        else:
            assert self.tree.insert(ns, parent, tokens, ids_arg) == want

    @rule(data=st.data())
    def insert_blocks(self, data) -> None:
        items = []
        for _ in range(data.draw(st.integers(0, 5), label="items")):
            ns, parent, keys, ids = self._chain(data, fresh_ids=data.draw(st.booleans()))
            if keys:  # the first block of the drawn chain, below its parent
                items.append((ns, parent, keys[0], ids[0]))
            elif parent is not None and parent in self.model.parent:  # a decode step: one block below a cached one
                items.append((self.model.path(parent)[0], parent, key(data.draw(TOKENS)), self._fresh(data, [])))
        saved = (dict(self.model.child), dict(self.model.parent), dict(self.model.key))
        try:
            want = [self.model.insert(ns, p, [k], [b], single=True) for ns, p, k, b in items]
        except ValueError:
            self.model.child, self.model.parent, self.model.key = saved
            before = self._state()
            with pytest.raises(ValueError):
                self.tree.insert_blocks(items)
            assert self._state() == before
        else:
            assert self.tree.insert_blocks(items) == want

    @rule(data=st.data(), use_below=st.booleans())
    def match(self, data, use_below: bool) -> None:
        ns, parent, keys, _ = self._chain(data, fresh_ids=True)
        below = parent if use_below else None
        if not use_below and parent is not None and parent in self.model.parent:
            ns, path = self.model.path(parent)  # match the whole prefix from the root instead
            keys = [self.model.key[b] for b in path] + keys
        want = self.model.match(ns, keys, below)
        assert self.tree.match(ns, b"".join(keys), below) == want
        if below is None:
            assert self.tree.lookup(ns, b"".join(keys)) == len(want)

    @precondition(lambda self: self.model.parent)
    @rule(data=st.data())
    def remove_tails(self, data) -> None:
        """Victims in eviction order: tails of cached paths, deepest first, several paths in a row."""
        victims = []
        for _ in range(data.draw(st.integers(1, 3), label="paths")):
            _, path = self.model.path(data.draw(st.sampled_from(sorted(self.model.parent)), label="tail of"))
            victims += path[::-1][: data.draw(st.integers(1, len(path)), label="tail length")]
        assert self.tree.remove_leaves(victims) == self.model.remove_leaves(victims)

    @rule(ids=st.lists(st.integers(-2, MAX_ID + 2), max_size=12))
    def remove_random(self, ids: list[int]) -> None:
        assert self.tree.remove_leaves(ids) == self.model.remove_leaves(ids)

    @rule(data=st.data())
    def ancestors(self, data) -> None:
        """The blocks above a drawn set (shared prefixes, blocks inside runs) are each path's blocks above, once."""
        cached = sorted(self.model.parent)
        ids = data.draw(st.lists(st.sampled_from(cached), max_size=8), label="pinned") if cached else []
        grouped = data.draw(st.booleans(), label="as an array: grouped by run with numpy")
        arg = np.array(ids, dtype=np.int64) if grouped else ids
        assert self.tree.ancestors(arg) == {a for b in ids for a in self.model.path(b)[1][:-1]}
        order = self.tree.ancestry(arg)  # them and their ancestors, each before its parent
        assert sorted(order) == sorted({a for b in ids for a in self.model.path(b)[1]})
        place = {b: k for k, b in enumerate(order)}
        assert all(place[b] < place[self.model.parent[b]] for b in order if self.model.parent[b] in place)

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.tree.check()
        assert len(self.tree) == len(self.model.parent)
        assert self.tree.block_ids() == sorted(self.model.parent)
        for b in self.model.parent:
            ns, path = self.model.path(b)
            assert self.tree.path(b) == path
            assert self.tree.chain(b) == (ns, b"".join(self.model.key[x] for x in path))
            assert self.tree.is_leaf(b) == self.model.is_leaf(b)
        for b in (-1, MAX_ID + 3):
            assert b not in self.tree and not self.tree.is_leaf(b)


RadixTreeMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestRadixTreeMachine = RadixTreeMachine.TestCase
