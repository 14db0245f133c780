"""Snapshots with a host tier: host-resident blocks are saved with their tier and restored to the tiers that fit."""

from __future__ import annotations

import numpy as np
import pytest

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.core.shard_state import ShardState
from akv.core.step import StepRequest
from akv.storage.snapshot_reader import load_snapshot as read_snapshot
from akv.storage.snapshot_record import MEDIUM_DEVICE, MEDIUM_HOST

BS = 4
PROMPTS = [list(range(100 * i, 100 * i + 4 * BS + 1)) for i in range(8)]  # 4 full blocks each, all different


def tier_config(tmp_path, **overrides) -> KVCacheConfig:
    fields = dict(
        num_blocks=24,
        block_size=BS,
        storage="none",
        host_blocks=24,
        vocab_size=1000,
        low_watermark=0.0,
        high_watermark=0.0,
        debug_invariants=True,
    )
    return KVCacheConfig(**{**fields, **overrides})


async def fill(kv: KVCacheManager) -> None:
    """Cache every prompt once; the device holds 24 blocks, so the first ones are demoted to the host."""
    for i, prompt in enumerate(PROMPTS):
        await kv.step(admits=[Admit(seq_id=i, prompt=prompt, prefill_done=True)])
        await kv.free(i)


@pytest.mark.anyio
async def test_host_blocks_are_saved_with_their_tier_and_load_back_where_they_fit(tmp_path) -> None:
    cfg = tier_config(tmp_path)
    async with KVCacheManager(cfg) as kv:
        await fill(kv)
        before = await kv.stats()
        assert before.host_cached > 0 and before.cached > 0
        hits = [await kv.lookup(p) for p in PROMPTS]
        await kv.save_snapshot(tmp_path / "snap")
    snap = read_snapshot(str(tmp_path / "snap"), cfg.fingerprint())
    media = np.bincount(snap.blocks.medium, minlength=2)
    assert (media[MEDIUM_DEVICE], media[MEDIUM_HOST]) == (before.cached, before.host_cached)
    async with KVCacheManager(cfg) as kv:
        loaded = await kv.load_snapshot(tmp_path / "snap")
        assert loaded.loaded_blocks == snap.blocks.num_blocks
        assert [await kv.lookup(p) for p in PROMPTS] == hits
        after = await kv.stats()
        assert after.cached + after.host_cached == before.cached + before.host_cached
        await kv.check()
        # a hit on a restored host block is promoted and served
        result = await kv.step(admits=[Admit(seq_id="again", prompt=PROMPTS[0], prefill_done=True)])
        assert result.cached_tokens["again"] == 4 * BS
        await kv.check()


@pytest.mark.anyio
async def test_a_pool_without_a_host_tier_loads_the_hottest_blocks_that_fit(tmp_path) -> None:
    cfg = tier_config(tmp_path)
    async with KVCacheManager(cfg) as kv:
        await fill(kv)
        await kv.save_snapshot(tmp_path / "snap")
    small = tier_config(tmp_path, host_blocks=0)
    async with KVCacheManager(small) as kv:
        loaded = await kv.load_snapshot(tmp_path / "snap")
        assert 0 < loaded.loaded_blocks <= small.num_blocks and loaded.dropped_blocks > 0
        # the most recently cached prompts (device-resident when saved) are the ones kept
        assert await kv.lookup(PROMPTS[-1]) == 4 * BS
        assert await kv.lookup(PROMPTS[0]) == 0
        await kv.check()


def test_a_held_host_block_is_not_promoted_while_a_save_reads_it() -> None:
    """A save holds exported blocks; an admission stops its hits before a held host block (promotion would free it)."""
    shard = ShardState(0, range(0, 16), BS, null_block_id=16, host_ids=range(17, 33), eviction_policy="lru")
    for i in (0, 1):
        prompt = np.array(PROMPTS[i], dtype=np.int32)
        shard.step(StepRequest(admits=[Admit(seq_id=i, prompt=prompt, prefill_done=True)]))
        shard.step(StepRequest(frees=[i]))
    assert shard.evict(4) == 4  # the least recently used chain, the first prompt's, goes to the host
    first = np.array(PROMPTS[0], dtype=np.int32)
    path = shard.tree.match(shard.namespace_key(None), first[: 4 * BS])
    assert len(path) == 4 and all(shard.tree.is_host(b) for b in path)  # the whole chain is on the host
    export = shard.export_snapshot(hold=True)
    assert export.on_host.sum() == shard.host.num_cached
    out = shard.step(StepRequest(admits=[Admit(seq_id="y", prompt=first)]))
    assert out.cached_tokens["y"] == 0 and not out.promotes
    shard.check()
    shard.release_hold()
    shard.step(StepRequest(frees=["y"]))
    out = shard.step(StepRequest(admits=[Admit(seq_id="z", prompt=first)]))
    shard.check()
    assert out.cached_tokens["z"] == 4 * BS and len(out.promotes) == 4
