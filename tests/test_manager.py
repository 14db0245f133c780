"""KVCacheManager end to end on CPU tensors: every public call, K/V round trips, errors, lifecycle.

Each test runs a real manager (actors on anyio, tiny model, block_size 4) and
ends with ``await kv.check()`` wherever the manager is still running. Hangs
are turned into failures with ``anyio.fail_after``; a module watchdog dumps
the stacks and exits should a shielded wait ever hang beyond it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import sys
from collections.abc import Hashable
from fractions import Fraction

import anyio
import numpy as np
import pytest
import structlog
import torch

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.core.shard_state import ShardState
from akv.errors import (
    ActorCrashed,
    DuplicateSequence,
    InvalidInput,
    InvalidTokens,
    ManagerClosed,
    PoolExhausted,
    RequestTooLarge,
    UnknownSequence,
)
from akv.storage import KVStorage
from tests.checkpoints import run_cancelled
from tests.eviction_passes import EvictionPasses

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


BS = 4
VOCAB = 1000


@pytest.fixture(autouse=True)
def _watchdog():
    """Last resort against a hang inside a shielded wait (fail_after cannot cancel those)."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------- helpers
def kv_values(history: list[int], layer: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic K and V for every position of ``history``: ``(n, heads, dim)`` float32, exact.

    Position ``i`` depends on the whole prefix ``history[: i + 1]`` (a rolling
    hash, as a real model's K/V depends on the prefix) and on the layer. All
    values are integers below 2**24, so float32 holds them exactly.
    """
    h, rows = 0, []
    for tok in history:
        h = (h * 1_000_003 + tok + 1) % (1 << 16)
        rows.append(h)
    width = num_kv_heads * head_dim
    base = (torch.tensor(rows, dtype=torch.float32) * 4 + layer).view(-1, 1, 1) * width
    k = base + torch.arange(width, dtype=torch.float32).view(1, num_kv_heads, head_dim)
    return k, -k - 1


class Runner:
    """A minimal model runner: writes K/V through slot mappings, reads back through block tables."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.history: dict[Hashable, list[int]] = {}

    @property
    def storage(self):
        return self.kv.storage

    def _values(self, sid: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.storage
        return kv_values(self.history[sid], layer, s.num_kv_heads, s.head_dim)

    async def write(self, result) -> None:
        """Write this step's new tokens of every scheduled row (after its copies ran)."""
        await result.copies.wait()
        qsl = result.query_start_loc.tolist()
        for row, sid in enumerate(result.seq_ids):
            a, b = qsl[row], qsl[row + 1]
            end = int(result.context_lens[row])
            start = end - (b - a)
            assert end == len(self.history[sid]), f"{sid}: context length {end}, history {len(self.history[sid])}"
            slots = result.slot_mapping[a:b]
            for layer in range(self.storage.num_layers):
                k, v = self._values(sid, layer)
                self.storage.write(layer, slots, k[start:end], v[start:end])

    async def admit(self, sid: Hashable, prompt: list[int]) -> int:
        self.history[sid] = list(prompt)
        result = await self.kv.step(admits=[Admit(seq_id=sid, prompt=prompt)])
        assert sid not in result.rejected, result.rejected
        await self.write(result)
        cached = result.cached_tokens[sid]
        await self.kv.commit(sid, len(prompt) - cached)
        return cached

    async def fork(self, parent: Hashable, children: list[Hashable]) -> None:
        await self.kv.fork(parent, children)
        for child in children:
            self.history[child] = list(self.history[parent])

    async def append(self, appends: dict[Hashable, list[int]]):
        for sid, toks in appends.items():
            self.history[sid].extend(toks)
        result = await self.kv.step(appends=appends)
        assert result.rejected == {}, result.rejected
        assert sorted(map(str, result.seq_ids)) == sorted(map(str, appends))
        await self.write(result)
        await self.kv.step(commits={sid: len(toks) for sid, toks in appends.items()}, want_metadata=False)
        return result

    async def verify(self, sid: Hashable) -> None:
        """What the sequence reads back through its block table equals what was written for its history."""
        info = await self.kv.sequence(sid)
        assert list(info.token_ids) == self.history[sid]
        assert info.num_tokens == len(self.history[sid])
        assert len(info.block_ids) == -(-info.num_tokens // BS)
        table = torch.tensor(info.block_ids, dtype=torch.int32)
        for layer in range(self.storage.num_layers):
            k, v = self.storage.gather(layer, table, info.num_tokens)
            want_k, want_v = self._values(sid, layer)
            assert torch.equal(k, want_k), f"{sid}: K of layer {layer} differs from its own history"
            assert torch.equal(v, want_v), f"{sid}: V of layer {layer} differs from its own history"


def messages_handled(kv: KVCacheManager) -> int:
    """Messages the pool shards' handlers have run (the actors' own counter): how many asks calls took."""
    return sum(shard.messages_handled for shard in kv._shards)


def state_view(stats) -> dict:
    """Stats minus what may legitimately move without a state change (inbox depths, the error counter)."""
    d = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    d.pop("max_inbox_depth")
    d.pop("pool_exhausted")
    return d


async def snapshot(kv: KVCacheManager, ids: list[Hashable]) -> tuple:
    stats = await kv.stats()
    return state_view(stats), {sid: await kv.sequence(sid) for sid in ids}


async def publish(kv: KVCacheManager, sid: Hashable, prompt: list[int], *, free: bool = True) -> None:
    """Admit, commit the whole prompt (its full blocks enter the prefix cache), optionally free."""
    await kv.add_sequence(sid, prompt)
    await kv.commit(sid, len(prompt))
    if free:
        assert await kv.free(sid) is True


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
        assert stats.pool_bytes == 16 * cfg.bytes_per_block == kv.storage.nbytes

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


# ------------------------------------------------------------ typed errors
VOCAB_ERRORS = [
    ("empty", []),
    ("negative", [1, -1]),
    ("floats", [1.0, 2.0]),
    ("bools", [True, 1]),
    ("string", "abc"),
    ("out_of_vocab", [1, VOCAB]),
    ("float_array", np.array([1.5, 2.0])),
    ("two_dims", [[1, 2], [3, 4]]),
    ("none", None),
]


async def _error_fixture(kv: KVCacheManager) -> list[str]:
    """a (10 tokens, committed, 2 blocks published), b (fork of a), c (published and freed: cached)."""
    await publish(kv, "a", list(range(10)), free=False)
    await kv.fork("a", ["b"])
    await publish(kv, "c", list(range(100, 106)))
    stats = await kv.stats()
    assert (stats.free, stats.active, stats.cached) == (12, 3, 1)
    return ["a", "b"]


ERROR_CALLS = [
    *[(f"add_{name}", lambda kv, t=tokens: kv.add_sequence("n", t), InvalidTokens) for name, tokens in VOCAB_ERRORS],
    *[(f"append_{name}", lambda kv, t=tokens: kv.append("a", t), InvalidTokens) for name, tokens in VOCAB_ERRORS],
    *[(f"lookup_{name}", lambda kv, t=tokens: kv.lookup(t), InvalidTokens) for name, tokens in VOCAB_ERRORS],
    ("append_int_negative", lambda kv: kv.append("a", -1), InvalidTokens),
    ("append_int_out_of_vocab", lambda kv: kv.append("a", VOCAB), InvalidTokens),
    ("append_bool", lambda kv: kv.append("a", True), InvalidTokens),
    ("append_float", lambda kv: kv.append("a", 1.0), InvalidTokens),
    (
        "step_one_bad_admit_applies_none",
        lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1, 2]), Admit(seq_id="m", prompt=[-1])]),
        InvalidTokens,
    ),
    ("step_not_an_admit", lambda kv: kv.step(admits=[("n", [1, 2])]), InvalidInput),
    (
        "admit_prefill_done_str",
        lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1, 2], prefill_done="yes")]),
        InvalidInput,
    ),
    ("admit_resumed_int", lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1, 2], resumed=1)]), InvalidInput),
    ("append_unknown", lambda kv: kv.append("ghost", [1]), UnknownSequence),
    ("commit_unknown", lambda kv: kv.commit("ghost", 1), UnknownSequence),
    ("fork_unknown", lambda kv: kv.fork("ghost", ["x"]), UnknownSequence),
    ("sequence_unknown", lambda kv: kv.sequence("ghost"), UnknownSequence),
    ("step_commit_then_unknown_append", lambda kv: kv.step(commits={"a": 0}, appends={"ghost": [1]}), UnknownSequence),
    ("add_duplicate", lambda kv: kv.add_sequence("a", [1, 2]), DuplicateSequence),
    ("fork_to_live_child", lambda kv: kv.fork("a", ["b"]), DuplicateSequence),
    ("fork_to_itself", lambda kv: kv.fork("a", ["a"]), DuplicateSequence),
    ("fork_repeated_child", lambda kv: kv.fork("a", ["x", "x"]), DuplicateSequence),
    ("fork_child_ids_string", lambda kv: kv.fork("a", "xy"), InvalidInput),
    (
        "step_admit_twice",
        lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1]), Admit(seq_id="n", prompt=[2])]),
        DuplicateSequence,
    ),
    ("commit_negative", lambda kv: kv.commit("a", -1), InvalidInput),
    ("commit_too_many", lambda kv: kv.commit("a", 1), InvalidInput),
    ("commit_float", lambda kv: kv.commit("a", 1.0), InvalidInput),
    ("commit_bool", lambda kv: kv.commit("a", True), InvalidInput),
    ("append_too_large", lambda kv: kv.append("a", [1] * (16 * BS)), RequestTooLarge),
    ("add_too_large", lambda kv: kv.add_sequence("n", [1] * (16 * BS + 1)), RequestTooLarge),
]


