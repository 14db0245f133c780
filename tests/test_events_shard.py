"""The shard's event helpers: ``KeyIndex.stored_below`` against ``stored_events``, and a reset's events."""

from __future__ import annotations

import numpy as np
import pytest

from akv.core.cache_reset import retire_blocks
from akv.core.shard_state import ShardState
from akv.errors import InvalidInput
from akv.events.key_index import KeyIndex
from akv.events.shard_events import ShardEvents
from akv.events.types import AllBlocksCleared, BlockRemoved


def _indexes(n: int, bs: int) -> tuple[KeyIndex, KeyIndex, np.ndarray]:
    rows = np.random.default_rng(0).integers(0, 1000, (2 * n, bs)).astype(np.int32)
    a, b = KeyIndex(4 * n, bs), KeyIndex(4 * n, bs)
    namespaces = [None if i % 2 else ("t", i % 3) for i in range(n)]
    for index in (a, b):
        index.stored(list(range(n)), [None] * n, rows[:n], namespaces)
    return a, b, rows


def test_stored_below_equals_stored_events() -> None:
    n, bs = 9, 4
    a, b, rows = _indexes(n, bs)
    ids, parents = list(range(n, 2 * n)), list(range(n))
    namespaces = [None if i % 2 else ("t", i % 3) for i in range(n)]
    slow = a.stored_events(ids, parents, rows[n:], namespaces)
    fast = b.stored_below(ids, parents, rows[n:], namespaces, "device")
    assert fast == slow
    assert list(a.cached()) == list(b.cached())


def test_stored_below_refuses_an_unstored_parent_and_indexes_nothing() -> None:
    n, bs = 3, 4
    _, b, rows = _indexes(n, bs)
    before = list(b.cached())
    with pytest.raises(InvalidInput):
        b.stored_below([n, n + 1], [0, 2 * n + 1], rows[:2], [None, None], "device")
    with pytest.raises(InvalidInput):
        b.stored_below([0], [1], rows[:1], [None], "device")  # block 0 is stored already
    assert list(b.cached()) == before


def test_retire_one_namespace_then_all_emits_removed_then_cleared() -> None:
    state = ShardState(0, range(0, 16), 4)
    events = ShardEvents(state)
    tree = state.tree
    rows = np.arange(1, 33, dtype=np.int32).reshape(8, 4)
    state.block_tokens[:8] = rows
    for ns, ids in (("a", [0, 1]), (None, [2, 3])):
        tree.insert(state.namespace_key(ns), None, rows[ids[0] : ids[-1] + 1], ids)
        state.pool.allocate(2)
        state.pool.mark_published(ids)
        state.pool.decref(ids, distinct=True)  # cached, unreferenced
        events.changed([], ids)
    retired, freed = retire_blocks(state, "a")
    assert sorted(retired) == [0, 1] and freed == 2
    removed = events.retired(retired, "removed")
    assert [type(e) for e in removed] == [BlockRemoved] and len(removed[0].block_hashes) == 2
    retired, freed = retire_blocks(state)
    assert retired == [3, 2] and freed == 2
    assert events.retired(retired, "cleared") == [AllBlocksCleared()]
    assert len(events.keys) == 0 and len(tree) == 0
    state.check()
