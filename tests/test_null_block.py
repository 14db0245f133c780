"""The null block: block-table padding points at block ``num_blocks``, never allocated, cached or evicted.

A model runner may read the padding and write garbage through it (vLLM's
null block convention); no real block's K/V may change. Real managers (actors
on anyio, tiny model, block_size 4), real CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.errors import ActorCrashed, InvalidInput
from akv.storage import KVStorage
from tests.manager_helpers import BS, Runner, publish

pytestmark = pytest.mark.anyio

LONG = list(range(1, 12))  # 3 blocks
SHORT = list(range(500, 503))  # 1 block


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("storage", ["tensors", "none"])
async def test_short_row_is_padded_with_the_null_block(tiny_config, num_shards: int, storage: str) -> None:
    config = tiny_config(num_shards=num_shards, storage=storage)
    async with KVCacheManager(config) as kv:
        result = await kv.step(admits=[Admit(seq_id="long", prompt=LONG), Admit(seq_id="short", prompt=SHORT)])
        assert result.seq_ids == ("long", "short")
        tables = result.block_tables.tolist()
        long_ids = list((await kv.sequence("long")).block_ids)
        short_ids = list((await kv.sequence("short")).block_ids)
        assert tables == [long_ids, [*short_ids, 16, 16]]
        assert 16 not in [*long_ids, *short_ids]
        assert result.slot_mapping.max() < config.num_blocks * BS  # no new token's slot is in the null block
        if num_shards == 2:  # the rows came from different shards and were padded when merged
            assert (await kv.sequence("long")).shard != (await kv.sequence("short")).shard
        assert kv.null_block_id == config.null_block_id == config.num_blocks == 16
        await kv.check()


async def test_writing_garbage_through_the_padding_changes_no_real_block(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=12)) as kv:
        runner = Runner(kv)
        await runner.admit("a", list(range(1, 10)))  # 3 blocks, the first is block 0
        await runner.admit("b", list(range(1, 6)))  # hits a's first block
        await runner.fork("b", ["c"])
        await runner.admit("d", [700])
        result = await runner.append({"a": [11], "c": [12], "d": [13]})
        tables = result.block_tables
        held = torch.arange(tables.shape[1]) < (result.context_lens.to(torch.int64)[:, None] + BS - 1) // BS
        padding = tables[~held].unique()
        assert padding.numel() == 1  # d's row (and c's) is padded, with one block id
        storage = kv.storage
        real = [cache[:, : kv.config.num_blocks].clone() for cache in storage.kv_caches]
        slots = torch.arange(BS, dtype=torch.int64) + padding[0].to(torch.int64) * BS
        torch.manual_seed(0)
        for layer in range(storage.num_layers):
            garbage = torch.randn(BS, storage.num_kv_heads, storage.head_dim) * 1e6
            storage.write(layer, slots, garbage, -garbage)
        assert all(torch.equal(c[:, : kv.config.num_blocks], r) for c, r in zip(storage.kv_caches, real, strict=True))
        for sid in ("a", "b", "c", "d"):
            await runner.verify(sid)
        assert int(padding[0]) == kv.null_block_id == 12
        assert not torch.equal(storage.kv_caches[0][:, 12], torch.zeros_like(real[0][:, 0]))  # the garbage is there
        await kv.check()


async def test_the_null_block_is_never_allocated_and_not_counted(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        for i in range(4):
            await publish(kv, f"p{i}", [100 * i + t for t in range(1, 10)])  # 2 cached blocks each
        await kv.add_sequence("big", list(range(600, 632)))  # 8 blocks: every free one, no eviction
        stats = await kv.stats()
        assert (stats.num_blocks, stats.free + stats.active + stats.cached + stats.in_flight) == (16, 16)
        assert (stats.free, stats.cached, stats.active) == (0, 8, 8)
        assert kv.null_block_id not in (await kv.sequence("big")).block_ids
        assert await kv.evict(100) == 8
        assert (await kv.stats()).cached == 0
        assert kv.storage.kv_caches[0].shape[1] == 17  # 16 usable blocks and the null block
        await kv.check()


@pytest.mark.parametrize("corruption", ["table entry", "padding"])
async def test_check_finds_a_table_that_points_at_the_null_block_or_pads_with_a_real_one(
    tiny_config, corruption: str
) -> None:
    with pytest.raises(ActorCrashed, match="null block"):
        async with KVCacheManager(tiny_config()) as kv:
            await kv.add_sequence("a", SHORT)
            await kv.check()
            state = kv._shards[0].state
            row = state.sequences["a"].row
            if corruption == "table entry":
                state.tables.array[row, 0] = kv.config.num_blocks  # the null block
            else:
                state.tables.array[row, 1] = 5  # a real block where padding belongs
            await kv.check()


def test_storage_holds_the_null_block_after_the_usable_ones() -> None:
    config = KVCacheConfig(num_blocks=4, block_size=BS, vocab_size=1000)
    storage = KVStorage.from_config(config)
    assert storage.null_block_id == 4 and storage.kv_caches[0].shape[1] == 5
    assert storage.nbytes == config.pool_bytes == 5 * storage.bytes_per_block
    assert storage.null_slots == range(16, 20)
    key = torch.ones(BS, storage.num_kv_heads, storage.head_dim)
    storage.write(0, torch.tensor(list(storage.null_slots)), key, key)  # padding slots are writable
    assert bool((storage.kv_caches[0][:, :4] == 0).all())
    with pytest.raises(InvalidInput, match="slot_mapping out of range"):
        storage.write(0, torch.tensor([20]), key[:1], key[:1])
    with pytest.raises(InvalidInput, match="out of range"):
        storage.copy_blocks([4], [0])  # the null block is never copied
    with pytest.raises(InvalidInput, match="out of range"):
        storage.copy_blocks([0], [4])
