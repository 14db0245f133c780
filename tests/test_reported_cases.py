"""The eight cases reported by users of other KV cache managers (issue 3), with exact expectations.

Pools of a few blocks, block size 4, tiny model with real CPU tensors,
debug invariants on. Every K/V written is the oracle's value for the
sequence's token history (:mod:`akv.stress.kv_io`), so "reads back its own
tokens" is checked bit for bit.
"""

from __future__ import annotations

import itertools

import anyio
import pytest

from akv.core.step import Admit
from akv.errors import InvalidInput, InvalidTokens, PoolExhausted, RequestTooLarge, UnknownSequence
from akv.manager import KVCacheManager
from akv.stress.kv_io import append, block_states, fork, prefill, reads_back, refcounts, write
from tests.eviction_passes import EvictionPasses

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


BS = 4


def config(tiny_config, num_blocks: int = 4, **overrides):
    return tiny_config(num_blocks=num_blocks, block_size=BS, **overrides)


# --------------------------------------------------------------------- case 1
@pytest.mark.parametrize("first", ["parent", "child"])
async def test_case1_fork_partial_tail_one_private_copy(tiny_config, first: str) -> None:
    """Fork a 6-token sequence; each copy appends a different token: exactly one copy of the shared tail."""
    async with KVCacheManager(config(tiny_config)) as kv:
        assert await prefill(kv, "s0", [1, 2, 3, 4, 5, 6]) == 0
        await fork(kv, "s0", ["s1"])
        assert await refcounts(kv, ["s0", "s1"]) == {0: 2, 1: 2}
        order = ["s0", "s1"] if first == "parent" else ["s1", "s0"]
        r_first = await append(kv, order[0], [7])
        r_second = await append(kv, order[1], [8])
        # The first appender gets the private copy of the shared partial tail (block 1 -> 2);
        # the second then holds block 1 alone and writes in place.
        assert r_first.copies.num_blocks == 1
        assert r_second.copies.num_blocks == 0
        assert (await kv.stats()).cow_copies == 1
        assert (await kv.sequence(order[0])).block_ids == (0, 2)
        assert (await kv.sequence(order[1])).block_ids == (0, 1)
        assert (await kv.sequence("s0")).token_ids[-1] == (7 if first == "parent" else 8)
        assert await reads_back(kv, "s0")
        assert await reads_back(kv, "s1")
        assert await refcounts(kv, ["s0", "s1"]) == {0: 2, 1: 1, 2: 1}
        assert await block_states(kv) == (1, 3, 0, 0, 2)

        assert await kv.free("s0") is True
        s1_tail = 2 if first == "child" else 1
        assert await refcounts(kv, ["s1"]) == {0: 1, s1_tail: 1}
        assert await block_states(kv) == (2, 2, 0, 0, 1)
        assert await kv.free("s1") is True
        assert await block_states(kv) == (3, 0, 1, 0, 0)  # block 0 (full, committed) stays cached
        before = await kv.stats()
        assert await kv.free("s1") is False  # a second finish changes nothing
        after = await kv.stats()
        assert (after.free, after.active, after.cached, after.sequences_freed) == (
            before.free,
            before.active,
            before.cached,
            before.sequences_freed,
        )
        await kv.check()


# --------------------------------------------------------------------- case 2
A_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # 2 full blocks + 1 token
B_PROMPT = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]  # needs all 4 blocks


