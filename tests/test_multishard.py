"""Three and four pool shards: admission under pressure, cross-shard forks, the eviction loop, cancellation.

Routing (``ShardMap.place``): an admission goes to the shard its first block
belongs to (prefix-affine: :func:`tests.placement.on_shard` picks prompts for a
shard) if that shard can hold it; otherwise, and for prompts shorter than a
block, to the shard with the largest free fraction at the start of its step,
less what the step's earlier admissions were routed there (ties: the lowest
index); a fork and its children stay in the parent's shard; prefix hits are
shard-local. So the layouts below are known exactly and every count is
asserted exactly. Block ids
of shard ``i`` are ``range(i * per_shard, (i + 1) * per_shard)``.
"""

from __future__ import annotations

from collections.abc import Hashable

import anyio
import pytest

from akv import Admit, KVCacheManager
from akv.actors.messages import Step
from akv.actors.pool_shard import PoolShardActor
from akv.errors import PoolExhausted, RequestTooLarge, UnknownSequence
from tests.checkpoints import run_cancelled
from tests.eviction_passes import EvictionPasses
from tests.manager_helpers import BS, Runner, snapshot
from tests.placement import on_shard

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every test of this module on asyncio and on trio."""
    return request.param


def prompt(seed: int, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids unique to ``seed`` (no two seeds share a prefix)."""
    return [(seed * 97 + j) % 1000 for j in range(num_tokens)]


def placed(shard: int, seed: int, num_tokens: int, num_shards: int) -> list[int]:
    """A prompt unique to ``seed`` whose first block belongs to ``shard`` (where it goes if it fits)."""
    return on_shard(shard, num_tokens, num_shards, start=seed * 97)


async def shard_of(kv: KVCacheManager, seq_id: Hashable, per_shard: int) -> int:
    """The sequence's shard, checked against the block-id range of every block it holds."""
    info = await kv.sequence(seq_id)
    assert all(b // per_shard == info.shard for b in info.block_ids), (seq_id, info.shard, info.block_ids)
    return info.shard


def shard_counts(kv: KVCacheManager) -> list[tuple[int, int, int]]:
    """(free, active, cached) blocks of each shard, from the snapshots the shards published (a quiescent point)."""
    return [(s.snapshot.free, s.snapshot.active, s.snapshot.cached) for s in kv._shards]


# ------------------------------------------------------------ admission
async def test_a_full_shard_refuses_with_its_numbers_though_others_have_room(tiny_config) -> None:
    """4 shards of 8 blocks, each holding 5 blocks (shard 3's cached): a 7-block and a 4-block prompt
    whose first blocks belong to shard 0, which cannot hold them, spill by free fraction (all equal:
    ties to the lowest index, shard 0 again) and are refused with shard 0's numbers, though 12 blocks
    are free in all and shard 3 could evict room for either; a 9-block prompt is too large for any
    shard of the 32-block pool."""
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=4)) as kv:
        for i in range(4):
            await kv.add_sequence(f"s{i}", placed(i, i, 20, 4))  # 5 blocks, one sequence per shard
            assert await shard_of(kv, f"s{i}", 8) == i
        await kv.commit("s3", 20)  # s3's 5 full blocks published in shard 3
        await kv.free("s3")  # shard 3: 3 free + 5 cached
        assert shard_counts(kv) == [(3, 5, 0), (3, 5, 0), (3, 5, 0), (3, 0, 5)]
        ids = ["s0", "s1", "s2"]
        before = await snapshot(kv, ids)
        exhausted = (await kv.stats()).pool_exhausted

        with pytest.raises(PoolExhausted) as info:
            await kv.add_sequence("x", placed(0, 10, 28, 4))  # 7 blocks
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (7, 3, 0)
        with pytest.raises(RequestTooLarge) as too_large:
            await kv.add_sequence("y", prompt(11, 8 * BS + 1))  # 9 blocks > 8 per shard (32 in the pool)
        assert (too_large.value.requested_blocks, too_large.value.num_blocks) == (9, 8)
        with pytest.raises(PoolExhausted) as info:
            await kv.add_sequence("z", placed(0, 12, 16, 4))  # 4 blocks: shard 0 has 3 free, nothing cached
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (4, 3, 0)
        assert await snapshot(kv, ids) == before
        assert (await kv.stats()).pool_exhausted == exhausted + 2
        assert shard_counts(kv) == [(3, 5, 0), (3, 5, 0), (3, 5, 0), (3, 0, 5)]
        for seq_id in ("x", "y", "z"):
            with pytest.raises(UnknownSequence):
                await kv.sequence(seq_id)
        await kv.check()


