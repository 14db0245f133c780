"""KVCacheManager end to end on CPU tensors: every public call and K/V round trips through forks and eviction.

Each test runs a real manager (actors on anyio, tiny model, block_size 4) and
ends with ``await kv.check()`` wherever the manager is still running. Hangs
are turned into failures with ``anyio.fail_after`` (a hang guard, never the
thing asserted); a module watchdog dumps the stacks and exits should a
shielded wait ever hang beyond it.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from akv import Admit, KVCacheManager
from akv.errors import (
    DuplicateSequence,
    UnknownSequence,
)
from tests.manager_helpers import (  # noqa: F401 - anyio_backend and watchdog are this module's fixtures
    BS,
    Runner,
    anyio_backend,
    publish,
    state_view,
    watchdog,
)

pytestmark = pytest.mark.anyio


# -------------------------------------------------------------- public calls
async def test_every_public_call_counts_exactly(tiny_config) -> None:
    cfg = tiny_config(num_blocks=16)
    async with KVCacheManager(cfg) as kv:
        prompt = list(range(10))  # 2 full blocks + 2 tokens
        assert await kv.add_sequence("a", prompt) == 0
        assert kv.usage == 3 / 16
        assert kv.blocks_in_use == 3
        assert kv.inbox_depths == {"pool_shard_0": 0}
        info = await kv.sequence("a")
        assert info.block_ids == (0, 1, 2)
        assert (info.num_tokens, info.num_computed, info.num_cached_tokens, info.parent_id) == (10, 0, 0, None)
        assert await kv.lookup(prompt) == 0  # nothing committed yet

        await kv.commit("a", 10)
        info = await kv.sequence("a")
        assert (info.num_computed, info.num_published_blocks) == (10, 2)
        assert await kv.lookup(prompt) == 8
        assert await kv.lookup(prompt[:8]) == 4  # the last prompt token is never served from cache
        assert await kv.lookup(prompt, namespace="other") == 0

        result = await kv.append("a", [11, 12])
        assert result.seq_ids == ("a",)
        assert result.slot_mapping.tolist() == [2 * BS + 2, 2 * BS + 3]
        assert result.context_lens.tolist() == [12]
        assert result.query_start_loc.tolist() == [0, 2]
        assert result.block_tables.tolist() == [[0, 1, 2]]
        assert result.copies.num_blocks == 0
        result = await kv.append("a", 13)  # the single-int decode path
        assert result.slot_mapping.tolist() == [3 * BS]
        assert (await kv.sequence("a")).block_ids == (0, 1, 2, 3)

        await kv.fork("a", ["b"])
        b = await kv.sequence("b")
        assert (b.parent_id, b.block_ids, b.token_ids) == ("a", (0, 1, 2, 3), (*prompt, 11, 12, 13))

        assert await kv.add_sequence("c", [*prompt[:8], 99, 98]) == 8
        await kv.wait_copies()
        stats = await kv.stats()
        assert (stats.num_blocks, stats.block_size) == (16, BS)
        assert (stats.free, stats.active, stats.cached, stats.in_flight) == (11, 5, 0, 0)
        assert stats.usage == 5 / 16
        assert (stats.num_sequences, stats.prefix_cache_blocks) == (3, 2)
        assert (stats.prompt_tokens, stats.cached_tokens, stats.hit_rate) == (20, 8, 0.4)
        assert (stats.blocks_allocated, stats.forks, stats.cow_copies) == (5, 1, 0)
        assert (stats.sequences_added, stats.sequences_freed, stats.pool_exhausted) == (2, 0, 0)
        assert (stats.blocks_evicted, stats.eviction_batches) == (0, 0)
        assert stats.pool_bytes == (16 + 1) * cfg.bytes_per_block == kv.storage.nbytes  # the null block included

        assert await kv.free("a") is True
        assert await kv.free("b") is True
        assert await kv.free("c") is True
        stats = await kv.stats()
        assert (stats.free, stats.active, stats.cached, stats.num_sequences) == (14, 0, 2, 0)
        assert stats.sequences_freed == 3
        await kv.check()


async def test_free_is_idempotent(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("a", [1, 2, 3, 4, 5])
        assert await kv.free("a") is True
        before = await kv.stats()
        assert await kv.free("a") is False
        assert await kv.free("never-added") is False
        result = await kv.step(frees=["a", "a", "ghost"])
        assert result.freed == ()
        assert state_view(await kv.stats()) == state_view(before)
        assert before.sequences_freed == 1 and before.free == 16
        with pytest.raises(UnknownSequence):
            await kv.sequence("a")
        await kv.check()


async def test_batched_step_orders_rows_appends_then_admissions(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        await kv.add_sequence("b", [4, 5, 6, 7])
        result = await kv.step(
            commits={"a": 3, "b": 4},
            appends={"b": [8], "a": [9, 10]},
            admits=[Admit(seq_id="c", prompt=[1, 2, 3, 4, 5])],
        )
        assert result.seq_ids == ("b", "a", "c")
        assert result.context_lens.tolist() == [5, 5, 5]
        assert result.query_start_loc.tolist() == [0, 1, 3, 8]
        a, b, c = [(await kv.sequence(s)).block_ids for s in "abc"]
        assert (a, b, c) == ((0, 3), (1, 2), (4, 5))
        assert result.slot_mapping.tolist() == [2 * BS, 0 * BS + 3, 3 * BS, 16, 17, 18, 19, 20]
        assert result.block_tables.tolist() == [[1, 2], [0, 3], [4, 5]]
        assert result.cached_tokens == {"c": 0}  # b's block 1 was committed this step, c's prompt differs
        await kv.check()


async def test_namespaces_isolate_prefix_hits(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        prompt = list(range(9))
        await publish(kv, "a", prompt)
        assert await kv.add_sequence("t1", prompt, namespace="tenant-1") == 0
        await kv.commit("t1", 9)
        assert await kv.lookup(prompt) == 8
        assert await kv.lookup(prompt, namespace="tenant-1") == 8
        assert await kv.lookup(prompt, namespace="tenant-2") == 0
        assert await kv.add_sequence("t1b", prompt, namespace="tenant-1") == 8
        assert (await kv.sequence("t1b")).block_ids[:2] == (await kv.sequence("t1")).block_ids[:2]
        assert await kv.add_sequence("plain", prompt) == 8
        assert (await kv.sequence("plain")).block_ids[:2] != (await kv.sequence("t1")).block_ids[:2]
        stats = await kv.stats()
        assert stats.prefix_cache_blocks == 4
        await kv.check()


async def test_token_ids_accepted_as_numpy_and_torch(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("np", np.array([1, 2, 3, 4, 5], dtype=np.int64))
        await kv.add_sequence("torch", torch.tensor([6, 7, 8], dtype=torch.int32))
        await kv.append("np", np.array([9], dtype=np.uint16))
        await kv.append("torch", torch.tensor([10, 11]))
        await kv.commit("np", np.int64(6))
        assert (await kv.sequence("np")).token_ids == (1, 2, 3, 4, 5, 9)
        assert (await kv.sequence("torch")).token_ids == (6, 7, 8, 10, 11)
        assert (await kv.sequence("np")).num_computed == 6
        await kv.check()


async def test_concurrent_adds_of_one_id_admit_exactly_one(tiny_config) -> None:
    outcomes: list[str] = []

    async def add(kv: KVCacheManager, i: int) -> None:
        try:
            await kv.add_sequence("dup", [i, 1, 2, 3, 4])
            outcomes.append("added")
        except DuplicateSequence:
            outcomes.append("duplicate")

    async with KVCacheManager(tiny_config()) as kv:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(add, kv, i)
        assert sorted(outcomes) == ["added", *["duplicate"] * 7]
        stats = await kv.stats()
        assert (stats.num_sequences, stats.active, stats.sequences_added) == (1, 2, 1)
        await kv.check()


async def test_step_result_tensors_are_snapshots(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        first = await kv.step(appends={"a": [4, 5]})
        kept = [t.clone() for t in (first.block_tables, first.context_lens, first.query_start_loc, first.slot_mapping)]
        await kv.free("a")
        for i in range(4):  # reuse the freed table row and blocks
            await kv.step(admits=[Admit(seq_id=f"b{i}", prompt=[9] * 7)], appends={})
        now = (first.block_tables, first.context_lens, first.query_start_loc, first.slot_mapping)
        assert all(torch.equal(a, b) for a, b in zip(kept, now))
        await kv.check()


# ------------------------------------------------------- K/V through the pool
async def test_fork_divergent_appends_read_back_their_own_history(tiny_config) -> None:
    with anyio.fail_after(60):
        async with KVCacheManager(tiny_config(num_blocks=32)) as kv:
            run = Runner(kv)
            prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6]  # 2 full blocks + a partial tail of 2
            assert await run.admit("p", prompt) == 0
            await run.verify("p")
            await run.fork("p", ["c1", "c2"])

            # Three sequences share the partial tail: the first two to append copy it.
            result = await run.append({"p": [11], "c1": [12], "c2": [13]})
            assert result.copies.num_blocks == 2
            assert result.copies.nbytes == 2 * kv.config.bytes_per_block
            tails = {sid: (await kv.sequence(sid)).block_ids for sid in ("p", "c1", "c2")}
            assert tails["p"][:2] == tails["c1"][:2] == tails["c2"][:2]
            assert len({t[2] for t in tails.values()}) == 3, tails

            for step in range(6):
                await run.append({"p": [20 + step], "c1": [30 + step, 31], "c2": [40 + step]})
            await run.fork("c1", ["c1a"])
            await run.append({"c1a": [50, 51, 52], "c1": [60]})
            # A fork and the child's first append in one step: the child copies the shared tail first.
            run.history["c2b"] = [*run.history["c2"], 70]
            result = await kv.step(forks=[("c2", ["c2b"])], appends={"c2b": [70]})
            assert result.seq_ids == ("c2b",)
            assert result.copies.num_blocks == (1 if len(run.history["c2"]) % BS else 0)
            await run.write(result)
            await kv.commit("c2b", 1)
            for sid in ("p", "c1", "c2", "c1a", "c2b"):
                await run.verify(sid)

            # The parent's prompt blocks are published: a new prompt over them hits and reads them back.
            q_prompt = [*prompt, 11, 20, 21, 22]
            assert await run.admit("q", q_prompt) == 12
            await run.verify("q")
            assert await kv.free("p") is True
            for sid in ("c1", "c2", "c1a", "c2b", "q"):
                await run.verify(sid)
            stats = await kv.stats()
            assert stats.cow_copies >= 3
            assert stats.forks == 4
            await kv.check()


async def test_kv_round_trip_after_eviction_and_reuse(tiny_config) -> None:
    with anyio.fail_after(60):
        async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
            run = Runner(kv)
            for i in range(6):
                prompt = [100 * i + j for j in range(13)]  # 4 blocks, 3 published
                await run.admit(f"s{i}", prompt)
                await run.verify(f"s{i}")
                await kv.free(f"s{i}")
            stats = await kv.stats()
            assert stats.blocks_evicted > 0
            # An early prompt was evicted and recomputed into reused blocks; a late one still hits.
            assert await run.admit("again0", [j for j in range(13)]) == 0
            await run.verify("again0")
            assert await run.admit("again5", [500 + j for j in range(13)]) == 12
            await run.verify("again5")
            await kv.check()


async def test_a_child_forked_in_the_step_that_publishes_its_parent_counts_those_blocks(tiny_config) -> None:
    """Commit and fork in one step: the child shares the blocks the commit published, and says so.

    Found by the manager state machine: the child copied its parent's published count
    before the step's publishes were applied, so it reported 0 published blocks and, at
    its next commit, published the same blocks again.
    """
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        await kv.add_sequence("s1", list(range(1, 19)))  # 18 tokens: 4 full blocks of 4 and a tail
        await kv.step(commits={"s1": 16}, forks=[("s1", ["s6"])])
        parent, child = await kv.sequence("s1"), await kv.sequence("s6")
        assert parent.num_published_blocks == child.num_published_blocks == 4
        await kv.check()