@pytest.mark.parametrize(("call", "error"), [(c, e) for _, c, e in ERROR_CALLS], ids=[n for n, _, _ in ERROR_CALLS])
async def test_typed_error_leaves_state_unchanged(tiny_config, call, error) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        ids = await _error_fixture(kv)
        before = await snapshot(kv, ids)
        exhausted = (await kv.stats()).pool_exhausted
        with pytest.raises(error):
            await call(kv)
        assert await snapshot(kv, ids) == before
        assert (await kv.stats()).pool_exhausted == exhausted
        for ghost in ("n", "m", "x", "ghost"):
            with pytest.raises(UnknownSequence):
                await kv.sequence(ghost)
        await kv.check()


async def test_pool_exhausted_carries_the_numbers_and_changes_nothing(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        ids = await _error_fixture(kv)
        await kv.add_sequence("big", [7] * (11 * BS))  # 11 blocks: 1 free and 1 cached left
        ids.append("big")
        before = await snapshot(kv, ids)
        exhausted = (await kv.stats()).pool_exhausted

        with pytest.raises(PoolExhausted) as info:
            await kv.add_sequence("x", list(range(500, 520)))  # 5 blocks, no hit
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (5, 1, 1)
        assert "requested 5 blocks, 1 free, 1 evictable" in str(info.value)

        with pytest.raises(PoolExhausted) as info:  # 5 blocks of which 2 are hits on a's published blocks
            await kv.add_sequence("y", [*range(10), *([50] * 10)])
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (3, 1, 1)

        # 11 more tokens: 3 new blocks plus a copy of the partial tail a shares with b.
        with pytest.raises(PoolExhausted) as info:
            await kv.append("a", [1] * 11)
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (4, 1, 1)

        assert await snapshot(kv, ids) == before
        assert (await kv.stats()).pool_exhausted == exhausted + 3
        # The same shortage in a batched step is a rejection, not an exception, and also leaves no trace.
        result = await kv.step(admits=[Admit(seq_id="x", prompt=list(range(500, 520)))])
        assert set(result.rejected) == {"x"} and isinstance(result.rejected["x"], PoolExhausted)
        assert result.seq_ids == () and result.cached_tokens == {}
        assert await snapshot(kv, ids) == before
        await kv.check()


async def test_request_too_large_fails_at_once_when_the_pool_is_busy(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        for i in range(4):
            await kv.add_sequence(f"s{i}", [i] * (4 * BS))  # every block active
        stats = await kv.stats()
        assert (stats.free, stats.active) == (0, 16)
        before = await snapshot(kv, [f"s{i}" for i in range(4)])
        # "At once": each refusal is one message to the shard (no waiting for room, no retry).
        handled = messages_handled(kv)
        with pytest.raises(RequestTooLarge) as info:
            await kv.add_sequence("huge", [1] * (16 * BS + 1))
        assert (info.value.requested_blocks, info.value.num_blocks) == (17, 16)
        assert messages_handled(kv) == handled + 1
        with pytest.raises(RequestTooLarge):
            await kv.append("s0", [1] * (12 * BS + 1))
        assert messages_handled(kv) == handled + 2
        with pytest.raises(PoolExhausted):  # fits the pool, just not now
            await kv.add_sequence("later", [1])
        assert messages_handled(kv) == handled + 3
        assert await snapshot(kv, [f"s{i}" for i in range(4)]) == before
        await kv.check()


# ------------------------------------------------------------ lifecycle
async def test_calls_outside_async_with_raise_manager_closed(tiny_config) -> None:
    kv = KVCacheManager(tiny_config())
    with pytest.raises(ManagerClosed):
        await kv.add_sequence("a", [1])
    with pytest.raises(ManagerClosed):
        await kv.step()
    async with kv:
        await kv.add_sequence("a", [1, 2, 3])
        await kv.check()
    for call in (kv.stats, kv.check, lambda: kv.free("a"), lambda: kv.lookup([1]), lambda: kv.sequence("a")):
        with pytest.raises(ManagerClosed):
            await call()
    with pytest.raises(ManagerClosed, match="only be entered once"):
        async with kv:
            pass
    with pytest.raises(InvalidInput):
        KVCacheManager({"num_blocks": 8})


@pytest.mark.parametrize("name", ["stats", "lookup", "sequence", "check", "wait_copies"])
async def test_query_calls_before_enter_raise_manager_closed(tiny_config, name: str) -> None:
    # Regression: these raised AttributeError (no shards/tree before __aenter__), fixed in 6e1dc5a.
    kv = KVCacheManager(tiny_config())
    calls = {
        "stats": kv.stats,
        "lookup": lambda: kv.lookup([1, 2]),
        "sequence": lambda: kv.sequence("a"),
        "check": kv.check,
        "wait_copies": kv.wait_copies,
    }
    with pytest.raises(ManagerClosed, match="is new"):
        await calls[name]()


async def test_two_managers_coexist(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as one, KVCacheManager(tiny_config(num_blocks=8)) as two:
        await publish(one, "a", list(range(9)))
        assert await one.lookup(list(range(9))) == 8
        assert await two.lookup(list(range(9))) == 0
        assert (await two.stats()).free == 8
        await one.check()
        await two.check()


async def test_shutdown_with_calls_in_flight_raises_instead_of_hanging(tiny_config) -> None:
    outcomes: list[str] = []
    completed = 0
    warmed_up = anyio.Event()

    async def caller(kv: KVCacheManager, i: int) -> None:
        nonlocal completed
        try:
            for n in range(10_000):
                await kv.add_sequence(f"s{i}-{n}", [1, 2, 3, 4, 5])
                await kv.free(f"s{i}-{n}")
                completed += 1
                if completed == 24:
                    warmed_up.set()
        except (ManagerClosed, ActorCrashed) as exc:
            outcomes.append(type(exc).__name__)
        else:
            outcomes.append("finished")

    with anyio.fail_after(60):
        # The callers' task group outlives the manager: they are still calling when it shuts down.
        async with anyio.create_task_group() as tg, KVCacheManager(tiny_config(num_blocks=64, inbox_capacity=2)) as kv:
            for i in range(12):
                tg.start_soon(caller, kv, i)
            await warmed_up.wait()
            await kv.check()
    assert len(outcomes) == 12
    assert set(outcomes) <= {"ManagerClosed", "ActorCrashed"}, outcomes
    with pytest.raises(ManagerClosed):
        await kv.add_sequence("late", [1])


async def test_crashed_actor_fails_every_call_and_exit(tiny_config, monkeypatch) -> None:
    real_step = ShardState.step

    boom_served = anyio.Event()

    def exploding_step(self, request):
        if any("boom" in str(adm.seq_id) for adm in request.admits):
            yield [("size",)]  # one tree round trip
            boom_served.set()
            raise RuntimeError("boom")
        return (yield from real_step(self, request))

    monkeypatch.setattr(ShardState, "step", exploding_step)
    outcomes: dict[object, BaseException | None] = {}

    async def pending(kv: KVCacheManager, i: object, after_boom: bool = True) -> None:
        if after_boom:
            await boom_served.wait()
        try:
            await kv.add_sequence(f"p{i}", [1, 2, 3])
            outcomes[i] = None
        except BaseException as exc:
            outcomes[i] = exc

    with anyio.fail_after(60):
        with pytest.raises(ActorCrashed) as at_exit:
            async with KVCacheManager(tiny_config()) as kv:
                await kv.add_sequence("fine", [1, 2, 3])
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pending, kv, -1, False)  # races the crash: served or refused
                    for i in range(8):  # these wait for the crash
                        tg.start_soon(pending, kv, i)
                    tg.start_soon(pending, kv, "boom", False)
                with pytest.raises(ActorCrashed) as crashed:
                    await kv.add_sequence("boom", [1, 2, 3])
                assert isinstance(crashed.value.__cause__, RuntimeError)
                for call in (
                    kv.stats,
                    kv.check,
                    lambda: kv.lookup([1, 2]),
                    lambda: kv.sequence("fine"),
                    lambda: kv.free("fine"),
                    lambda: kv.append("fine", [4]),
                ):
                    with pytest.raises(ActorCrashed):
                        await call()
    assert at_exit.value.actor == "pool_shard_0"
    assert isinstance(at_exit.value.cause, RuntimeError)
    # p-1 may have been served before the crash; boom and every later call saw the crash.
    assert outcomes.keys() == {-1, "boom", *range(8)}
    assert outcomes[-1] is None or isinstance(outcomes[-1], ActorCrashed), outcomes[-1]
    assert all(isinstance(outcomes[i], ActorCrashed) for i in ("boom", *range(8))), outcomes

    monkeypatch.undo()
    async with KVCacheManager(tiny_config()) as fresh:
        assert await fresh.add_sequence("fine", [1, 2, 3]) == 0
        assert await fresh.free("fine") is True
        await fresh.check()


async def test_failed_copy_fails_the_manager(tiny_config, monkeypatch) -> None:
    def broken_copy(self, src, dst):
        raise RuntimeError("device error")

    with anyio.fail_after(60), pytest.raises(ActorCrashed):
        async with KVCacheManager(tiny_config()) as kv:
            await kv.add_sequence("a", [1, 2, 3, 4, 5])
            await kv.fork("a", ["b"])
            monkeypatch.setattr(KVStorage, "_copy_unchecked", broken_copy)
            result = await kv.append("b", [6])  # copy-on-write of the shared tail: the copy fails
            with pytest.raises(ActorCrashed):
                await result.copies.wait()
            with pytest.raises(ActorCrashed):
                await kv.stats()


async def test_cancelled_caller_then_free_leaks_nothing(tiny_config) -> None:
    """12 callers run add, commit, append while cancelled after 0, 1, 2, ... checkpoints (0: before
    the add). Whatever was applied, ``free`` says exactly whether the sequence was live, and every
    block comes back: the committed prompts' full blocks cached, nothing else held."""
    async with KVCacheManager(tiny_config(num_blocks=48)) as kv:
        prompts = [[i, *range(20, 28), i] for i in range(12)]  # 3 blocks each (2 full), no shared prefix
        returned: dict[int, str] = {}

        async def one(i: int) -> None:
            await kv.add_sequence(f"c{i}", prompts[i])
            returned[i] = "added"
            await kv.commit(f"c{i}", len(prompts[i]))
            await kv.append(f"c{i}", [5, 6])
            returned[i] = "appended"

        finished: dict[int, bool] = {}

        async def cancelled(i: int) -> None:
            finished[i] = await run_cancelled(lambda: one(i), i)

        async with anyio.create_task_group() as tg:  # cancelled at varying points while the others run
            for i in range(12):
                tg.start_soon(cancelled, i)
        assert finished[0] is False and 0 not in returned  # cancelled before it started
        assert any(finished.values()), "no caller finished: the sweep never reached the end of the calls"
        assert {i for i, done in finished.items() if done} == {i for i, r in returned.items() if r == "appended"}

        num_live = num_committed = 0
        for i in range(12):
            try:
                info = await kv.sequence(f"c{i}")
            except UnknownSequence:
                info = None
            if i in returned:
                assert info is not None, f"c{i}: add_sequence returned but the sequence is gone"
            num_live += info is not None
            num_committed += info is not None and info.num_computed == len(prompts[i])
            assert await kv.free(f"c{i}") is (info is not None)
            with pytest.raises(UnknownSequence):
                await kv.sequence(f"c{i}")
        await kv.wait_copies()
        stats = await kv.stats()
        assert (stats.active, stats.in_flight, stats.num_sequences) == (0, 0, 0)
        assert stats.sequences_added == stats.sequences_freed == num_live
        assert stats.cached == stats.prefix_cache_blocks == 2 * num_committed
        assert stats.free == 48 - 2 * num_committed
        await kv.check()


# ------------------------------------------------------------------ shards
async def test_two_shards_route_and_keep_forks_in_the_parent_shard(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        run = Runner(kv)
        await run.admit("a", list(range(10)))
        await run.admit("b", list(range(100, 110)))
        a, b = await kv.sequence("a"), await kv.sequence("b")
        assert (a.shard, b.shard) == (0, 1)
        assert all(0 <= x < 8 for x in a.block_ids)
        assert all(8 <= x < 16 for x in b.block_ids)

        await run.fork("a", ["a1", "a2"])
        for child in ("a1", "a2"):
            info = await kv.sequence(child)
            assert (info.shard, info.block_ids, info.parent_id) == (0, a.block_ids, "a")
        result = await run.append({"a1": [1], "b": [2], "a2": [3, 4]})
        assert set(result.seq_ids) == {"a1", "b", "a2"}
        assert result.copies.num_blocks == 2  # a1 and a2 each copy the tail they share with a
        assert all(0 <= x < 8 for x in (await kv.sequence("a1")).block_ids)
        for sid in ("a", "a1", "a2", "b"):
            await run.verify(sid)

        # Prefix hits are shard-local; lookup reports the best shard.
        assert await kv.lookup(list(range(10))) == 8
        assert await kv.lookup(list(range(100, 110))) == 8
        stats = await kv.stats()
        assert stats.num_sequences == 4
        assert stats.free + stats.active + stats.cached == 16
        assert stats.max_inbox_depth.keys() == {"pool_shard_0", "pool_shard_1"}
        for sid in ("a", "a1", "a2", "b"):
            assert await kv.free(sid) is True
        assert await kv.free("a") is False
        stats = await kv.stats()
        assert (stats.active, stats.num_sequences, stats.free + stats.cached) == (0, 0, 16)
        await kv.check()


async def test_two_shards_cancelled_step_then_free_leaks_nothing(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=2)) as kv:
        admitted = 0
        for round_ in range(12):  # cancelled after 0, 1, 2, ... checkpoints
            ids = [f"r{round_}-{i}" for i in range(4)]
            admits = [Admit(seq_id=s, prompt=[round_, i, 1, 2, 3]) for i, s in enumerate(ids)]
            finished = await run_cancelled(lambda admits=admits: kv.step(admits=admits), round_)
            freed = [await kv.free(sid) for sid in ids]
            assert freed == [freed[0]] * 4, f"round {round_}: the step was applied in part ({freed})"
            assert freed[0] or not finished
            admitted += 4 * freed[0]
        assert 0 < admitted < 48  # some steps were cancelled before they were sent, some applied
        stats = await kv.stats()
        assert (stats.active, stats.num_sequences, stats.free + stats.cached) == (0, 0, 32)
        assert stats.sequences_added == stats.sequences_freed == admitted
        await kv.check()


async def test_two_shards_duplicate_id_is_refused(tiny_config) -> None:
    # Regression: the second "a" was routed to the other shard and admitted; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        await kv.add_sequence("a", list(range(10)))  # shard 0; shard 1 is now the emptier one
        with pytest.raises(DuplicateSequence):
            await kv.add_sequence("a", list(range(10)))
        assert (await kv.stats()).num_sequences == 1


async def test_two_shards_error_applies_nothing(tiny_config) -> None:
    # Regression: shard 0's part (a's commit, publishing 2 blocks) was applied before shard 1 raised; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        await kv.add_sequence("a", list(range(10)))
        await kv.add_sequence("b", list(range(10)))
        assert ((await kv.sequence("a")).shard, (await kv.sequence("b")).shard) == (0, 1)
        before = await snapshot(kv, ["a", "b"])
        with pytest.raises(InvalidInput):
            await kv.step(commits={"a": 8, "b": 99})  # b's commit is invalid
        assert await snapshot(kv, ["a", "b"]) == before


async def test_two_shards_free_and_readmit_same_id_in_one_step(tiny_config) -> None:
    # Regression: the free in shard 1 dropped the route the re-admission in shard 0 had just set; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        await kv.add_sequence("x", list(range(20)))  # shard 0
        await kv.add_sequence("a", list(range(5)))  # shard 1
        await kv.free("x")  # shard 0 is the emptier one again
        await kv.step(frees=["a"], admits=[Admit(seq_id="a", prompt=[7, 7, 7])])
        info = await kv.sequence("a")  # raises UnknownSequence: the route was dropped
        assert info.token_ids == (7, 7, 7)
        assert await kv.free("a") is True
        assert (await kv.stats()).num_sequences == 0


async def test_two_shards_rows_in_request_order(tiny_config) -> None:
    # Regression: rows came grouped by shard, not in request order as StepResult documents; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=2)) as kv:
        run = Runner(kv)
        await run.admit("a", [1, 2, 3])  # shard 0
        await run.admit("b", [4, 5, 6])  # shard 1
        await run.fork("a", ["a1"])  # shard 0
        for sid, toks in {"a": [7], "b": [8, 9, 10], "a1": [11, 12]}.items():
            run.history[sid].extend(toks)
        run.history["c"] = [13, 14, 15, 16, 17]
        run.history["d"] = [18]
        result = await kv.step(
            appends={"a": [7], "b": [8, 9, 10], "a1": [11, 12]},
            admits=[Admit(seq_id="c", prompt=run.history["c"]), Admit(seq_id="d", prompt=run.history["d"])],
        )
        assert result.seq_ids == ("a", "b", "a1", "c", "d")
        assert result.context_lens.tolist() == [4, 6, 5, 5, 1]
        assert result.query_start_loc.tolist() == [0, 1, 4, 6, 11, 12]
        for row, sid in enumerate(result.seq_ids):
            info = await kv.sequence(sid)
            assert result.block_tables[row, : len(info.block_ids)].tolist() == list(info.block_ids)
            a, b = result.query_start_loc[row : row + 2].tolist()
            start = len(info.token_ids) - (b - a)
            want = [info.block_ids[p // BS] * BS + p % BS for p in range(start, len(info.token_ids))]
            assert result.slot_mapping[a:b].tolist() == want
        await run.write(result)
        for sid in ("a", "b", "a1", "c", "d"):
            await run.verify(sid)
        await kv.check()


async def test_rejected_admission_does_not_expose_a_later_admissions_hits(tiny_config) -> None:
    # Regression: "big" being rejected unprotected the hits "small" shares; small's eviction then took
    # its own hit and the shard crashed (ValueError: incref of a free block); fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=7)) as kv:
        shared = list(range(8))  # 2 blocks
        await publish(kv, "a", [*shared, 100])  # 2 cached blocks (least recently used), 5 free
        await publish(kv, "z", [200, 201, 202, 203, 204])  # 1 more cached block, 4 free
        await kv.add_sequence("x", [50] * 12)  # 3 blocks: 1 free left
        result = await kv.step(
            admits=[
                Admit(seq_id="big", prompt=[*shared, *([7] * 16)]),  # 2 hits + 4 new: PoolExhausted
                Admit(seq_id="small", prompt=[*shared, 9, 9, 9, 9, 9]),  # 2 hits + 2 new: evicts z's block
            ]
        )
        assert isinstance(result.rejected["big"], PoolExhausted)
        assert result.cached_tokens == {"small": 8}
        assert result.evicted_blocks == 1
        assert await kv.lookup([200, 201, 202, 203, 204]) == 0
        await kv.check()


@pytest.mark.parametrize("num_shards", [1, 2])
async def test_malformed_ids_and_arguments_are_typed_errors_not_crashes(tiny_config, num_shards: int) -> None:
    """Regression (fresh-eyes review): an unhashable id or namespace crashed the shard actor, and a
    string given as ``frees`` freed one id per character."""
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=num_shards)) as kv:
        for seq_id in ("r", "e", "q"):
            await kv.add_sequence(seq_id, [1, 2, 3])
        before = await kv.stats()
        calls = [
            lambda: kv.free(["x"]),
            lambda: kv.add_sequence(["c"], [1]),
            lambda: kv.fork("r", [["z"]]),
            lambda: kv.sequence({}),
            lambda: kv.add_sequence("n", [1], namespace=[1]),
            lambda: kv.lookup([1, 2], namespace={}),
            lambda: kv.step(frees="req"),
            lambda: kv.step(appends=[("r", 1)]),
            lambda: kv.step(forks=["r"]),
        ]
        for call in calls:
            with pytest.raises(InvalidInput):
                await call()
        assert await kv.stats() == before
        await kv.check()


async def test_numpy_and_torch_integer_scalars_are_one_token(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        await kv.append("a", np.int64(5))
        await kv.append("a", torch.tensor(6))
        assert (await kv.sequence("a")).token_ids == (1, 2, 3, 5, 6)
        with pytest.raises(InvalidTokens):
            await kv.append("a", np.bool_(True))