async def test_one_step_spreads_admissions_and_rejects_only_what_its_shard_cannot_hold(tiny_config) -> None:
    """3 shards of 6 blocks, 2 free in each: one step admits a 3-block prompt (to shard 0: refused),
    then two 2-block prompts (to shards 1 and 2, which the first one's routing made the emptiest)."""
    async with KVCacheManager(tiny_config(num_blocks=18, num_shards=3)) as kv:
        run = Runner(kv)
        for i in range(3):
            await run.admit(f"f{i}", prompt(i, 16))  # 4 blocks per shard
        assert shard_counts(kv) == [(2, 4, 0)] * 3
        ids = [f"f{i}" for i in range(3)]
        before = await snapshot(kv, ids)
        run.history.update(b=prompt(21, 8), c=prompt(22, 5))
        result = await kv.step(
            admits=[
                Admit(seq_id="a", prompt=prompt(20, 12)),  # 3 blocks
                Admit(seq_id="b", prompt=run.history["b"]),  # 2 blocks
                Admit(seq_id="c", prompt=run.history["c"]),  # 2 blocks
            ]
        )
        assert set(result.rejected) == {"a"}
        assert (result.rejected["a"].requested_blocks, result.rejected["a"].free_blocks) == (3, 2)
        assert result.seq_ids == ("b", "c") and result.cached_tokens == {"b": 0, "c": 0}
        assert [await shard_of(kv, s, 6) for s in ("b", "c")] == [1, 2]
        assert shard_counts(kv) == [(2, 4, 0), (0, 6, 0), (0, 6, 0)]
        await run.write(result)
        await kv.step(commits={"b": 8, "c": 5}, want_metadata=False)
        for seq_id in ("b", "c", *ids):
            await run.verify(seq_id)
        for seq_id in ("b", "c"):
            assert await kv.free(seq_id) is True
        assert (await snapshot(kv, ids))[1] == before[1]  # the fillers' sequences untouched
        assert shard_counts(kv) == [(2, 4, 0), (0, 4, 2), (1, 4, 1)]  # b's 2 and c's 1 full blocks stay cached
        await kv.check()


# ------------------------------------------------------------ forks
async def test_forks_stay_in_the_parents_full_shard_and_copy_on_write_only_there(tiny_config) -> None:
    """3 shards of 6 blocks. p fills shard 0; its forks p1, p2 stay there, so the first append of a
    child (a copy of the shared partial tail) is refused with shard 0's numbers while shard 1 serves
    q's append in the same step. Once p and p2 are freed, p1 holds the tail alone and writes in place."""
    async with KVCacheManager(tiny_config(num_blocks=18, num_shards=3)) as kv:
        run = Runner(kv)
        await run.admit("p", prompt(1, 22))  # 6 blocks: shard 0 full, partial tail of 2
        await run.admit("q", prompt(2, 5))  # shard 1
        await run.fork("p", ["p1", "p2"])
        assert [await shard_of(kv, s, 6) for s in ("p", "p1", "p2", "q")] == [0, 0, 0, 1]
        assert shard_counts(kv) == [(0, 6, 0), (4, 2, 0), (6, 0, 0)]
        p1_before = await kv.sequence("p1")

        run.history["q"].append(7)
        result = await kv.step(appends={"p1": [5], "q": [7]})
        assert set(result.rejected) == {"p1"}
        err = result.rejected["p1"]
        assert (err.requested_blocks, err.free_blocks, err.evictable_blocks) == (1, 0, 0)
        assert result.seq_ids == ("q",) and result.copies.num_blocks == 0
        await run.write(result)
        await kv.commit("q", 1)
        assert await kv.sequence("p1") == p1_before

        # A fork and its first append in one step, in shard 1: the child copies q's shared tail there.
        run.history["q1"] = [*run.history["q"], 8]
        result = await kv.step(forks=[("q", ["q1"])], appends={"q1": [8]})
        assert (result.seq_ids, result.copies.num_blocks) == (("q1",), 1)
        await run.write(result)
        await kv.commit("q1", 1)
        assert await shard_of(kv, "q1", 6) == 1

        assert await kv.free("p") is True
        assert await kv.free("p2") is True
        assert shard_counts(kv)[0] == (0, 6, 0)  # p1 still holds all 6 (5 full blocks are published)
        run.history["p1"].append(5)
        result = await kv.step(appends={"p1": [5]})
        assert (result.rejected, result.copies.num_blocks) == ({}, 0)  # p1 alone holds the tail: in place
        await run.write(result)
        await kv.commit("p1", 1)
        for seq_id in ("p1", "q", "q1"):
            await run.verify(seq_id)
        stats = await kv.stats()
        assert (stats.forks, stats.cow_copies, stats.num_sequences) == (3, 1, 3)
        assert shard_counts(kv) == [(0, 6, 0), (3, 3, 0), (6, 0, 0)]
        await kv.check()


