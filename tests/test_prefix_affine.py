"""Prefix-affine placement with several shards: the same first block goes to the same shard, and
``lookup`` asks that shard, so it predicts what ``add_sequence`` gets.

At 0a4c218 admissions were placed by free blocks only and ``lookup`` answered
the best shard's count: with 2 shards ``lookup`` promised 128 cached tokens
and ``add_sequence`` (placed on the emptier shard) got 0.
"""

from __future__ import annotations

import pytest

from akv import KVCacheConfig, KVCacheManager
from tests.placement import affine_shard, on_shard

pytestmark = pytest.mark.anyio

BS = 16


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every test of this module on asyncio and on trio."""
    return request.param


def config(num_shards: int, blocks_per_shard: int = 64) -> KVCacheConfig:
    """Metadata-only manager, block_size 16, eviction loop off."""
    return KVCacheConfig(
        num_blocks=blocks_per_shard * num_shards,
        block_size=BS,
        num_shards=num_shards,
        storage="none",
        low_watermark=0.0,
        high_watermark=0.0,
        debug_invariants=True,
    )


@pytest.mark.parametrize("num_shards", [2, 4])
async def test_lookup_promises_what_admission_gets_with_several_shards(num_shards: int) -> None:
    """a (8 full blocks and a token) stays live, so its shard is the fullest; b, the same prompt, gets
    all 128 cached tokens that lookup promised (0a4c218: lookup 128, add_sequence 0 on an emptier shard)."""
    async with KVCacheManager(config(num_shards)) as kv:
        prompt = list(range(1, 8 * BS + 2))
        assert await kv.add_sequence("a", prompt) == 0
        await kv.commit("a", len(prompt))
        promised = await kv.lookup(prompt)
        assert promised == 8 * BS
        assert await kv.add_sequence("b", prompt) == promised
        assert (
            (await kv.sequence("b")).shard
            == (await kv.sequence("a")).shard
            == affine_shard(prompt, num_shards, block_size=BS)
        )
        await kv.check()


async def test_prompts_sharing_a_first_block_share_a_shard_and_its_cache() -> None:
    """Eight prompts behind one 3-block system prompt, on 4 shards: all land on the system prompt's
    shard, each hits the 3 shared blocks, and lookup says so before each admission; the same tokens
    under another namespace are placed by that namespace's key (and hit nothing)."""
    async with KVCacheManager(config(4)) as kv:
        system = list(range(500, 500 + 3 * BS))
        home = affine_shard(system, 4, block_size=BS)
        await kv.add_sequence("sys", [*system, 1])
        await kv.commit("sys", 3 * BS + 1)
        for i in range(8):
            prompt = [*system, *range(10 * i, 10 * i + 20)]
            assert await kv.lookup(prompt) == 3 * BS
            assert await kv.add_sequence(f"r{i}", prompt) == 3 * BS
            assert (await kv.sequence(f"r{i}")).shard == home
        other = affine_shard(system, 4, block_size=BS, namespace=("lora", 1))
        assert await kv.lookup([*system, 2], namespace=("lora", 1)) == 0
        assert await kv.add_sequence("l", [*system, 2], namespace=("lora", 1)) == 0
        assert (await kv.sequence("l")).shard == other
        await kv.check()


async def test_a_prompt_whose_shard_cannot_hold_it_spills_and_lookup_says_so() -> None:
    """2 shards of 8 blocks: the cached prompt's shard is full with a live sequence, so a new admission
    of that prompt (5 blocks, counted whole: the manager does not know its hits) spills to the other
    shard; lookup, routed the same way, promises 0, not the 4 cached blocks. Once the shard has room
    again, both go back to it. An admission shorter than a block is placed by free blocks."""
    async with KVCacheManager(config(2, blocks_per_shard=8)) as kv:
        prompt = on_shard(0, 4 * BS + 1, 2, start=100, block_size=BS)
        await kv.add_sequence("a", prompt)
        await kv.commit("a", len(prompt))  # shard 0: 5 blocks, 4 of them published
        filler = on_shard(0, 3 * BS, 2, start=300, block_size=BS)
        await kv.add_sequence("f", filler)  # shard 0 full: 0 free, nothing cached
        assert await kv.lookup(prompt) == 0
        assert await kv.add_sequence("b", prompt) == 0
        assert (await kv.sequence("b")).shard == 1
        await kv.free("f")
        await kv.free("a")  # shard 0: 4 free, 4 cached: room for all 5 blocks again
        assert await kv.lookup(prompt) == 4 * BS
        assert await kv.add_sequence("c", prompt) == 4 * BS
        assert (await kv.sequence("c")).shard == 0
        await kv.free("b")  # shard 1 empty
        await kv.add_sequence("s", [1, 2, 3])  # shorter than a block: to the freer shard
        assert (await kv.sequence("s")).shard == 1
        await kv.check()


async def test_a_reservation_that_does_not_fit_its_shard_spills_and_lookup_over_promises() -> None:
    """The documented limit: lookup does not know ``max_new_tokens``; an admission whose reservation does
    not fit the affine shard spills to the freer shard and gets fewer tokens than lookup promised."""
    async with KVCacheManager(config(2, blocks_per_shard=8)) as kv:
        prompt = on_shard(1, 2 * BS + 1, 2, start=100, block_size=BS)
        await kv.add_sequence("a", prompt)
        await kv.commit("a", len(prompt))
        await kv.free("a")  # shard 1: 2 cached blocks, 6 free
        await kv.add_sequence("f", on_shard(1, 4 * BS, 2, start=300, block_size=BS))  # shard 1: 2 free, 2 cached
        assert await kv.lookup(prompt) == 2 * BS
        assert await kv.add_sequence("b", prompt, max_new_tokens=3 * BS) == 0  # 6 blocks > 4 there
        assert (await kv.sequence("b")).shard == 0
        await kv.check()