@pytest.mark.parametrize("evictor", ["on_demand", "eviction_loop"])
async def test_case2_evicted_block_leaves_prefix_cache_before_reuse(tiny_config, monkeypatch, evictor: str) -> None:
    """An evicted block reused for another prompt never serves the old prefix."""
    cfg = config(tiny_config) if evictor == "on_demand" else config(tiny_config, low_watermark=0.75, high_watermark=1.0)
    passes = EvictionPasses(monkeypatch)
    async with KVCacheManager(cfg) as kv:
        assert await prefill(kv, "a", A_PROMPT) == 0
        assert (await kv.sequence("a")).block_ids == (0, 1, 2)
        await kv.free("a")
        if evictor == "on_demand":
            assert await block_states(kv) == (2, 0, 2, 0, 0)
            assert await kv.lookup(A_PROMPT) == 8
        else:  # 2 free of 4, below the low watermark of 3: the loop refills to 4
            await passes.wait_refilled(0, 4)
            stats = await kv.stats()
            assert (stats.free, stats.cached, stats.eviction_loop_blocks, stats.eviction_loop_batches) == (4, 0, 2, 1)
            assert await kv.lookup(A_PROMPT) == 0

        assert await prefill(kv, "b", B_PROMPT) == 0  # takes every block, the evicted ones too
        assert sorted((await kv.sequence("b")).block_ids) == [0, 1, 2, 3]
        stats = await kv.stats()
        assert stats.blocks_evicted == 2
        assert stats.prefix_cache_blocks == 3  # b's own 3 full committed blocks, not a's
        assert await kv.lookup(A_PROMPT) == 0
        assert await reads_back(kv, "b")
        since = len(passes.passes)
        await kv.free("b")
        if evictor == "eviction_loop":  # 1 free, 3 cached: the loop evicts b's 3 blocks
            await passes.wait_refilled(0, 4, since=since)
            assert (await kv.stats()).eviction_loop_blocks == 2 + 3

        assert await prefill(kv, "a2", A_PROMPT) == 0  # the old prefix never matches a reused block
        assert await reads_back(kv, "a2")
        if evictor == "on_demand":  # a2 evicted b's two deepest blocks (leaves first); b's first block stays
            assert await kv.lookup(B_PROMPT) == 4
        since = len(passes.passes)
        await kv.free("a2")
        if evictor == "eviction_loop":  # 2 free, 2 cached: the loop evicts a2's 2 blocks
            await passes.wait_refilled(0, 4, since=since)
            assert (await kv.stats()).eviction_loop_blocks == 2 + 3 + 2  # a's, then b's, then a2's
        else:
            assert passes.passes == []
        await kv.check()


# --------------------------------------------------------------------- case 3
async def test_case3_full_hit_still_computes_last_token(tiny_config) -> None:
    """Fully cached multiple of block_size reports len - block_size; 9 over 8 reports 8; 1 token 0; empty is invalid."""
    async with KVCacheManager(config(tiny_config, num_blocks=8)) as kv:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        assert await prefill(kv, "p", prompt) == 0
        await kv.free("p")
        assert await kv.lookup(prompt) == 4
        assert await prefill(kv, "p8", prompt) == 4  # never 8: the last token must be computed
        assert await reads_back(kv, "p8")
        assert await prefill(kv, "p9", [*prompt, 9]) == 8
        assert await reads_back(kv, "p9")
        assert await prefill(kv, "one", [1]) == 0
        assert await prefill(kv, "four", [1, 2, 3, 4]) == 0
        assert await reads_back(kv, "four")

        before = await kv.stats()
        with pytest.raises(InvalidTokens):
            await kv.add_sequence("empty", [])
        with pytest.raises(InvalidInput):
            await kv.step(admits=[Admit(seq_id="empty2", prompt=[])])
        after = await kv.stats()
        assert (after.free, after.active, after.cached, after.num_sequences, after.blocks_allocated) == (
            before.free,
            before.active,
            before.cached,
            before.num_sequences,
            before.blocks_allocated,
        )
        with pytest.raises(UnknownSequence):
            await kv.sequence("empty")
        for seq_id in ("p8", "p9", "one", "four"):
            await kv.free(seq_id)
        await kv.check()


