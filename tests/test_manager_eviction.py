"""KVCacheManager eviction: on demand (exact order), under pressure in one pass, and the eviction loop.

Each test runs a real manager (actors on anyio, tiny model, block_size 4) and
ends with ``await kv.check()`` wherever the manager is still running. Hangs
are turned into failures with ``anyio.fail_after`` (a hang guard, never the
thing asserted); a module watchdog dumps the stacks and exits should a
shielded wait ever hang beyond it.
"""

from __future__ import annotations

from fractions import Fraction

import anyio
import numpy as np
import pytest
import structlog
import torch

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.errors import (
    InvalidInput,
)
from tests.eviction_passes import EvictionPasses
from tests.manager_helpers import (  # noqa: F401 - anyio_backend and watchdog are this module's fixtures
    anyio_backend,
    publish,
    state_view,
    watchdog,
)

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- eviction
async def test_on_demand_eviction_takes_least_recently_released_deepest_first(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        a = list(range(9))  # 3 blocks, 2 published
        b = list(range(100, 109))
        await publish(kv, "a", a)
        await publish(kv, "b", b)
        stats = await kv.stats()
        assert (stats.free, stats.cached, stats.prefix_cache_blocks) == (4, 4, 4)

        # 5 blocks with 4 free: exactly one eviction, a's deepest block.
        result = await kv.step(admits=[Admit(seq_id="c", prompt=list(range(200, 220)))])
        assert result.evicted_blocks == 1
        assert await kv.lookup(a) == 4
        assert await kv.lookup(b) == 8
        await kv.free("c")

        # 6 blocks with 5 free: a's remaining block goes next, before any of b's.
        result = await kv.step(admits=[Admit(seq_id="d", prompt=list(range(300, 324)))])
        assert result.evicted_blocks == 1
        assert await kv.lookup(a) == 0
        assert await kv.lookup(b) == 8
        await kv.free("d")
        # 7 blocks with 6 free: b's deepest block.
        result = await kv.step(admits=[Admit(seq_id="e", prompt=list(range(400, 428)))])
        assert result.evicted_blocks == 1
        assert await kv.lookup(b) == 4
        stats = await kv.stats()
        assert (stats.blocks_evicted, stats.eviction_batches, stats.free, stats.cached) == (3, 3, 0, 1)
        assert stats.eviction_loop_batches == 0  # the loop is off (low watermark 0)
        await kv.free("e")
        await kv.check()


async def _decode_under_pressure(config, single: bool) -> tuple:
    """A pool full of cached blocks, then one decode step whose 8 rows each start a block."""
    async with KVCacheManager(config) as kv:
        for i in range(8):  # fillers: 16 cached blocks, released oldest first
            await publish(kv, f"f{i}", list(range(500 + 8 * i, 508 + 8 * i)))
        decoders = [f"d{i}" for i in range(8)]  # 16 referenced blocks: the pool is full
        await kv.step(
            admits=[
                Admit(seq_id=d, prompt=list(range(8 * i, 8 * i + 8)), prefill_done=True) for i, d in enumerate(decoders)
            ]
        )
        assert (await kv.stats()).free == 0
        appends = {d: (900 + i if single else [900 + i]) for i, d in enumerate(decoders)}
        result = await kv.step(appends=appends)
        await kv.check()
        stats = await kv.stats()
        infos = [await kv.sequence(d) for d in decoders]
        fillers = [await kv.lookup([*range(500 + 8 * i, 508 + 8 * i), 0]) for i in range(8)]
        tables = result.block_tables.tolist()
        return (
            result.evicted_blocks,
            {k: type(v) for k, v in result.rejected.items()},
            [row[:2] for row in tables],  # the prompt blocks; which freed block a row gets may differ
            sorted(row[2] for row in tables),
            sorted(result.slot_mapping.tolist()),
            (stats.free, stats.active, stats.cached, stats.blocks_evicted),
            [(i.block_ids[:2], i.token_ids) for i in infos],
            fillers,
        )


@pytest.mark.parametrize("num_blocks", [32, 20])
async def test_decode_batch_under_pressure_evicts_exactly_what_one_sequence_at_a_time_would(
    tiny_config, num_blocks
) -> None:
    """A decode batch short of free blocks evicts the shortfall in one pass and ends exactly as the per-sequence path.

    One-int appends take the vectorized path; one-element lists take the
    general path, which evicts (or rejects) one sequence at a time. With 20
    blocks only 4 filler blocks stay cached, so 4 rows cannot get a block.
    """
    vectorized = await _decode_under_pressure(tiny_config(num_blocks=num_blocks), single=True)
    general = await _decode_under_pressure(tiny_config(num_blocks=num_blocks), single=False)
    assert vectorized == general
    if num_blocks == 32:
        assert vectorized[0] == 8  # exactly the 8 new blocks' worth, oldest fillers first
        assert vectorized[7] == [0, 0, 0, 0, 8, 8, 8, 8]
    else:
        assert (vectorized[0], len(vectorized[1])) == (4, 4)


async def test_decode_batch_copying_a_shared_tail_evicts_nothing_when_the_copies_fit(tiny_config) -> None:
    """A tail held by 3 rows of one decode batch is copied twice (the last holder writes in place).

    With exactly 2 free blocks the batch fits: no cached block may be evicted
    (counting one copy per holder would evict one).
    """
    async with KVCacheManager(tiny_config(num_blocks=6)) as kv:
        await publish(kv, "filler", list(range(500, 508)))  # 2 cached blocks
        await kv.step(admits=[Admit(seq_id="p", prompt=list(range(6)), prefill_done=True)])  # 2 blocks, tail partial
        await kv.fork("p", ["c1", "c2"])
        assert (await kv.stats()).free == 2
        result = await kv.step(appends={"p": 7, "c1": 8, "c2": 9})
        await kv.wait_copies()
        assert (result.evicted_blocks, result.rejected) == (0, {})
        assert len(result.copies.tickets) == 1 and result.copies.tickets[0].num_blocks == 2
        stats = await kv.stats()
        assert (stats.free, stats.cached) == (0, 2)
        for sid, tok in (("p", 7), ("c1", 8), ("c2", 9)):
            assert (await kv.sequence(sid)).token_ids == (0, 1, 2, 3, 4, 5, tok)
        await kv.check()


async def _admit_under_pressure(config, one_step: bool) -> tuple:
    """A pool full of cached blocks, then three admissions (one hitting a cached prefix) that must evict."""
    async with KVCacheManager(config) as kv:
        for i in range(8):  # fillers: 16 cached blocks, released oldest first
            await publish(kv, f"f{i}", list(range(500 + 8 * i, 508 + 8 * i)))
        await publish(kv, "hot", list(range(900, 909)))  # 2 more cached blocks, hit below
        prompts = {"a": list(range(0, 12)), "b": [*range(900, 908), 1, 2, 3], "c": list(range(40, 50))}
        admits = [Admit(seq_id=k, prompt=v) for k, v in prompts.items()]
        batches = [admits] if one_step else [[a] for a in admits]
        results = [await kv.step(admits=batch) for batch in batches]
        await kv.check()
        stats = await kv.stats()
        fillers = [await kv.lookup([*range(500 + 8 * i, 508 + 8 * i), 0]) for i in range(8)]
        return (
            sum(r.evicted_blocks for r in results),
            [dict(r.rejected) for r in results],
            [(await kv.sequence(k)).num_cached_tokens for k in prompts],
            fillers,
            (stats.free, stats.active, stats.cached, stats.blocks_evicted),
            stats.eviction_batches,
        )


@pytest.mark.parametrize(("num_blocks", "batches_apart"), [(20, 3), (24, 1)])
async def test_admissions_of_one_step_evict_in_one_pass_what_one_at_a_time_would(
    tiny_config, num_blocks, batches_apart
) -> None:
    """The step's admissions evict their whole shortfall in one pass (one
    eviction batch), and the same cached blocks as admitting them one step at a
    time; the prefix hit is protected either way.

    18 cached blocks, ``num_blocks - 18`` free; the admissions want 3 + 1 + 3
    new blocks ("b" hits 2 cached blocks).
    """
    together = await _admit_under_pressure(tiny_config(num_blocks=num_blocks), one_step=True)
    apart = await _admit_under_pressure(tiny_config(num_blocks=num_blocks), one_step=False)
    assert together[0] == apart[0] == 7 - (num_blocks - 18)
    assert (together[1], apart[1]) == ([{}], [{}, {}, {}])
    assert together[2] == apart[2] == [0, 8, 0]
    assert together[3:5] == apart[3:5]
    assert (together[5], apart[5]) == (1, batches_apart)


@pytest.mark.parametrize("prefill_done", [False, True])
async def test_a_later_admissions_hits_are_protected_from_an_earlier_ones_eviction(tiny_config, prefill_done) -> None:
    """Room made for admission A never evicts admission B's cached prefix,
    whether or not B is marked ``prefill_done`` (such admissions were matched
    only at their turn, after A had evicted B's prefix)."""
    async with KVCacheManager(tiny_config(num_blocks=20)) as kv:
        b = [(7 * i) % 1000 for i in range(17)]  # 4 full blocks + 1 token
        await publish(kv, "b0", b)
        await publish(kv, "c0", list(range(300, 356)))  # 14 blocks, cached after b's
        assert await kv.lookup(b) == 16
        result = await kv.step(
            admits=[
                Admit(seq_id="A", prompt=list(range(500, 548))),
                Admit(seq_id="B", prompt=b, prefill_done=prefill_done),
            ]
        )
        assert result.cached_tokens == {"A": 0, "B": 16}
        assert result.evicted_blocks == 11  # 12 + 1 new blocks, 2 free: only c's blocks go
        await kv.check()


async def test_an_admission_hits_what_an_earlier_prefill_done_admission_of_its_step_published(tiny_config) -> None:
    """As if admitted in turn: the second admission shares the first one's just-published blocks."""
    async with KVCacheManager(tiny_config(num_blocks=12)) as kv:
        p = list(range(1, 34))  # 9 blocks, 8 full
        result = await kv.step(admits=[Admit(seq_id=0, prompt=p, prefill_done=True), Admit(seq_id=1, prompt=p)])
        assert (result.cached_tokens, result.rejected) == ({0: 0, 1: 32}, {})
        assert (await kv.stats()).active == 10  # 9 blocks + the second prompt's own tail block
        await kv.check()


async def test_a_publish_two_admissions_earlier_is_still_seen(tiny_config) -> None:
    """A prefill_done admission, an unrelated one, then one sharing the first's prompt: the
    third hits the first's blocks in the same step as it would one step later."""
    for together in (True, False):
        async with KVCacheManager(tiny_config(num_blocks=64)) as kv:
            admits = [
                Admit(seq_id="A", prompt=list(range(1, 10)), prefill_done=True),
                Admit(seq_id="B", prompt=[9, 9, 9]),
                Admit(seq_id="C", prompt=list(range(1, 10))),
            ]
            cached: dict = {}
            for batch in [admits] if together else [[a] for a in admits]:
                cached.update((await kv.step(admits=batch)).cached_tokens)
            assert cached == {"A": 0, "B": 0, "C": 8}
            await kv.check()


async def test_prefix_hit_refreshes_recency(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        a, b = list(range(9)), list(range(100, 109))
        await publish(kv, "a", a)
        await publish(kv, "b", b)
        assert await kv.add_sequence("a2", a) == 8  # a hit: a's blocks leave the LRU order
        await kv.free("a2")  # and come back as the most recently released
        result = await kv.step(admits=[Admit(seq_id="c", prompt=list(range(200, 224)))])
        assert result.evicted_blocks == 2
        assert await kv.lookup(a) == 8
        assert await kv.lookup(b) == 0
        await kv.free("c")
        await kv.check()


async def test_lookup_has_no_side_effects(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        a, b = list(range(9)), list(range(100, 109))
        await publish(kv, "a", a)
        await publish(kv, "b", b)
        before = await kv.stats()
        lru_before = kv._shards[0].state.pool.lru_order()  # no public view of the LRU order
        for _ in range(5):
            assert await kv.lookup(a) == 8
            assert await kv.lookup([*a, 1, 2, 3, 4, 5]) == 8
            assert await kv.lookup(np.array(a[:5], dtype=np.int64)) == 4
            assert await kv.lookup(torch.tensor(a)) == 8
            assert await kv.lookup(a, namespace="tenant-b") == 0
        after = await kv.stats()
        assert state_view(after) == state_view(before)
        assert kv._shards[0].state.pool.lru_order() == lru_before
        # Behaviourally: a, though looked up last, is still the least recently used.
        result = await kv.step(admits=[Admit(seq_id="c", prompt=list(range(200, 224)))])
        assert result.evicted_blocks == 2
        assert await kv.lookup(a) == 0
        assert await kv.lookup(b) == 8
        await kv.free("c")
        await kv.check()


async def test_eviction_loop_relieves_pressure_in_batches(tiny_config, monkeypatch) -> None:
    """16 blocks, low watermark 4 free, high 8, batches of 2: the admission that leaves 3 free wakes
    the loop, which evicts 2 + 2 + 1 cached blocks, least recently released first."""
    passes = EvictionPasses(monkeypatch)
    prompts = [[100 * i + j for j in range(9)] for i in range(6)]  # 3 blocks each, 2 published at once
    with anyio.fail_after(60), structlog.testing.capture_logs() as logs:
        cfg = tiny_config(num_blocks=16, low_watermark=0.25, high_watermark=0.5, eviction_batch_blocks=2)
        async with KVCacheManager(cfg) as kv:
            for i in range(5):
                result = await kv.step(admits=[Admit(seq_id=f"s{i}", prompt=prompts[i], prefill_done=True)])
                assert result.cached_tokens == {f"s{i}": 0}
                await kv.free(f"s{i}")
            stats = await kv.stats()
            assert (stats.free, stats.cached, stats.eviction_loop_batches, passes.passes) == (6, 10, 0, [])
            await kv.step(admits=[Admit(seq_id="s5", prompt=prompts[5], prefill_done=True)])  # 3 free: below 4
            await passes.wait_refilled(0, 8)
            stats = await kv.stats()
            assert (stats.eviction_loop_batches, stats.eviction_loop_blocks, stats.blocks_evicted) == (3, 5, 5)
            assert (stats.free, stats.active, stats.cached, stats.prefix_cache_blocks) == (8, 3, 5, 7)
            assert [await kv.lookup(p) for p in prompts] == [0, 0, 4, 8, 8, 8]
            await kv.free("s5")
            stats = await kv.stats()
            assert (stats.free, stats.active, stats.cached, stats.eviction_loop_batches) == (9, 0, 7, 3)
            await kv.check()
    batches = [e for e in logs if e["event"] == "eviction.batch"]
    assert [e["blocks"] for e in batches] == [2, 2, 1]


async def test_with_a_host_tier_a_pass_demotes_its_whole_deficit_in_one_batch(tiny_config, monkeypatch) -> None:
    """The same pressure as above with a host tier and batches of 2: one batch of 5 demotions, one copy batch."""
    passes = EvictionPasses(monkeypatch)
    prompts = [[100 * i + j for j in range(9)] for i in range(6)]
    with anyio.fail_after(60), structlog.testing.capture_logs() as logs:
        cfg = tiny_config(
            num_blocks=16, low_watermark=0.25, high_watermark=0.5, eviction_batch_blocks=2, host_blocks=32
        )
        async with KVCacheManager(cfg) as kv:
            for i in range(5):
                await kv.step(admits=[Admit(seq_id=f"s{i}", prompt=prompts[i], prefill_done=True)])
                await kv.free(f"s{i}")
            await kv.step(admits=[Admit(seq_id="s5", prompt=prompts[5], prefill_done=True)])  # 3 free: below 4
            await passes.wait_for(lambda done: len(done) >= 1)  # held demotions are free once copied
            await kv.wait_copies()
            stats = await kv.stats()
            assert (stats.eviction_loop_batches, stats.eviction_loop_blocks, stats.demoted_blocks) == (1, 5, 5)
            assert [await kv.lookup(p) for p in prompts] == [8, 8, 8, 8, 8, 8]  # demoted ones hit on the host
            await kv.free("s5")
            await kv.check()
    batches = [e for e in logs if e["event"] == "eviction.batch"]
    assert [e["blocks"] for e in batches] == [5]
    copies = [e for e in logs if e["event"] == "tier.copy"]
    assert [e["to_host_blocks"] for e in copies] == [5]


def test_watermark_blocks_cap_the_headroom_and_scale_the_low_mark() -> None:
    cfg = KVCacheConfig(num_blocks=770_048, storage="none", low_watermark=0.02, high_watermark=0.05)
    assert cfg.watermark_blocks(40_000) == (800.0, 2000)  # under the cap: the fractions
    low, high = cfg.watermark_blocks(770_048)  # 38,503 wanted: capped at 2,048, low scaled alike
    assert high == 2048 and low == pytest.approx(0.02 * 770_048 * 2048 / 38_503)
    assert cfg.watermark_blocks(10) == (0.2, 1)
    assert KVCacheConfig(num_blocks=64, storage="none", max_headroom_blocks=2).watermark_blocks(64) == (0.64, 2)
    off = KVCacheConfig(num_blocks=64, storage="none", low_watermark=0.0, high_watermark=0.0)
    assert off.watermark_blocks(64) == (0.0, 0)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(InvalidInput, match="max_headroom_blocks must be a positive int"):
            KVCacheConfig(num_blocks=64, max_headroom_blocks=bad)
    for bad in (None, "0.05", True, float("nan"), -0.1, 1.5):
        with pytest.raises(InvalidInput, match="watermark"):
            KVCacheConfig(num_blocks=64, high_watermark=bad)
    # Rounding never puts the low mark above the high one.
    same = KVCacheConfig(num_blocks=64, storage="none", low_watermark=0.05, high_watermark=0.05, max_headroom_blocks=7)
    assert same.watermark_blocks(1000) == (7, 7)
    assert KVCacheConfig(num_blocks=100, storage="none", low_watermark=0.07, high_watermark=0.07).watermark_blocks(
        100
    ) == (7, 7)
    real = KVCacheConfig(num_blocks=100, storage="none", low_watermark=np.float32(0.25), high_watermark=Fraction(1, 2))
    assert real.watermark_blocks(100) == (25.0, 50)
    assert KVCacheConfig(num_blocks=100, storage="none", low_watermark=-0.0, high_watermark=0).watermark_blocks(
        100
    ) == (0.0, 0)
    for bad in (0, -5, 2.0, True):
        with pytest.raises(InvalidInput, match="shard_blocks must be a positive int"):
            cfg.watermark_blocks(bad)


async def test_eviction_loop_keeps_at_most_max_headroom_blocks_free(tiny_config, monkeypatch) -> None:
    """With the high watermark at 50 % of 16 blocks but a cap of 3, the loop
    refills to 3 free blocks and leaves the rest cached."""
    passes = EvictionPasses(monkeypatch)
    with anyio.fail_after(60):
        cfg = tiny_config(num_blocks=16, low_watermark=0.25, high_watermark=0.5, max_headroom_blocks=3)
        async with KVCacheManager(cfg) as kv:
            for i in range(6):
                await kv.step(admits=[Admit(seq_id=f"s{i}", prompt=[100 * i + j for j in range(9)], prefill_done=True)])
                await kv.free(f"s{i}")
            assert ((await kv.stats()).free, passes.passes) == (4, [])  # never below the low mark of 1.5
            await kv.step(admits=[Admit(seq_id="t", prompt=list(range(700, 716)), prefill_done=True)])  # 4 blocks
            # low watermark: 0.25 * 16 * 3/8 = 1.5 free blocks; the admission left 0 free,
            # so the loop evicts (one batch) up to 3 free and stops there.
            await passes.wait_refilled(0, 3)
            stats = await kv.stats()
            assert (stats.eviction_loop_batches, stats.eviction_loop_blocks, stats.blocks_evicted) == (1, 3, 3)
            assert (stats.free, stats.active, stats.cached) == (3, 4, 16 - 4 - 3)
            await kv.check()