# ------------------------------------------------------------ eviction loop
async def test_eviction_loop_relieves_only_the_shard_under_pressure(tiny_config, monkeypatch) -> None:
    """4 shards of 8 blocks, low watermark 4 free per shard, high 6: each shard caches 2 blocks; a
    4-block admission leaves shard 0 with 2 free, and the loop evicts shard 0's 2 cached blocks only."""
    passes = EvictionPasses(monkeypatch)
    cfg = tiny_config(num_blocks=32, num_shards=4, low_watermark=0.5, high_watermark=0.75)
    async with KVCacheManager(cfg) as kv:
        prompts = [placed(i, i, 9, 4) for i in range(4)]  # 3 blocks, 2 published at once
        for i in range(4):
            await kv.step(admits=[Admit(seq_id=f"a{i}", prompt=prompts[i], prefill_done=True)])
            assert await shard_of(kv, f"a{i}", 8) == i
        for i in range(4):
            await kv.free(f"a{i}")
        assert shard_counts(kv) == [(6, 0, 2)] * 4
        assert passes.passes == []  # 5 free at the lowest: never below 4
        await kv.add_sequence("big", placed(0, 9, 16, 4))  # 4 blocks into shard 0: 2 free, 2 cached
        await passes.wait_for(lambda done: any(p.shard == 0 and p.free_blocks == 4 for p in done))
        assert shard_counts(kv) == [(4, 4, 0), (6, 0, 2), (6, 0, 2), (6, 0, 2)]
        stats = await kv.stats()
        assert (stats.eviction_loop_batches, stats.eviction_loop_blocks, stats.blocks_evicted) == (1, 2, 2)
        assert [await kv.lookup(p) for p in prompts] == [0, 8, 8, 8]
        assert {p.free_blocks for p in passes.passes if p.shard != 0} == {6}  # the others: nothing to do
        await kv.free("big")
        await kv.check()


