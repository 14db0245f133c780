"""The host tier through the manager with real CPU tensors: what a sequence reads back after demotion, promotion and swaps.

A runner writes each position's K/V as a function of the token history
(:func:`akv.testing.prefix_model.history_values`), waits for every step's
copies before writing (as it must), and reads sequences back through their
block tables. Bad input and refusals change nothing.
"""

from __future__ import annotations

import os
import signal
import threading

import anyio
import anyio.lowlevel
import pytest
import torch

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.errors import DuplicateSequence, InvalidInput, PoolExhausted, UnknownSequence
from akv.testing.prefix_model import history_values

BS = 4


def expected(kv: KVCacheManager, tokens: list[int]) -> torch.Tensor:
    m = kv.config.model
    return history_values(None, tokens, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)


async def admit(kv: KVCacheManager, seq_id, tokens: list[int]) -> int:
    """Admit, wait for the step's copies, write the uncached tokens' K/V, commit; return the cached tokens."""
    result = await kv.step(admits=[Admit(seq_id=seq_id, prompt=tokens)])
    if seq_id in result.rejected:
        raise result.rejected[seq_id]
    await result.copies.wait()
    cached = result.cached_tokens[seq_id]
    values = expected(kv, tokens)[:, :, cached:]
    kv.storage.write_all_layers(result.slot_mapping.to(torch.int64), values[:, 0], values[:, 1])
    await kv.commit(seq_id, len(tokens) - cached)
    return cached


async def read(kv: KVCacheManager, seq_id) -> torch.Tensor:
    info = await kv.sequence(seq_id)
    table = torch.tensor(info.block_ids, dtype=torch.int64)
    layers = [kv.storage.gather(layer, table, info.num_tokens) for layer in range(kv.config.model.num_layers)]
    return torch.stack([torch.stack(kv_pair) for kv_pair in layers])


def prompt(i: int, blocks: int = 4) -> list[int]:
    return [100 * i + t for t in range(blocks * BS + 1)]


@pytest.mark.anyio
async def test_demoted_blocks_come_back_byte_exact_when_a_prompt_hits_them(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=32)) as kv:
        for i in range(8):  # 5 blocks each (4 cached): the device (16) keeps the last 15, the host the others
            await admit(kv, i, prompt(i))
            await kv.free(i)
        stats = await kv.stats()
        assert stats.demoted_blocks == stats.host_cached == 32 - 15
        await kv.wait_copies()  # a demoted block is matched once its copy has run (unready until then)
        cached = await admit(kv, "again", prompt(0))
        assert cached == 4 * BS
        assert torch.equal(await read(kv, "again"), expected(kv, prompt(0)))
        stats = await kv.stats()
        assert stats.promoted_blocks == 4 and stats.host_hit_tokens == 4 * BS
        await kv.check()


@pytest.mark.anyio
async def test_background_eviction_demotes_and_nothing_is_lost_while_the_copies_run(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=16)) as kv:
        for i in range(3):
            await admit(kv, i, prompt(i))
            await kv.free(i)
        assert await kv.evict(8) == 8  # held: in flight until their copies ran
        await kv.wait_copies()
        stats = await kv.stats()
        assert (stats.demoted_blocks, stats.host_cached, stats.in_flight) == (8, 8, 0)
        assert stats.free + stats.active + stats.cached == stats.num_blocks
        for i in range(3):
            assert await admit(kv, f"r{i}", prompt(i)) == 4 * BS
            assert torch.equal(await read(kv, f"r{i}"), expected(kv, prompt(i)))
        await kv.check()


@pytest.mark.anyio
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_a_swapped_sequence_reads_exactly_what_it_had(tiny_config, num_shards: int) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=16, num_shards=num_shards)) as kv:
        history = prompt(1, blocks=2)
        await admit(kv, "a", history)
        result = await kv.step(appends={"a": 7})
        await result.copies.wait()
        history.append(7)
        values = expected(kv, history)[:, :, -1:]
        kv.storage.write_all_layers(result.slot_mapping.to(torch.int64), values[:, 0], values[:, 1])
        await kv.commit("a", 1)
        before = await read(kv, "a")
        assert await kv.swap_out("a") == 3
        with pytest.raises(UnknownSequence):
            await kv.append("a", [1])
        for i in range(2, 6):  # other work reuses the device blocks "a" had
            await admit(kv, i, prompt(i, blocks=1))
            await kv.free(i)
        assert await kv.swap_in("a") == 3
        assert torch.equal(await read(kv, "a"), before)
        assert (await kv.sequence("a")).token_ids == tuple(history)
        stats = await kv.stats()
        assert (stats.swapped_out, stats.swapped_in, stats.num_swapped, stats.host_swapped) == (1, 1, 0, 0)
        await kv.check()


