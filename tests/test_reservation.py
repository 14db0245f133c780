"""Reservations at admission (``max_new_tokens``) and ``wait_for_room``: decode that never runs out.

Pools are tiny (block_size 4) so every count is exact. The manager tests run
real actors on CPU tensors; the property test steps a :class:`ShardState`
(which owns its radix tree) and checks, after every step, that no reserved
sequence within its reservation was ever refused and that the reservations
add up (``ShardState.check``).
"""

from __future__ import annotations

import math
import threading

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv import Admit, KVCacheManager
from akv.core.shard_state import ShardState
from akv.core.step import StepRequest
from akv.errors import InvalidInput, ManagerClosed, PoolExhausted, RequestTooLarge, UnknownSequence
from tests.placement import on_shard

BS = 4


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


async def counts(kv: KVCacheManager) -> tuple[int, int, int, int, int]:
    s = await kv.stats()
    return s.free, s.active, s.cached, s.reserved_blocks, s.num_sequences


async def fill(kv: KVCacheManager, tag: str) -> int:
    """Admit one-block sequences until one is refused; return how many got in."""
    n = 0
    while True:
        try:
            await kv.add_sequence(f"{tag}{n}", prompt(BS, 100 + 10 * n))
        except PoolExhausted:
            return n
        n += 1


def gate_copies(kv: KVCacheManager) -> threading.Event:
    """Hold the stream worker's block copies (the real ones, run once released) until the returned event is set."""
    gate = threading.Event()
    copy = kv.storage._copy_unchecked

    def held(src, dst) -> None:
        gate.wait(60)
        copy(src, dst)

    kv.storage._copy_unchecked = held
    return gate


async def pin_below_cached(kv: KVCacheManager) -> None:
    """Leave 2 cached blocks that cannot be evicted yet: above a published block a pending copy pins.

    ``a`` (9 tokens, 2 full blocks published) forks ``c``; c's first token
    copies the shared tail (the copy is held by :func:`gate_copies`); ``a``
    fills that tail in place and publishes it; both are freed. The tail waits
    in flight for its copy (so does c's copy) and its 2 cached ancestors are
    not leaves. Takes 4 blocks of a's shard: 2 cached, 2 in flight.
    """
    await kv.add_sequence("a", prompt(9))
    await kv.commit("a", 9)
    await kv.fork("a", ["c"])
    await kv.append("c", 7)
    await kv.append("a", [7, 7, 7])
    await kv.commit("a", 3)
    await kv.free("a")
    await kv.free("c")


# ------------------------------------------------------------ reservations
@pytest.mark.anyio
async def test_reservation_keeps_decode_from_running_out(tiny_config) -> None:
    """Without a reservation other admissions take the blocks and decode runs out; with one it cannot."""
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("plain", prompt(3))
        assert await fill(kv, "x") == 7  # every other block is gone
        await kv.append("plain", 7)  # fills its block
        with pytest.raises(PoolExhausted):
            await kv.append("plain", 8)
        await kv.check()

    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("r", prompt(3), max_new_tokens=13)  # 16 tokens: 1 block now, 3 earmarked
        assert await counts(kv) == (7, 1, 0, 3, 1)
        assert await fill(kv, "x") == 4  # 8 - 1 - 3
        for t in range(13):
            await kv.append("r", t)
        assert await counts(kv) == (0, 8, 0, 0, 5)
        info = await kv.sequence("r")
        assert info.token_ids == (1, 2, 3, *range(13))
        with pytest.raises(PoolExhausted):  # past its reservation it is an ordinary sequence
            await kv.append("r", 99)
        await kv.check()


