"""ShardState export, holds and import (akv.core.shard_export), without actors."""

from __future__ import annotations

import numpy as np
import pytest

from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepRequest
from akv.errors import InvalidInput

BS = 4


def cached_shard(num_blocks: int = 16) -> ShardState:
    """A shard whose blocks hold two finished prompts of 3 full blocks each (6 cached blocks)."""
    state = ShardState(0, range(num_blocks), BS)
    for i in range(2):
        prompt = np.arange(1 + 20 * i, 14 + 20 * i, dtype=np.int32)
        state.step(StepRequest(admits=[Admit(seq_id=i, prompt=prompt)]))
        state.step(StepRequest(commits={i: len(prompt)}))
        state.step(StepRequest(frees=(i,)))
    return state


def test_export_lists_every_published_block_parents_first() -> None:
    state = cached_shard()
    export = state.export_snapshot(hold=False)
    assert sorted(export.block_ids.tolist()) == state.tree.block_ids()
    for row, up in enumerate(export.parent.tolist()):
        assert up < row
        path = state.tree.path(int(export.block_ids[row]))
        assert (up < 0) == (len(path) == 1)
        if up >= 0:
            assert int(export.block_ids[up]) == path[-2]
    order = state.pool.eviction_order()
    assert [int(export.block_ids[r]) for r in np.argsort(export.last_release)] == order


def test_held_blocks_are_not_evicted_and_keep_their_place() -> None:
    state = cached_shard(num_blocks=8)
    order = state.pool.eviction_order()
    export = state.export_snapshot(hold=True)
    with pytest.raises(InvalidInput, match="already running"):
        state.export_snapshot(hold=True)
    assert state.evict(8) == 0 and state.evictable_now() == 0
    out = state.step(StepRequest(admits=[Admit(seq_id="big", prompt=np.arange(100, 113, dtype=np.int32))]))
    assert "big" in out.rejected  # 4 blocks needed, 2 free, the 6 cached ones held
    state.check()
    assert state.pool.eviction_order() == order
    state.release_hold(export.block_ids[:3].tolist())
    state.release_hold()
    assert state.evict(8) == 6
    state.check()


def test_import_restores_the_tree_and_order_and_refuses_a_busy_shard() -> None:
    source = cached_shard()
    export = source.export_snapshot(hold=False)
    target = ShardState(0, range(16), BS)
    ids = target.import_reserve(export.tokens)
    assert target.lookup(None, np.arange(1, 14, dtype=np.int32)) == 0  # not matchable before publishing
    target.check()
    loaded = target.import_publish(
        ids, export.parent, export.namespaces, export.num_hits, export.last_release, export.tokens
    )
    assert loaded == len(ids) == 6
    target.check()
    assert target.lookup(None, np.arange(1, 14, dtype=np.int32)) == 3
    again = target.import_reserve(export.tokens)
    assert (
        target.import_publish(
            again, export.parent, export.namespaces, export.num_hits, export.last_release, export.tokens
        )
        == 0
    )
    target.check()
    assert target.pool.num_cached == 6 and target.pool.num_free == 10
    back = target.export_snapshot(hold=False)
    order = back.tokens[np.argsort(back.last_release)]
    assert np.array_equal(order, export.tokens[np.argsort(export.last_release)])  # the same eviction order
    target.step(StepRequest(admits=[Admit(seq_id="live", prompt=np.array([1, 2], dtype=np.int32))]))
    with pytest.raises(InvalidInput, match="live"):
        target.import_reserve(export.tokens)
    aborted = ShardState(0, range(16), BS)
    aborted.import_abort(aborted.import_reserve(export.tokens))
    aborted.check()
    assert aborted.pool.num_free == 16