@pytest.mark.anyio
async def test_swap_refusals_and_bad_input_change_nothing(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, host_blocks=8)) as kv:
        with pytest.raises(InvalidInput):
            await kv.swap_out(1.5)
        with pytest.raises(UnknownSequence):
            await kv.swap_in("nobody")
        await admit(kv, "a", prompt(1, blocks=3))
        await kv.swap_out("a")
        with pytest.raises(UnknownSequence, match="'a' is swapped out already"):  # was "unknown or finished"
            await kv.swap_out("a")
        await admit(kv, "b", prompt(2, blocks=5))  # 6 blocks: no room left for "a"'s 4
        before = await kv.stats()
        with pytest.raises(PoolExhausted):
            await kv.swap_in("a")
        after = await kv.stats()
        assert (after.num_swapped, after.host_swapped, after.num_sequences) == (1, 4, 1)
        assert after.free == before.free
        with pytest.raises(DuplicateSequence):
            await kv.step(admits=[Admit(seq_id="a", prompt=[1, 2, 3])])  # its id stays taken while swapped out
        await kv.free("b")
        assert await kv.swap_in("a") == 4
        with pytest.raises(DuplicateSequence, match="it is live, not swapped out"):
            await kv.swap_in("a")
        assert await kv.free("a")
        await kv.check()


@pytest.mark.anyio
async def test_freeing_a_swapped_sequence_releases_its_host_blocks(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, host_blocks=8)) as kv:
        await admit(kv, "a", prompt(1, blocks=2))
        await kv.swap_out("a")
        assert (await kv.stats()).host_swapped == 3
        assert await kv.free("a")
        stats = await kv.stats()
        assert (stats.host_swapped, stats.num_swapped, stats.host_free) == (0, 0, 8)
        assert not await kv.free("a")
        await kv.check()


@pytest.mark.anyio
async def test_a_cancelled_swap_out_completes(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, host_blocks=8)) as kv:
        await admit(kv, "a", prompt(1, blocks=2))
        before = await read(kv, "a")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await kv.swap_out("a")  # shielded: runs to completion inside the cancelled scope
        assert (await kv.stats()).num_swapped == 1
        await kv.swap_in("a")
        assert torch.equal(await read(kv, "a"), before)
        await kv.check()


@pytest.mark.anyio
async def test_swapping_without_a_host_tier_is_invalid_input(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await admit(kv, "a", prompt(1, blocks=1))
        with pytest.raises(InvalidInput, match="no host tier"):
            await kv.swap_out("a")
        for seq_id in ("a", "unknown"):  # said as for swap_out, not DuplicateSequence / UnknownSequence
            with pytest.raises(InvalidInput, match=r"cannot swap in .* no host tier"):
                await kv.swap_in(seq_id)
        assert (await kv.sequence("a")).num_tokens == BS + 1
        await kv.check()


@pytest.mark.anyio
async def test_a_swapped_sequence_cannot_be_forked_or_reused_as_a_child_id(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, host_blocks=8)) as kv:
        await admit(kv, "a", prompt(1, blocks=1))
        await admit(kv, "b", prompt(2, blocks=1))
        await kv.swap_out("a")
        with pytest.raises(UnknownSequence):
            await kv.fork("a", ["a1"])
        with pytest.raises(DuplicateSequence):
            await kv.fork("b", ["a"])
        await kv.check()
        await kv.swap_in("a")
        await kv.fork("a", ["a1"])
        await kv.check()


class _StoppedChild:
    """A copy process held with SIGSTOP; :meth:`set` lets it go on (SIGCONT)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        os.kill(pid, signal.SIGSTOP)

    def set(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def _hold_copies(kv: KVCacheManager) -> threading.Event | _StoppedChild:
    """Hold every copy batch until the returned gate is set: the copy process stopped, or the worker thread's copier."""
    process = kv._executor._process  # reaching in on purpose: the real copies, held at their seam
    if process is not None:
        return _StoppedChild(process.pid)
    gate = threading.Event()
    copier = kv._executor._cpu_copier
    run = copier.run

    def held(batch) -> None:
        gate.wait(30)
        run(batch)

    copier.run = held
    return gate