@pytest.mark.anyio
async def test_admission_refused_when_the_reservation_does_not_fit(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("big", prompt(24))  # 6 blocks
        before = await counts(kv)
        with pytest.raises(PoolExhausted) as info:
            await kv.add_sequence("r", prompt(3), max_new_tokens=6)  # 9 tokens: 3 blocks, 2 free
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (3, 2, 0)
        assert await counts(kv) == before
        result = await kv.step(admits=[Admit(seq_id="r", prompt=prompt(3), max_new_tokens=6)])
        assert isinstance(result.rejected["r"], PoolExhausted) and not result.seq_ids
        assert await counts(kv) == before
        with pytest.raises(RequestTooLarge):
            await kv.add_sequence("r", prompt(3), max_new_tokens=10**12)
        assert await counts(kv) == before
        await kv.add_sequence("r", prompt(3), max_new_tokens=5)  # 8 tokens: 2 blocks
        assert await counts(kv) == (1, 7, 0, 1, 2)
        await kv.check()


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", [3], float("nan")])
async def test_max_new_tokens_is_validated(tiny_config, bad) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        before = await counts(kv)
        with pytest.raises(InvalidInput, match="max_new_tokens"):
            await kv.add_sequence("r", prompt(3), max_new_tokens=bad)
        with pytest.raises(InvalidInput, match="max_new_tokens"):
            await kv.step(admits=[Admit(seq_id="r", prompt=prompt(3), max_new_tokens=bad)])
        assert await counts(kv) == before
        await kv.add_sequence("r", prompt(3), max_new_tokens=np.int64(5))  # numpy ints are ints
        assert (await kv.stats()).reserved_blocks == 1
        await kv.check()


@pytest.mark.anyio
async def test_free_and_preempt_release_the_reservation(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("a", prompt(3), max_new_tokens=13)
        await kv.add_sequence("b", prompt(3, 50), max_new_tokens=9)
        assert await counts(kv) == (6, 2, 0, 5, 2)
        await kv.free("a")
        assert await counts(kv) == (7, 1, 0, 2, 1)
        await kv.free("b", preempted=True)
        assert await counts(kv) == (8, 0, 0, 0, 0)
        assert await fill(kv, "x") == 8
        await kv.check()


@pytest.mark.anyio
async def test_decode_batches_take_from_their_own_reservation(tiny_config) -> None:
    """The vectorized decode path: reserved rows are never rejected, an ordinary row is once free runs out."""
    async with KVCacheManager(tiny_config(num_blocks=10)) as kv:
        await kv.add_sequence("r1", prompt(4), max_new_tokens=8)  # 1 block + 2 earmarked
        await kv.add_sequence("r2", prompt(4, 20), max_new_tokens=8)  # 1 block + 2 earmarked
        await kv.add_sequence("o", prompt(4, 40))  # 1 block, ordinary
        await kv.add_sequence("y", prompt(8, 60))  # 2 blocks, ordinary
        assert await counts(kv) == (5, 5, 0, 4, 4)  # one free block is nobody's
        rejected_o = []
        for t in range(8):
            result = await kv.step(appends={"r1": t, "r2": t, "o": t})
            assert "r1" not in result.rejected and "r2" not in result.rejected
            if "o" in result.rejected:
                rejected_o.append(t)
            await kv.check()
        assert rejected_o == [4, 5, 6, 7]  # o took the unreserved block at its 5th token
        assert await counts(kv) == (0, 10, 0, 0, 4)
        result = await kv.step(appends={"r1": 1, "r2": 1})
        assert set(result.rejected) == {"r1", "r2"}  # past their reservations: ordinary
        await kv.check()


@pytest.mark.anyio
async def test_fork_earmarks_the_parents_copy_on_write_block(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("p", prompt(3), max_new_tokens=5)  # 8 tokens: 1 block + 1 earmarked
        await kv.fork("p", ["c1", "c2"])  # the shared partial tail: one more block for p's copy
        assert await counts(kv) == (7, 1, 0, 2, 3)
        p, c1 = await kv.sequence("p"), await kv.sequence("c1")
        assert (p.max_tokens, p.reserved_blocks, c1.max_tokens, c1.reserved_blocks) == (8, 2, None, 0)
        assert await fill(kv, "x") == 5
        for t in range(5):  # p copies its tail first, then its own next block: both earmarked
            await kv.append("p", t)
        assert (await kv.sequence("p")).token_ids == (1, 2, 3, *range(5))
        with pytest.raises(PoolExhausted):  # the children are ordinary: nothing is left for their copies
            await kv.append("c1", 9)
        assert (await kv.sequence("c1")).token_ids == (1, 2, 3)
        await kv.check()


@pytest.mark.anyio
async def test_fork_earmark_released_when_the_tail_is_no_longer_shared(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("p", prompt(3), max_new_tokens=5)
        await kv.fork("p", ["c"])
        assert (await kv.stats()).reserved_blocks == 2
        await kv.free("c")
        assert (await kv.stats()).reserved_blocks == 2  # kept until p writes its tail
        await kv.append("p", 4)  # written in place: no copy needed, the earmark goes back
        assert await counts(kv) == (7, 1, 0, 1, 1)
        await kv.check()


@pytest.mark.anyio
async def test_fork_refused_when_its_earmark_does_not_fit(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        await kv.add_sequence("p", prompt(3), max_new_tokens=5)  # 1 block + 1 earmarked
        await kv.add_sequence("q", prompt(8, 50))  # the other 2 blocks
        before = await counts(kv)
        with pytest.raises(PoolExhausted) as info:
            await kv.fork("p", ["c"])
        assert (info.value.requested_blocks, info.value.free_blocks) == (1, 0)
        assert await counts(kv) == before
        with pytest.raises(UnknownSequence):
            await kv.sequence("c")
        await kv.free("q")
        await kv.fork("p", ["c"])
        assert await counts(kv) == (3, 1, 0, 2, 2)
        await kv.check()


@pytest.mark.anyio
async def test_multi_shard_step_refused_whole_when_a_fork_earmark_cannot_be_evicted_for(tiny_config) -> None:
    """Regression: one shard applied its part (a free) before the other shard's fork found that its
    cached blocks could not be evicted (above a block a pending copy pins) and raised: a half-applied
    step. The fork's room is now checked exactly when every part is validated."""
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        gate = gate_copies(kv)
        try:
            # Placed by their first blocks: the z's on shard 1, a (pin_below_cached) on shard 0.
            await kv.add_sequence("z0", on_shard(1, 4, 2, start=200))
            await pin_below_cached(kv)  # shard 0: 2 cached blocks, not evictable now
            await kv.add_sequence("z1", on_shard(1, 12, 2, start=300))
            await kv.add_sequence("z2", on_shard(1, 4, 2, start=400))
            # Shorter than a block: to the freer shard 0, its last 3 free blocks earmarked.
            await kv.add_sequence("p", prompt(3, 500), max_new_tokens=13)
            assert [(await kv.sequence(s)).shard for s in ("z0", "z1", "z2", "p")] == [1, 1, 1, 0]
            before = await counts(kv)
            assert before == (6, 6, 2, 3, 4)
            with pytest.raises(PoolExhausted) as info:  # p's shared tail needs a copy block: none to be had
                await kv.step(frees=["z2"], forks=[("p", ["q"])])
            err = info.value
            assert (err.requested_blocks, err.free_blocks, err.evictable_blocks) == (1, 0, 0)
            assert await counts(kv) == before
            assert (await kv.sequence("z2")).num_tokens == 4  # shard 1's part was not applied
            with pytest.raises(UnknownSequence):
                await kv.sequence("q")
        finally:
            gate.set()
        await kv.wait_copies()  # the tail's pin is released: its ancestors can be evicted
        await kv.step(frees=["z2"], forks=[("p", ["q"])])
        assert (await kv.sequence("q")).shard == 0
        await kv.check()


@pytest.mark.anyio
async def test_reservations_across_shards(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, num_shards=2)) as kv:
        await kv.add_sequence("a", prompt(3), max_new_tokens=13)  # a whole shard: 1 block + 3 earmarked
        await kv.add_sequence("b", prompt(3, 50), max_new_tokens=13)
        assert (await kv.stats()).reserved_blocks == 6
        assert await fill(kv, "x") == 0
        for t in range(13):
            await kv.step(appends={"a": t, "b": t})
        assert await counts(kv) == (0, 8, 0, 0, 2)
        await kv.check()


# ------------------------------------------------------- property (core)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 9), st.one_of(st.none(), st.integers(0, 12))),
        st.tuples(st.just("decode"), st.integers(1, 3), st.just(None)),
        st.tuples(st.just("extend"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("fork"), st.integers(0, 7), st.just(None)),
        st.tuples(st.just("free"), st.integers(0, 7), st.just(None)),
    ),
    max_size=40,
)


def run_step(state: ShardState, req: StepRequest):
    """One step, its copies "run" at once (their pins released), as the actor does once a copy is done."""
    out = state.step(req)
    if out.copies:
        state.release_copy_pins([b for pair in out.copies for b in pair])
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_reserved_sequences_never_refused_within_their_reservation(ops) -> None:
    state = ShardState(0, range(12), BS)
    limit: dict[str, int | None] = {}  # live id -> max tokens (None: ordinary)
    next_id = 0
    for kind, a, b in ops:
        live = sorted(limit)
        if kind == "admit":
            sid, next_id = f"s{next_id}", next_id + 1
            adm = Admit(seq_id=sid, prompt=np.arange(1, a + 1, dtype=np.int32) + next_id, max_new_tokens=b)
            out = run_step(state, StepRequest(admits=[adm]))
            if sid not in out.rejected:
                limit[sid] = None if b is None else a + b
        elif kind == "decode" and live:
            batch = live[: a * 3]
            out = run_step(state, StepRequest(appends={s: 5 for s in batch}))
            for sid in out.rejected:
                cap = limit[sid]
                assert cap is None or state.sequences[sid].num_tokens >= cap, f"{sid} refused within its reservation"
            run_step(state, StepRequest(commits={s: 1 for s in batch if s not in out.rejected}))
        elif kind == "extend" and live:  # several tokens: the per-sequence path
            sid = live[a % len(live)]
            out = run_step(state, StepRequest(appends={sid: np.full(b, 3, dtype=np.int32)}))
            cap = limit[sid]
            if sid in out.rejected:
                assert cap is None or state.sequences[sid].num_tokens + b > cap, f"{sid} refused within its reservation"
        elif kind == "fork" and live:
            parent = live[a % len(live)]
            child, next_id = f"s{next_id}", next_id + 1
            try:
                run_step(state, StepRequest(forks=[(parent, (child,))]))
                limit[child] = None
            except PoolExhausted:
                assert child not in state.sequences
        elif kind == "free" and live:
            sid = live[a % len(live)]
            run_step(state, StepRequest(frees=(sid,)))
            del limit[sid]
        state.check()


@pytest.mark.anyio
async def test_eviction_loop_counts_reserved_blocks_as_taken(tiny_config) -> None:
    """Earmarked blocks are free but not available: the loop evicts cached blocks to keep unreserved ones."""
    config = tiny_config(num_blocks=20, low_watermark=0.2, high_watermark=0.3)  # low 4 blocks, high 6
    async with KVCacheManager(config) as kv:
        for i in range(4):  # 4 sequences of 3 full blocks, committed (published) and freed: 12 cached
            await kv.add_sequence(f"c{i}", prompt(12, 100 + 20 * i))
            await kv.commit(f"c{i}", 12)
            await kv.free(f"c{i}")
        assert await counts(kv) == (8, 0, 12, 0, 0)
        await kv.add_sequence("r", prompt(1), max_new_tokens=27)  # 1 block + 6 earmarked: 1 unreserved free
        await anyio.wait_all_tasks_blocked()  # the loop woke (unreserved free < low) and finished its batches
        free, active, cached, reserved, _ = await counts(kv)
        assert (active, reserved) == (1, 6)
        assert free - reserved == 6 and cached == 7  # evicted up to the high watermark, not counting the earmark
        await kv.check()


# ------------------------------------------------------------ wait_for_room
@pytest.mark.anyio
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_wait_for_room_wakes_on_a_free(tiny_config, num_shards) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, num_shards=num_shards)) as kv:
        await kv.add_sequence("a", prompt(4))
        filled = await fill(kv, "x")
        assert filled == 7
        shard = (await kv.sequence("a")).shard
        other = [f"x{i}" for i in range(filled) if (await kv.sequence(f"x{i}")).shard == shard]
        done = anyio.Event()

        async def waiter() -> None:
            await kv.wait_for_room("a", 1, timeout_s=math.inf)
            done.set()

        with anyio.fail_after(60):  # hang guard only
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert not done.is_set()
                await kv.free(other[0])  # a block of a's own shard
                await done.wait()
        await kv.append("a", 5)
        await kv.check()


@pytest.mark.anyio
async def test_wait_for_room_returns_at_once_when_there_is_room(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        await kv.add_sequence("a", prompt(3))
        await kv.add_sequence("b", prompt(12, 50))
        await kv.wait_for_room("a", 1, timeout_s=0)  # the tail block has a free slot
        await kv.free("b")
        await kv.wait_for_room("a", 13, timeout_s=0)  # 3 + 13 tokens: 4 blocks
        with pytest.raises(RequestTooLarge):
            await kv.wait_for_room("a", 14, timeout_s=0)


@pytest.mark.anyio
async def test_wait_for_room_times_out_with_the_numbers(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        await kv.add_sequence("a", prompt(4))
        await kv.add_sequence("b", prompt(12, 50))
        before = await counts(kv)
        with pytest.raises(PoolExhausted) as info:
            await kv.wait_for_room("a", 1, timeout_s=0.01)
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (1, 0, 0)
        with pytest.raises(PoolExhausted):
            await kv.wait_for_room("a", 1, timeout_s=0)
        assert await counts(kv) == before
        await kv.check()


@pytest.mark.anyio
async def test_wait_for_room_counts_others_reservations_and_the_copy_of_a_shared_tail(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        await kv.add_sequence("r", prompt(4), max_new_tokens=8)  # 1 block + 2 earmarked
        await kv.add_sequence("a", prompt(3, 50))  # the last block, tail partial
        await kv.wait_for_room("r", 8, timeout_s=0)  # its own earmark
        await kv.wait_for_room("a", 1, timeout_s=0)  # room in its tail
        with pytest.raises(PoolExhausted) as info:  # the free blocks are r's
            await kv.wait_for_room("a", 2, timeout_s=0)
        assert (info.value.requested_blocks, info.value.free_blocks) == (1, 0)
        await kv.free("r")
        await kv.fork("a", ["a2"])
        await kv.add_sequence("z", prompt(12, 80))  # fill the pool
        with pytest.raises(PoolExhausted) as info:  # one token, but the shared tail must be copied
            await kv.wait_for_room("a", 1, timeout_s=0)
        assert info.value.requested_blocks == 1
        await kv.check()


@pytest.mark.anyio
async def test_wait_for_room_wakes_when_a_copy_finishes(tiny_config) -> None:
    """Regression: a copy finishing (its pins released) changed the room while no message reached
    the shard, and nothing woke the waiter. The copy's completion now wakes it."""
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        gate = gate_copies(kv)
        done = anyio.Event()

        async def waiter() -> None:
            await kv.wait_for_room("p", 3, timeout_s=math.inf)  # 6 + 3 tokens: 1 more block
            done.set()

        try:
            await kv.add_sequence("p", prompt(6))
            await kv.fork("p", ["c"])
            await kv.append("c", 9)  # c's copy of the shared tail (held)
            await kv.free("c")  # its copy block waits in flight for the copy
            await kv.add_sequence("z", prompt(4, 50))  # the last free block
            assert (await kv.stats()).in_flight == 1
            with anyio.fail_after(60):  # hang guard only
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    assert not done.is_set()
                    gate.set()  # the copy runs; no message is sent to the shard
                    await done.wait()
        finally:
            gate.set()
        await kv.append("p", [1, 2, 3])
        await kv.check()


@pytest.mark.anyio
async def test_wait_for_room_does_not_count_cached_blocks_a_pending_copy_keeps(tiny_config) -> None:
    """Regression: cached blocks above a block pinned by a pending copy counted as evictable, so
    wait_for_room returned and the append was refused. They count once the copy has run."""
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        gate = gate_copies(kv)
        done = anyio.Event()

        async def waiter() -> None:
            await kv.wait_for_room("z", 1, timeout_s=math.inf)
            done.set()

        try:
            await pin_below_cached(kv)
            await kv.add_sequence("z", prompt(16, 300))  # the 4 free blocks, all full
            assert await counts(kv) == (0, 4, 2, 0, 1)
            with pytest.raises(PoolExhausted) as info:
                await kv.wait_for_room("z", 1, timeout_s=0)
            assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (1, 0, 0)
            with pytest.raises(PoolExhausted) as info:
                await kv.append("z", 1)
            assert info.value.evictable_blocks == 0
            with anyio.fail_after(60):  # hang guard only
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    assert not done.is_set()
                    gate.set()
                    await done.wait()
        finally:
            gate.set()
        await kv.append("z", 1)  # evicts a cached block
        await kv.check()


@pytest.mark.anyio
async def test_reserved_blocks_gauge(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=8, num_shards=2)) as kv:
        await kv.add_sequence("a", prompt(3), max_new_tokens=5)
        await kv.add_sequence("b", prompt(3, 50), max_new_tokens=9)
        assert (await kv.stats()).reserved_blocks == 3
        assert kv.metrics_registry.get_sample_value("akv_blocks_reserved") == 3
        await kv.free("b")
        assert kv.metrics_registry.get_sample_value("akv_blocks_reserved") == 1


@pytest.mark.anyio
async def test_wait_for_room_is_cancellation_safe(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        await kv.add_sequence("a", prompt(4))
        await kv.add_sequence("b", prompt(12, 50))
        before = await counts(kv)
        with anyio.fail_after(60):  # hang guard only
            async with anyio.create_task_group() as tg:
                tg.start_soon(kv.wait_for_room, "a", 1, math.inf)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
        assert await counts(kv) == before
        await kv.check()
        await kv.free("b")
        await kv.append("a", 5)
        await kv.check()


@pytest.mark.anyio
async def test_wait_for_room_ends_when_the_sequence_is_freed(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=4)) as kv:
        await kv.add_sequence("a", prompt(4))
        await kv.add_sequence("b", prompt(12, 50))
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                await kv.wait_for_room("a", 1, timeout_s=math.inf)
            except Exception as exc:
                errors.append(exc)

        with anyio.fail_after(60):  # hang guard only
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                await kv.free("a")
        assert [type(e) for e in errors] == [UnknownSequence]


@pytest.mark.anyio
async def test_wait_for_room_ends_when_the_manager_closes(tiny_config) -> None:
    errors: list[BaseException] = []
    with anyio.fail_after(60):  # hang guard only
        async with anyio.create_task_group() as tg, KVCacheManager(tiny_config(num_blocks=4)) as kv:
            await kv.add_sequence("a", prompt(4))
            await kv.add_sequence("b", prompt(12, 50))

            async def waiter() -> None:
                try:
                    await kv.wait_for_room("a", 1, timeout_s=math.inf)
                except Exception as exc:
                    errors.append(exc)

            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
    assert [type(e) for e in errors] == [ManagerClosed]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("num_tokens", "timeout_s"), [(0, 1.0), (-1, 1.0), (1.5, 1.0), (True, 1.0), (1, -1.0), (1, float("nan")), (1, "1")]
)
async def test_wait_for_room_validates_its_arguments(tiny_config, num_tokens, timeout_s) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("a", prompt(4))
        with pytest.raises(InvalidInput):
            await kv.wait_for_room("a", num_tokens, timeout_s)
        with pytest.raises(UnknownSequence):
            await kv.wait_for_room("nobody", 1, 1.0)
        await kv.check()


@pytest.mark.anyio
async def test_wait_for_room_takes_numpy_float_timeouts(tiny_config) -> None:
    """``timeout_s`` as a numpy float is a real number like any other (found by a README-only review)."""
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        for timeout in (np.float64(0.5), np.float32(0.5)):
            await kv.wait_for_room("a", 1, timeout)  # room is there: returns at once
        with pytest.raises(InvalidInput, match="timeout_s"):
            await kv.wait_for_room("a", 1, np.float64("nan"))
        await kv.check()