# --------------------------------------------------------------------- case 4
@pytest.mark.parametrize("written", ["none", "half", "all_wrong"])
async def test_case4_aborted_prefill_never_matched(tiny_config, written: str) -> None:
    """Blocks of a sequence freed before its prefill was committed are never matched later."""
    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29]
    async with KVCacheManager(config(tiny_config)) as kv:
        result = await kv.step(admits=[Admit(seq_id="x", prompt=prompt)])
        slots = result.slot_mapping
        if written == "half":
            write(kv, slots[:4], prompt, 0, 4)
        elif written == "all_wrong":  # K/V of another history: matching it later would be a corrupted read
            write(kv, slots, [99, *prompt[1:]], 0, len(prompt))
        assert await kv.free("x") is True
        assert await block_states(kv) == (4, 0, 0, 0, 0)
        assert (await kv.stats()).prefix_cache_blocks == 0
        assert await kv.lookup(prompt) == 0
        assert await prefill(kv, "y", prompt) == 0
        assert await reads_back(kv, "y")
        await kv.free("y")
        assert await kv.lookup(prompt) == 8  # y committed: now its blocks are cached
        await kv.check()


# --------------------------------------------------------------------- case 5
@pytest.mark.parametrize("order", ["parent_first", "child_first", "concurrent"])
async def test_case5_shared_partial_tail_appends_never_tear(tiny_config, order: str) -> None:
    """Two sequences sharing a partial tail append different tokens: no torn block, no negative refcount."""
    async with KVCacheManager(config(tiny_config, num_blocks=6)) as kv:
        await prefill(kv, "s0", [1, 2, 3, 4, 5, 6])
        await fork(kv, "s0", ["s1"])
        if order == "parent_first":
            await append(kv, "s0", [7, 17])
            await append(kv, "s1", [8, 18])
        elif order == "child_first":
            await append(kv, "s1", [8, 18])
            await append(kv, "s0", [7, 17])
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(append, kv, "s0", [7, 17])
                tg.start_soon(append, kv, "s1", [8, 18])
        assert (await kv.sequence("s0")).token_ids == (1, 2, 3, 4, 5, 6, 7, 17)
        assert (await kv.sequence("s1")).token_ids == (1, 2, 3, 4, 5, 6, 8, 18)
        assert await reads_back(kv, "s0")
        assert await reads_back(kv, "s1")
        assert (await kv.stats()).cow_copies == 1
        refs = await refcounts(kv, ["s0", "s1"])
        assert refs[0] == 2 and all(r == 1 for b, r in refs.items() if b != 0)
        assert len(refs) == 3
        await kv.check()
        await kv.free("s0")
        await kv.free("s1")
        await kv.free("s0")
        assert await block_states(kv) == (3, 0, 3, 0, 0)  # 3 distinct full committed blocks stay cached
        await kv.check()