@pytest.mark.anyio
async def test_a_block_demoted_on_demand_is_not_written_before_its_copy_ran(tiny_config) -> None:
    """Regression: an admission refused after part of its room was made left a block it had demoted
    on demand free, its copy to the host pending; the next step handed it out with no copy to wait
    for, its runner wrote it, and the late copy put that K/V in the host block: a prompt hitting the
    demoted prefix read another sequence's K/V. Two guards now: the room check is exact (a's first
    block, cached above a tail a pending copy pins, is not counted), so the refused admission demotes
    nothing; and a step handing out a block whose demotion copy is pending carries that batch's
    ticket (the tier machine's runner waits only for what a step gives it)."""
    async with KVCacheManager(tiny_config(num_blocks=6, host_blocks=8)) as kv:
        gate = _hold_copies(kv)
        try:
            await admit(kv, "a", [1, 2, 3, 4, 5, 6])
            await kv.fork("a", ["b"])
            await kv.append("b", [7])  # copy-on-write of the shared tail: held
            await kv.append("a", [8, 9])
            await kv.commit("a", 2)  # a's tail is full and published, still the held copy's source
            await kv.free("a")
            await kv.free("b")  # a's first block cached above its pinned tail: not evictable yet
            v = [20, 21, 22, 23, 24]
            await admit(kv, "v", v)  # no copies of its own to wait for
            await kv.free("v")  # v's first block: a cached leaf
            result = await kv.step(admits=[Admit(seq_id="big", prompt=list(range(30, 46)))])
            assert isinstance(result.rejected["big"], PoolExhausted)
            assert (await kv.stats()).demoted_blocks == 0  # refused before anything was evicted
            result = await kv.step(admits=[Admit(seq_id="c", prompt=[40])])

            async def runner() -> None:  # waits for the step's copies, then writes c's K/V
                await result.copies.wait()
                values = expected(kv, [40])
                kv.storage.write_all_layers(result.slot_mapping.to(torch.int64), values[:, 0], values[:, 1])

            async with anyio.create_task_group() as tg:
                tg.start_soon(runner)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                gate.set()
        finally:
            gate.set()
        await kv.commit("c", 1)
        assert await admit(kv, "v2", v) == BS  # v's demoted block, promoted
        assert torch.equal(await read(kv, "v2"), expected(kv, v))
        await kv.check()


@pytest.mark.anyio
async def test_add_sequence_returns_once_its_promotion_copies_ran(tiny_config) -> None:
    """Regression: add_sequence returned the cached tokens while the copies promoting its host hits
    were still pending, and gave the caller nothing to wait on: a runner reading the hits (or writing
    a block the step demoted on demand) raced the copies. It now returns after them."""
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=32)) as kv:
        for i in range(8):
            await admit(kv, i, prompt(i))
            await kv.free(i)
        assert await kv.lookup(prompt(0)) == 4 * BS and (await kv.stats()).host_cached > 4  # prompt 0 is on the host
        gate = _hold_copies(kv)
        returned = anyio.Event()

        async def add() -> None:
            assert await kv.add_sequence("again", prompt(0)) == 4 * BS
            returned.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(add)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                assert not returned.is_set()  # its promotion copies are held
                gate.set()
        finally:
            gate.set()
        assert (await kv.stats()).promoted_blocks == 4
        got = await read(kv, "again")  # at once, as a runner would
        assert torch.equal(got[:, :, : 4 * BS], expected(kv, prompt(0))[:, :, : 4 * BS])
        await kv.check()


@pytest.mark.anyio
async def test_a_promoted_block_freed_before_its_copy_ran_is_not_handed_out_under_it(tiny_config) -> None:
    """Regression (found by ``akv stress --host-blocks 256 --fault slow_copies``): the device blocks a
    promotion copies into were not pinned; a request freed before the copy ran (cancelled) left them
    cached, an eviction with no host room dropped them, and the next admission wrote them with nothing
    to wait for, under the late copy. They are now in flight until the copy ran."""
    async with KVCacheManager(tiny_config(num_blocks=6, host_blocks=2)) as kv:
        p = prompt(1, blocks=2)
        await admit(kv, "p", p)
        await kv.free("p")
        assert await kv.evict(2) == 2  # both full blocks of p demoted: the host tier is full
        await kv.wait_copies()
        gate = _hold_copies(kv)
        try:
            result = await kv.step(admits=[Admit(seq_id="p2", prompt=p)])  # promotes both, copies held
            assert result.cached_tokens["p2"] == 2 * BS
            await kv.free("p2")  # its request is cancelled before the copies ran
            assert (await kv.stats()).in_flight == 2
            result = await kv.step(admits=[Admit(seq_id="c", prompt=list(range(500, 500 + 6 * BS)))])
            assert isinstance(result.rejected["c"], PoolExhausted)  # 4 free: the 2 promoted blocks wait
        finally:
            gate.set()
        await kv.wait_copies()
        assert await admit(kv, "p3", p) == 2 * BS
        assert torch.equal(await read(kv, "p3"), expected(kv, p))
        await kv.check()


