"""A prefix-cache reset with a host tier: host blocks in the tree are retired and freed too."""

from __future__ import annotations

import numpy as np
import pytest

from akv.config import KVCacheConfig
from akv.core.cache_reset import retire_blocks
from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepRequest
from akv.manager import KVCacheManager


def _shard_with_host_blocks() -> ShardState:
    """A shard of 6 device blocks (2 tokens each) and 8 host blocks, with cached blocks on both tiers."""
    state = ShardState(0, range(0, 6), 2, null_block_id=6, host_ids=range(7, 15))
    for i, first in enumerate((1, 20, 40)):
        prompt = np.arange(first, first + 5, dtype=np.int32)  # 2 full blocks + 1 token
        state.step(StepRequest(admits=[Admit(seq_id=i, prompt=prompt, prefill_done=True)]))
        state.step(StepRequest(frees=[i]))
    state.evict(2)  # device leaves move to the host (some moved on demand already)
    assert state.host.num_cached >= 2 and state.host.num_cached + state.pool.num_cached == 6
    return state


def test_retire_all_frees_the_host_blocks_too() -> None:
    state = _shard_with_host_blocks()
    retired, freed = retire_blocks(state)
    assert len(retired) == 6 and freed == 6
    assert len(state.tree) == 0
    assert state.pool.num_free == 6 and state.host.num_free == 8
    state.check()


def test_retire_one_namespace_leaves_the_others_host_blocks() -> None:
    state = _shard_with_host_blocks()
    prompt = np.arange(60, 65, dtype=np.int32)
    state.step(StepRequest(admits=[Admit(seq_id="b", prompt=prompt, namespace="b", prefill_done=True)]))
    retired, _ = retire_blocks(state, None)
    assert len(retired) == 6 and len(state.tree) == 2  # namespace "b"'s two blocks stay
    assert state.host.num_free == 8
    state.check()


@pytest.mark.anyio
async def test_clear_and_bump_epoch_with_a_host_tier() -> None:
    cfg = KVCacheConfig(
        num_blocks=8, block_size=4, storage="none", host_blocks=16, low_watermark=0.0, high_watermark=0.0
    )
    async with KVCacheManager(cfg) as kv:
        for i in range(4):
            prompt = np.arange(100 * i + 1, 100 * i + 14, dtype=np.int32)
            await kv.add_sequence(f"s{i}", prompt, namespace=i % 2)
            await kv.commit(f"s{i}", len(prompt))
            await kv.free(f"s{i}")
        stats = await kv.stats()
        assert stats.host_cached > 0 and stats.cached > 0
        assert await kv.bump_epoch(1) == 6  # the two prompts of namespace 1, wherever their blocks are
        await kv.check()
        assert await kv.clear_prefix_cache() == 6
        await kv.check()
        stats = await kv.stats()
        assert (stats.cached, stats.free, stats.host_cached, stats.host_free) == (0, 8, 0, 16)
