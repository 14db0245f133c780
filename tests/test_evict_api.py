"""``await kv.evict(max_blocks)``: cached leaves now, in policy order, exact counts, never a referenced block.

Each test runs a real manager (actors on anyio, tiny model, block_size 4) with
the eviction loop off (``tiny_config``: low watermark 0), so every eviction is
the one the test asked for, and ends with ``await kv.check()``.
"""

from __future__ import annotations

import numpy as np
import pytest

from akv import KVCacheManager
from akv.errors import InvalidInput
from tests.manager_helpers import publish, state_view
from tests.placement import on_shard

pytestmark = pytest.mark.anyio

A = list(range(9))  # 3 blocks, 2 full (published), 1 partial
B = list(range(100, 109))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


async def test_evict_takes_least_recently_released_deepest_first_with_exact_counts(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await publish(kv, "a", A)
        await publish(kv, "b", B)
        before = await kv.stats()
        assert (before.free, before.cached) == (12, 4)

        assert await kv.evict(1) == 1  # a's deepest block
        assert (await kv.lookup(A), await kv.lookup(B)) == (4, 8)
        assert await kv.evict(2) == 2  # a's first block, then b's deepest
        assert (await kv.lookup(A), await kv.lookup(B)) == (0, 4)
        after = await kv.stats()
        assert (after.free, after.cached, after.prefix_cache_blocks) == (15, 1, 1)
        assert after.blocks_evicted - before.blocks_evicted == 3
        assert after.eviction_loop_batches == 0  # the loop did none of it

        assert await kv.evict(10) == 1  # only one is left
        assert await kv.evict(10) == 0
        assert (await kv.stats()).cached == 0
        await kv.check()


@pytest.mark.parametrize(("policy", "survivor"), [("lru", B), ("lfu", A)])
async def test_evict_follows_the_configured_policy(tiny_config, policy: str, survivor: list[int]) -> None:
    async with KVCacheManager(tiny_config(eviction_policy=policy)) as kv:
        await publish(kv, "a", A)
        for i in range(2):  # a's blocks get two more hits
            await kv.add_sequence(f"a{i}", A)
            await kv.free(f"a{i}")
        await publish(kv, "b", B)  # b released last, with no hits
        assert await kv.evict(2) == 2
        assert await kv.lookup(survivor) == 8
        assert await kv.lookup(A if survivor is B else B) == 0
        await kv.check()


async def test_evict_never_takes_a_referenced_block(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await publish(kv, "a", A, free=False)  # live: its published blocks are referenced
        await publish(kv, "b", B)
        assert await kv.evict(0) == 0
        assert await kv.evict(100) == 2  # b's two cached blocks, nothing of a's
        assert await kv.lookup(A) == 8
        assert await kv.lookup(B) == 0
        stats = await kv.stats()
        assert (stats.active, stats.cached, stats.free) == (3, 0, 13)
        assert (await kv.sequence("a")).num_published_blocks == 2
        await kv.free("a")
        assert await kv.evict(100) == 2
        await kv.check()


async def test_evict_across_shards(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_shards=2)) as kv:
        for i in range(4):  # placed by their first block: two on each shard
            await publish(kv, f"s{i}", on_shard(i % 2, 9, 2, start=200 + 100 * i))
        assert [shard.snapshot.cached for shard in kv._shards] == [4, 4]
        assert (await kv.stats()).cached == 8
        assert await kv.evict(np.int64(5)) == 5
        assert (await kv.stats()).cached == 3
        assert await kv.evict(5) == 3
        after = await kv.stats()
        assert (after.cached, after.free, after.prefix_cache_blocks) == (0, 16, 0)
        await kv.check()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None, [1]])
async def test_evict_refuses_bad_max_blocks_and_changes_nothing(tiny_config, bad) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await publish(kv, "a", A)
        before = state_view(await kv.stats())
        with pytest.raises(InvalidInput, match="max_blocks"):
            await kv.evict(bad)
        assert state_view(await kv.stats()) == before
        await kv.check()