@pytest.mark.anyio
async def test_a_block_demoted_on_demand_and_freed_by_its_taker_waits_for_its_copy(tiny_config) -> None:
    """Regression (found by ``akv stress --host-blocks 256 --fault slow_copies``): a step that demoted a
    block on demand and took it itself was fine (its runner waits for its copies), but its request,
    freed before the copy ran, put the block back on the free queue: the next admission wrote it with
    nothing to wait for, and the late copy to the host took that K/V. It now stays in flight."""
    async with KVCacheManager(tiny_config(num_blocks=4, host_blocks=8)) as kv:
        v = [20, 21, 22, 23, 24]
        await admit(kv, "v", v)
        await kv.free("v")  # v's first block cached, 3 blocks free
        gate = _hold_copies(kv)
        try:
            result = await kv.step(admits=[Admit(seq_id="a", prompt=list(range(30, 30 + 4 * BS)))])
            assert result.cached_tokens["a"] == 0 and (await kv.stats()).demoted_blocks == 1  # on demand
            await kv.free("a")  # cancelled before the copy ran
            assert (await kv.stats()).in_flight == 1
            result = await kv.step(admits=[Admit(seq_id="c", prompt=list(range(60, 60 + 4 * BS)))])
            assert isinstance(result.rejected["c"], PoolExhausted)  # 3 free: v's old block waits
        finally:
            gate.set()
        await kv.wait_copies()
        assert await admit(kv, "v2", v) == BS  # promoted from the host: exactly v's K/V
        assert torch.equal(await read(kv, "v2"), expected(kv, v))
        await kv.check()


@pytest.mark.anyio
async def test_a_sequence_freed_while_its_swap_in_copies_run_leaves_its_blocks_in_flight(tiny_config) -> None:
    """The device blocks a swap-in copies into are pinned like a promotion's: a concurrent free (the
    request aborted while it was being resumed) must not hand them out under the pending copy."""
    async with KVCacheManager(tiny_config(num_blocks=8, host_blocks=8)) as kv:
        await admit(kv, "a", prompt(1, blocks=2))
        await kv.swap_out("a")
        gate = _hold_copies(kv)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(kv.swap_in, "a")  # returns once its copies ran
                while (await kv.stats()).num_swapped:
                    await anyio.lowlevel.checkpoint()
                assert await kv.free("a")  # live again at the shard, its copies still held
                assert (await kv.stats()).in_flight == 3
                gate.set()
        finally:
            gate.set()
        await kv.wait_copies()
        stats = await kv.stats()
        assert (stats.free + stats.cached, stats.in_flight, stats.host_free) == (8, 0, 8)
        await kv.check()


@pytest.mark.anyio
async def test_host_block_refcounts_are_the_swapped_sequences_blocks_and_check_holds_them_to_it(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, host_blocks=8)) as kv:
        await admit(kv, "a", prompt(1, blocks=2))
        assert kv.host_block_refcounts() == {}
        await kv.swap_out("a")
        refs = kv.host_block_refcounts()
        assert len(refs) == 3 and set(refs.values()) == {1} and min(refs) >= kv.config.host_block_base
        await kv.check()
        state = kv._shards[0].state  # reaching in on purpose: a host reference no swapped sequence holds
        (spare,) = state.host.allocate(1)
        with pytest.raises(AssertionError, match="swapped-out sequences hold 3"):
            state.check()
        state.host.decref([spare])
        await kv.free("a")
        assert kv.host_block_refcounts() == {}
        await kv.check()


@pytest.mark.anyio
async def test_a_later_admission_of_the_step_hits_the_blocks_an_earlier_one_promoted(tiny_config) -> None:
    """Two admissions of one step sharing a prefix on the host: the first promotes it, the second hits
    the promoted blocks (the step's runner waits for the step's copies before reading either). Found by
    the manager machine: the second recomputed the prefix, as promoted blocks are unmatched until their
    copy ran, though the step that promoted them may hit them."""
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=16)) as kv:
        p = prompt(1, blocks=2)
        await admit(kv, "p", p)
        await kv.free("p")
        assert await kv.evict(2) == 2
        await kv.wait_copies()
        a, b = [*p[: 2 * BS], 7], [*p[: 2 * BS], 8, 9]
        result = await kv.step(admits=[Admit(seq_id="a", prompt=a), Admit(seq_id="b", prompt=b)])
        assert dict(result.cached_tokens) == {"a": 2 * BS, "b": 2 * BS}
        assert (await kv.stats()).promoted_blocks == 2  # once, shared
        await result.copies.wait()
        qsl = result.query_start_loc.tolist()
        for i, (sid, tokens) in enumerate((("a", a), ("b", b))):
            values = expected(kv, tokens)[:, :, 2 * BS :]
            slots = result.slot_mapping[qsl[i] : qsl[i + 1]].to(torch.int64)
            kv.storage.write_all_layers(slots, values[:, 0], values[:, 1])
            assert torch.equal(await read(kv, sid), expected(kv, tokens))
        assert (await kv.sequence("a")).block_ids[:2] == (await kv.sequence("b")).block_ids[:2]
        await kv.check()