async def test_case5_identical_prompts_share_only_full_blocks(tiny_config) -> None:
    """An identical prompt shares the committed full block, never the partial tail."""
    async with KVCacheManager(config(tiny_config, num_blocks=6)) as kv:
        prompt = [1, 2, 3, 4, 5, 6]
        assert await prefill(kv, "a", prompt) == 0
        assert await prefill(kv, "b", prompt) == 4
        a, b = await kv.sequence("a"), await kv.sequence("b")
        assert a.block_ids[0] == b.block_ids[0] and a.block_ids[1] != b.block_ids[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(append, kv, "a", [7])
            tg.start_soon(append, kv, "b", [8])
        assert (await kv.stats()).cow_copies == 0
        assert await reads_back(kv, "a")
        assert await reads_back(kv, "b")
        assert await refcounts(kv, ["a", "b"]) == {a.block_ids[0]: 2, a.block_ids[1]: 1, b.block_ids[1]: 1}
        await kv.free("a")
        await kv.free("b")
        await kv.check()


# --------------------------------------------------------------------- case 6
async def _fork_chain_final_state(tiny_config, removal: tuple[str, ...]) -> tuple:
    async with KVCacheManager(config(tiny_config, num_blocks=8)) as kv:
        await prefill(kv, "S0", [1, 2, 3, 4, 5])
        await append(kv, "S0", [6])
        await fork(kv, "S0", ["S1"])
        await append(kv, "S1", [7, 8])
        await fork(kv, "S1", ["S2"])
        await append(kv, "S2", [9, 10, 11])
        await append(kv, "S0", [12])  # the parent appends after the fork too (copy-on-write)
        histories = {s: (await kv.sequence(s)).token_ids for s in ("S0", "S1", "S2")}
        for s in ("S0", "S1", "S2"):
            assert await reads_back(kv, s)
        for s in removal:
            assert await kv.free(s) is True
            await kv.check()
            for other in removal[removal.index(s) + 1 :]:
                assert await reads_back(kv, other)
        for s in removal:
            assert await kv.free(s) is False
        stats = await kv.stats()
        lookups = tuple([await kv.lookup(list(h)) for h in histories.values()])
        await kv.check()
        return (await block_states(kv), stats.prefix_cache_blocks, stats.cow_copies, lookups)


async def test_case6_fork_chain_removed_in_every_order(tiny_config) -> None:
    """S0 -> S1 -> S2, each appending, freed in all six orders: the same final state, no error."""
    finals = {
        order: await _fork_chain_final_state(tiny_config, order) for order in itertools.permutations(("S0", "S1", "S2"))
    }
    assert len(set(finals.values())) == 1, finals
    states, published, cow_copies, lookups = next(iter(finals.values()))
    # Cached: S0's first block and S1's second (shared by S2); every partial tail is free.
    assert states == (6, 0, 2, 0, 0)
    assert published == 2
    assert cow_copies == 1  # only S1's first append copied the tail it shared with S0
    assert lookups == (4, 4, 8)  # S0 (7 tokens), S1 (8: its last block is recomputed), S2 (11)


# --------------------------------------------------------------------- case 7
async def test_case7_too_large_fails_at_once_and_holds_nothing(tiny_config) -> None:
    """A request larger than the pool fails permanently, holds nothing, and does not delay the next one."""
    async with KVCacheManager(config(tiny_config)) as kv:
        big = list(range(1, 18))  # 17 tokens = 5 blocks > 4
        handled = kv._shards[0].messages_handled
        with pytest.raises(RequestTooLarge) as info:
            await kv.add_sequence("big", big)
        assert kv._shards[0].messages_handled == handled + 1  # at once: one message, no wait for room
        assert info.value.requested_blocks == 5 and info.value.num_blocks == 4
        assert not isinstance(info.value, PoolExhausted)
        assert await block_states(kv) == (4, 0, 0, 0, 0)
        with pytest.raises(UnknownSequence):
            await kv.sequence("big")
        # In one step: the big admission is rejected, the small one right behind it is served.
        result = await kv.step(admits=[Admit(seq_id="big", prompt=big), Admit(seq_id="small", prompt=[1, 2, 3])])
        assert isinstance(result.rejected["big"], RequestTooLarge)
        assert result.seq_ids == ("small",)
        await kv.free("small")
        # A sequence that would outgrow the whole pool by appending is refused the same way.
        await prefill(kv, "full", list(range(1, 17)))
        with pytest.raises(RequestTooLarge):
            await kv.append("full", [1])
        assert (await kv.sequence("full")).num_tokens == 16
        await kv.free("full")
        await kv.check()


# --------------------------------------------------------------------- case 8
async def test_case8_concurrent_admissions_all_or_nothing(tiny_config) -> None:
    """Two concurrent requests of 3 blocks each on a 4-block pool: exactly one gets all 3, the other none."""
    async with KVCacheManager(config(tiny_config)) as kv:
        outcomes: dict[str, object] = {}

        async def request(seq_id: str, first: int) -> None:
            try:
                outcomes[seq_id] = await kv.add_sequence(seq_id, list(range(first, first + 10)))
            except PoolExhausted as exc:
                outcomes[seq_id] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(request, "r1", 100)
            tg.start_soon(request, "r2", 200)
        winners = [s for s, o in outcomes.items() if o == 0]
        losers = [s for s, o in outcomes.items() if isinstance(o, PoolExhausted)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        exc = outcomes[losers[0]]
        assert (exc.requested_blocks, exc.free_blocks, exc.evictable_blocks) == (3, 1, 0)
        assert len((await kv.sequence(winners[0])).block_ids) == 3
        with pytest.raises(UnknownSequence):
            await kv.sequence(losers[0])
        assert await block_states(kv) == (1, 3, 0, 0, 1)  # the loser holds nothing
        await kv.free(winners[0])
        assert await kv.add_sequence(losers[0], list(range(300, 310))) == 0  # now it gets all of them
        assert len((await kv.sequence(losers[0])).block_ids) == 3
        await kv.free(losers[0])
        await kv.check()


@pytest.mark.parametrize("count", [2**63, 2**70, -(2**63) - 1])
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_commit_count_beyond_int64_is_invalid_input_not_a_crash(tiny_config, count: int, num_shards: int) -> None:
    # Fresh-eyes review: np.fromiter overflowed inside the shard and crashed the manager.
    async with KVCacheManager(tiny_config(num_shards=num_shards)) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        before = await kv.stats()
        with pytest.raises(InvalidInput):
            await kv.step(commits={"a": count})
        with pytest.raises(InvalidInput):
            await kv.commit("a", count)
        await kv.check()
        assert await kv.stats() == before
        assert (await kv.sequence("a")).num_computed == 0


@pytest.mark.parametrize("num_shards", [1, 2])
async def test_step_touching_no_shard_returns_empty_metadata(tiny_config, num_shards: int) -> None:
    # Fresh-eyes review: with two shards an empty step returned None tensors, with one empty ones.
    async with KVCacheManager(tiny_config(num_shards=num_shards)) as kv:
        for kw in ({}, {"frees": ["unknown"]}):
            r = await kv.step(**kw)
            assert tuple(r.block_tables.shape) == (0, 0)
            assert r.slot_mapping.numel() == 0 and r.context_lens.numel() == 0
            assert r.query_start_loc.tolist() == [0]
        r = await kv.step(want_metadata=False)
        assert r.block_tables is None and r.slot_mapping is None


async def test_bfloat16_token_tensor_is_invalid_tokens(tiny_config) -> None:
    """A bfloat16 tensor (numpy has no such dtype) is refused as InvalidTokens, nothing applied
    (fresh-eyes report: a plain TypeError escaped)."""
    import torch

    async with KVCacheManager(config(tiny_config, num_blocks=8)) as kv:
        await prefill(kv, "s0", [1, 2, 3])
        before = await kv.stats()
        bad = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
        with pytest.raises(InvalidTokens, match="bfloat16"):
            await kv.add_sequence("s1", bad)
        with pytest.raises(InvalidTokens, match="bfloat16"):
            await kv.append("s0", bad)
        with pytest.raises(InvalidTokens, match="bfloat16"):
            await kv.lookup(bad)
        after = await kv.stats()
        assert (after.num_sequences, after.active, after.free) == (before.num_sequences, before.active, before.free)
        assert (await kv.sequence("s0")).token_ids == (1, 2, 3)
        await kv.check()


async def test_non_bool_want_metadata_and_huge_metadata_pool_are_invalid_input(tiny_config) -> None:
    """``want_metadata="no"`` was taken as true; a metadata-only pool too big for the host
    raised a raw MemoryError on enter (fresh-eyes report); bad config values are InvalidInput."""
    async with KVCacheManager(config(tiny_config, num_blocks=8)) as kv:
        with pytest.raises(InvalidInput, match="want_metadata must be a bool"):
            await kv.step(want_metadata="no")
        await kv.check()
    # the largest num_blocks and block_size: shard 0 alone needs 512 GiB of token ids
    huge = tiny_config(num_blocks=2**31 - 1, block_size=2**16, num_shards=1024, storage="none")
    with pytest.raises(InvalidInput, match="cannot allocate the block metadata"):
        async with KVCacheManager(huge):
            pass
    with pytest.raises(InvalidInput, match="num_blocks must be a positive int"):
        tiny_config(num_blocks=0)


async def test_free_of_an_unhashable_id_names_free_s_argument(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        with pytest.raises(InvalidInput, match=r"seq_id of free\(\) must be hashable"):
            await kv.free(["x"])
        await kv.check()