# ------------------------------------------------------------ cancellation
@pytest.mark.parametrize("path", ["direct", "queued"])
async def test_cancelled_callers_across_four_shards_with_the_eviction_loop_on_leak_nothing(
    tiny_config, monkeypatch, path: str
) -> None:
    """4 shards of 8 blocks, 6 of each cached: 16 callers, 4 at a time (add, commit, append, with a
    free in ``finally``), cancelled after 0, 1, ..., 15 checkpoints (0, 4, ..., 60 when queued), must
    evict to get blocks, on demand and through the loop (low watermark 2 free per shard, high 4). At
    the end nothing is held, every published block is either still cached or was evicted, and the
    prefix cache equals the cached blocks. ``queued``: every message goes through the shards'
    inboxes (the shielded multi-shard path)."""
    passes = EvictionPasses(monkeypatch)
    cfg = tiny_config(num_blocks=32, num_shards=4, low_watermark=0.25, high_watermark=0.5, eviction_batch_blocks=1)
    async with KVCacheManager(cfg) as kv:
        for i in range(4):  # 12 fillers of 2 full blocks (published at once), 3 per shard by their first block
            for j in range(3):
                filler = placed(i, 100 + 3 * i + j, 8, 4)
                await kv.step(admits=[Admit(seq_id=f"f{i}{j}", prompt=filler, prefill_done=True)])
        for i in range(4):
            for j in range(3):
                await kv.free(f"f{i}{j}")
        assert shard_counts(kv) == [(2, 0, 6)] * 4
        for shard in kv._shards:
            shard.direct = path == "direct"
        num_published = 24
        committed: dict[int, bool] = {}

        async def one(i: int) -> None:
            seq_id = f"c{i}"
            try:
                try:
                    await kv.add_sequence(seq_id, prompt(i, 10))  # 3 blocks, 2 full
                except PoolExhausted:  # its shard holds 2 live callers and too little to evict
                    return
                await kv.commit(seq_id, 10)
                await kv.append(seq_id, [5, 6])
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        info = await kv.sequence(seq_id)
                    except UnknownSequence:
                        info = None
                    committed[i] = info is not None and info.num_computed >= 10
                    assert await kv.free(seq_id) is (info is not None)

        finished: dict[int, bool] = {}

        callers = anyio.CapacityLimiter(4)  # 4 callers at a time, at most 12 blocks held
        step = 1 if path == "direct" else 4  # a queued message takes several checkpoints

        async def cancelled(i: int) -> None:
            async with callers:
                finished[i] = await run_cancelled(lambda: one(i), i * step)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(cancelled, i)
        assert finished[0] is False and any(finished.values())
        await passes.wait_for(lambda done: len(done) >= 4)  # woken (a shard fell below 2 free): one round
        await kv.wait_copies()
        stats = await kv.stats()
        num_published += 2 * sum(committed.values())
        assert (stats.active, stats.in_flight, stats.num_sequences) == (0, 0, 0)
        assert stats.free + stats.cached == 32
        assert stats.cached == stats.prefix_cache_blocks
        assert stats.blocks_evicted == num_published - stats.cached
        assert any(committed.values()) and stats.sequences_added == stats.sequences_freed
        assert stats.eviction_loop_blocks == stats.eviction_loop_batches  # batches of 1 block
        await kv.check()


async def test_a_step_cancelled_while_its_shards_apply_it_is_applied_whole(tiny_config, monkeypatch) -> None:
    """3 shards, every message queued: the caller of a step admitting one sequence per shard is
    cancelled while shard 1 applies its part. The step still completes in all three shards, the
    manager routes all three sequences, and freeing them returns every block."""
    scope = anyio.CancelScope()
    real_handle = PoolShardActor.handle

    def handle_then_cancel(self: PoolShardActor, msg):
        result = real_handle(self, msg)
        if isinstance(msg, Step) and self.index == 1:
            scope.cancel()  # on shard 1's task, before its reply: the caller is waiting for it
        return result

    async with KVCacheManager(tiny_config(num_blocks=18, num_shards=3)) as kv:
        for shard in kv._shards:
            shard.direct = False
        monkeypatch.setattr(PoolShardActor, "handle", handle_then_cancel)
        with scope:
            await kv.step(admits=[Admit(seq_id=f"a{i}", prompt=placed(i, i, 9, 3)) for i in range(3)])
        assert scope.cancelled_caught
        monkeypatch.setattr(PoolShardActor, "handle", real_handle)
        assert [await shard_of(kv, f"a{i}", 6) for i in range(3)] == [0, 1, 2]
        assert shard_counts(kv) == [(3, 3, 0)] * 3
        assert [await kv.free(f"a{i}") for i in range(3)] == [True] * 3
        stats = await kv.stats()
        assert (stats.active, stats.num_sequences, stats.free) == (0, 0, 18)
        await kv.check()