@pytest.mark.anyio
async def test_a_refusal_while_a_demotion_fills_the_host_tier_counts_no_stuck_block_as_evictable(tiny_config) -> None:
    """Found by the manager machine: a chain of cached blocks, demoted deepest first into a host tier
    with room for two of them, leaves its top block cached with a host child still being copied: it can
    neither move (no host room) nor be dropped (it has a child) until the copy ran. The refusal counted
    it as evictable (``requested 5 blocks, 4 free, 1 evictable``); a scheduler reading the numbers saw
    room. Blocks above a host block whose copy is pending are not evictable now."""
    async with KVCacheManager(tiny_config(num_blocks=5, host_blocks=2)) as kv:
        await admit(kv, "p", prompt(1, blocks=3))
        await kv.free("p")  # 3 cached blocks in one chain, 2 free
        big = list(range(500, 500 + 5 * BS))
        result = await kv.step(admits=[Admit(seq_id="q", prompt=big)])
        err = result.rejected["q"]
        assert isinstance(err, PoolExhausted) and (await kv.stats()).demoted_blocks == 2
        assert err.requested_blocks > err.free_blocks + err.evictable_blocks, err
        await result.copies.wait()
        await kv.wait_copies()  # the host blocks are ready: the top block may move now
        assert await admit(kv, "q", big) == 0
        assert torch.equal(await read(kv, "q"), expected(kv, big))
        await kv.check()


@pytest.mark.anyio
async def test_a_full_host_tier_refuses_a_swap_out_naming_the_host(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=4)) as kv:
        await admit(kv, "a", prompt(1, blocks=3))  # 4 blocks with the partial tail
        await admit(kv, "b", prompt(2, blocks=3))
        await kv.swap_out("a")
        with pytest.raises(PoolExhausted, match="host tier exhausted: requested 4 blocks, 0 free") as err:
            await kv.swap_out("b")
        assert err.value.tier == "host" and (await kv.stats()).num_sequences == 1
        await kv.check()


def test_a_host_gib_below_one_block_is_refused() -> None:
    with pytest.raises(InvalidInput, match="less than one block"):
        KVCacheConfig(num_blocks=64, block_size=4, host_gib=1e-9)


@pytest.mark.anyio
@pytest.mark.parametrize("copy_process", [True, False])
async def test_a_batch_that_finishes_while_the_shard_is_idle_is_settled_with_no_message(
    tiny_config, monkeypatch: pytest.MonkeyPatch, copy_process: bool
) -> None:
    """A held demotion's device blocks are free, and its host blocks matchable, once its copy ran: the
    shard settles the batch when the copy thread reports it, not at its next message (a step's)."""
    from akv.actors.pool_shard import PoolShardActor

    finished = anyio.Event()
    real = PoolShardActor._copy_finished

    def recorded(actor: PoolShardActor) -> None:
        real(actor)
        finished.set()

    monkeypatch.setattr(PoolShardActor, "_copy_finished", recorded)
    cfg = tiny_config(num_blocks=8, host_blocks=16, low_watermark=0.0, high_watermark=0.0, copy_process=copy_process)
    async with KVCacheManager(cfg) as kv:
        (shard,) = kv._shards  # reaching in on purpose: the published snapshot, read with no message
        gate = _hold_copies(kv)
        try:
            await admit(kv, "a", prompt(0, blocks=3))
            await kv.free("a")
            assert await kv.evict(3) == 3  # held: in flight until their copy ran
            handled = shard.messages_handled
            before = shard.snapshot
            assert (before.num_free, before.demoting) == (5, 3)
        finally:
            gate.set()
        with anyio.fail_after(30):  # a hang guard, not a timing check
            await finished.wait()
        after = shard.snapshot
        assert (after.num_free, after.demoting) == (8, 0)
        assert shard.messages_handled == handled + 1  # the settling, served by the shard itself
        assert await kv.lookup(prompt(0, blocks=3)) == 3 * BS  # on the host, matchable
        await kv.check()
