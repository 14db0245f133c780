"""BlockPool: allocation order, refcounts, per-state counts, LRU order, copy pins, eviction.

Block ids are asserted exactly (CONVENTIONS.md: eviction order, refcounts and
free counts are asserted exactly). The pool under test owns ids 10..17 so an
offset bug (global id vs. index) cannot hide behind ids that start at 0.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from akv.core.block_pool import ACTIVE, CACHED, FREE, IN_FLIGHT, BlockPool

BASE = 10
N = 8


def counts(free: int = 0, active: int = 0, cached: int = 0, in_flight: int = 0) -> dict[str, int]:
    return {"free": free, "active": active, "cached": cached, "in_flight": in_flight}


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(range(BASE, BASE + N))


def cached_chains(pool: BlockPool) -> tuple[list[int], list[int]]:
    """Two published chains released deepest first: a = 10,11,12 then b = 13,14 (15,16,17 free)."""
    a = pool.allocate(3)
    b = pool.allocate(2)
    pool.mark_published(a + b)
    pool.decref(list(reversed(a)))
    pool.decref(list(reversed(b)))
    assert pool.lru_order() == [12, 11, 10, 14, 13]
    assert pool.counts() == counts(free=3, cached=5)
    pool.check()
    return a, b


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize("ids", [range(0), range(0, 8, 2)])
def test_rejects_empty_or_strided_range(ids: range) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        BlockPool(ids)


def test_fresh_pool_is_all_free(pool: BlockPool) -> None:
    assert pool.num_blocks == N
    assert pool.counts() == counts(free=N)
    assert (pool.num_free, pool.num_active, pool.num_cached, pool.num_in_flight) == (N, 0, 0, 0)
    assert pool.lru_order() == []
    assert pool.total_refs == 0
    assert [pool.owns(b) for b in (9, 10, 17, 18)] == [False, True, True, False]
    assert all(pool.state(b) == FREE and pool.refcount(b) == 0 for b in range(BASE, BASE + N))
    pool.check()


# ---------------------------------------------------------------------- allocate
def test_allocate_hands_out_lowest_ids_first(pool: BlockPool) -> None:
    assert pool.allocate(3) == [10, 11, 12]
    assert pool.counts() == counts(free=5, active=3)
    assert pool.allocate(2) == [13, 14]
    assert pool.counts() == counts(free=3, active=5)
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [15, 16, 17]
    assert pool.counts() == counts(active=8)
    assert pool.total_refs == 8
    assert all(pool.state(b) == ACTIVE and pool.refcount(b) == 1 for b in range(BASE, BASE + N))
    pool.check()


def test_allocate_more_than_free_raises_and_changes_nothing(pool: BlockPool) -> None:
    pool.allocate(6)
    with pytest.raises(ValueError, match=r"allocate\(3\) with only 2 free blocks"):
        pool.allocate(3)
    assert pool.counts() == counts(free=2, active=6)
    assert pool.allocate(2) == [16, 17]
    pool.check()


def test_freed_blocks_are_reused_most_recent_first(pool: BlockPool) -> None:
    ids = pool.allocate(4)  # 10..13
    pool.decref([11])
    pool.decref([13])
    assert pool.counts() == counts(free=6, active=2)
    assert pool.state(11) == FREE and pool.state(13) == FREE
    # A stack: 13 (freed last) first, then 11, then the untouched tail 14, 15...
    assert pool.allocate(3) == [13, 11, 14]
    assert ids == [10, 11, 12, 13]
    pool.check()


# --------------------------------------------------------------------- refcounts
def test_incref_decref_count_exactly(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    assert pool.refcount(b) == 3
    assert pool.total_refs == 3
    assert pool.counts() == counts(free=7, active=1)
    pool.decref([b])
    pool.decref([b])
    assert pool.refcount(b) == 1
    assert pool.state(b) == ACTIVE
    pool.decref([b])
    assert pool.refcount(b) == 0
    assert pool.state(b) == FREE
    assert pool.counts() == counts(free=8)
    assert pool.total_refs == 0
    pool.check()


def test_double_decref_raises_and_leaves_pool_consistent(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.decref([b])
    with pytest.raises(ValueError, match=r"decref of block 10 with refcount 0 \(double free\)"):
        pool.decref([b])
    assert pool.counts() == counts(free=8)
    assert pool.total_refs == 0
    pool.check()


def test_batched_decref_of_sequences_sharing_blocks(pool: BlockPool) -> None:
    # Two sequences share the published prefix 10, 11; each owns one more block.
    shared = pool.allocate(2)
    own_a, own_b = pool.allocate(1), pool.allocate(1)
    pool.incref(shared)
    pool.mark_published(shared + own_a + own_b)
    # One call, each sequence deepest first: a shared block is released at its last occurrence.
    pool.decref([own_a[0], *reversed(shared), own_b[0], *reversed(shared)], distinct=False)
    assert pool.lru_order() == [12, 13, 11, 10]
    assert pool.counts() == counts(free=4, cached=4)
    assert pool.total_refs == 0
    pool.check()


@pytest.mark.parametrize("distinct", [None, False])
def test_batched_double_decref_applies_nothing(pool: BlockPool, distinct: bool | None) -> None:
    a = pool.allocate(2)
    with pytest.raises(ValueError, match=r"decref of block 11 with refcount 0 \(double free\)"):
        pool.decref([11, 10, 11], distinct=distinct)
    assert [pool.refcount(b) for b in a] == [1, 1]
    assert pool.counts() == counts(free=6, active=2)
    assert pool.total_refs == 2
    pool.check()


@pytest.mark.parametrize("policy", ["lru", "slru"])
@pytest.mark.parametrize("distinct", [None, True])  # the numpy path, and the loop for distinct lists
def test_rejected_incref_applies_nothing(distinct: bool | None, policy: str) -> None:
    pool = BlockPool(range(10, 18), policy=policy)
    (a,) = pool.allocate(1)
    cached = pool.allocate(1)
    pool.mark_published(cached)
    pool.decref(cached)  # a cached block, which a valid incref would take out of the eviction order
    with pytest.raises(ValueError, match="incref of block 12 in state free"):
        pool.incref([a, *cached, 12], hit=True, distinct=distinct)
    assert pool.refcount(a) == 1 and pool.refcount(cached[0]) == 0
    assert pool.total_refs == 1
    assert pool.eviction_order() == cached and pool.num_hits(cached[0]) == 0
    pool.check()


@pytest.mark.parametrize("policy", ["lru", "slru", "lfu"])
def test_incref_loop_equals_the_numpy_path(policy: str) -> None:
    """A distinct list of blocks (an admission's hits) takes the Python loop; an array the numpy path."""
    pools = [BlockPool(range(10, 30), policy=policy) for _ in range(2)]
    for p in pools:
        ids = p.allocate(12)
        p.mark_published(ids[:8])
        p.decref(ids[:8])  # 8 cached, 4 active
    hits = [13, 10, 20, 11, 17]  # cached and active blocks mixed
    pools[0].incref(hits, hit=True, distinct=True)
    pools[1].incref(np.array(hits), hit=True, distinct=True)
    a, b = pools
    assert [a.refcount(x) for x in range(10, 30)] == [b.refcount(x) for x in range(10, 30)]
    assert [a.state(x) for x in range(10, 30)] == [b.state(x) for x in range(10, 30)]
    assert [a.num_hits(x) for x in range(10, 30)] == [b.num_hits(x) for x in range(10, 30)]
    assert a.eviction_order() == b.eviction_order() and a.counts() == b.counts() and a.total_refs == b.total_refs
    a.check()
    b.check()


IDS = list(range(BASE, BASE + N))


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["lru", "slru", "lfu"]),
    # The general path (told the batch may repeat blocks) or the checked one (None: it looks).
    distinct=st.sampled_from([False, None]),
    published=st.lists(st.sampled_from(IDS), unique=True),
    seqs=st.lists(st.lists(st.sampled_from(IDS), min_size=1, unique=True), min_size=1, max_size=5),
)
# Two sequences sharing a published prefix, freed in one call: a batch that
# drops one reference per distinct block (not per occurrence) loses a decref.
@example(policy="lru", distinct=None, published=[10, 11], seqs=[[10, 11, 12], [10, 11]])
@example(policy="lfu", distinct=False, published=[10, 11, 12], seqs=[[10, 11], [10, 11, 12], [10]])
def test_batched_decref_equals_one_call_per_sequence(
    policy: str, distinct: bool | None, published: list[int], seqs: list[list[int]]
) -> None:
    """One decref over several sequences' blocks leaves exactly the state of one call per sequence."""
    pools = [BlockPool(range(BASE, BASE + N), policy=policy) for _ in range(2)]
    ids = pools[0].allocate(N)
    pools[1].allocate(N)
    assert ids == IDS
    for p in pools:
        p.mark_published(published)
        for seq in seqs:  # each sequence holds one reference to each of its blocks
            p.incref(seq)
        p.decref(ids)  # drop the allocation's references
    pools[0].decref([b for seq in seqs for b in reversed(seq)], distinct=distinct)
    for seq in seqs:
        pools[1].decref(list(reversed(seq)))
    a, b = pools
    assert [a.refcount(x) for x in ids] == [b.refcount(x) for x in ids]
    assert [a.state(x) for x in ids] == [b.state(x) for x in ids]
    assert a.eviction_order() == b.eviction_order()
    assert a.allocate(a.num_free) == b.allocate(b.num_free)
    a.check()
    b.check()


def test_incref_of_free_block_raises(pool: BlockPool) -> None:
    with pytest.raises(ValueError, match="incref of block 12 in state free"):
        pool.incref([12])
    assert pool.counts() == counts(free=8)
    pool.check()


# ----------------------------------------------------------------------- the LRU
def test_release_order_is_lru_order_deepest_first(pool: BlockPool) -> None:
    a, b = cached_chains(pool)
    assert (a, b) == ([10, 11, 12], [13, 14])
    assert all(pool.state(x) == CACHED and pool.is_published(x) for x in a + b)
    # Eviction takes the least recently released first: chain a's deepest block.
    assert pool.evict_begin(1) == [12]
    assert pool.evict_begin(3) == [11, 10, 14]
    assert pool.lru_order() == [13]
    assert pool.counts() == counts(free=3, cached=1, in_flight=4)
    pool.check()


def test_unpublished_release_goes_to_free_not_lru(pool: BlockPool) -> None:
    ids = pool.allocate(2)
    pool.mark_published(ids[:1])
    pool.decref(list(reversed(ids)))
    assert pool.lru_order() == [10]
    assert pool.state(11) == FREE
    assert pool.counts() == counts(free=7, cached=1)
    pool.check()


@pytest.mark.parametrize(
    ("hit", "after_hit", "after_release"),
    [
        (11, [12, 10, 14, 13], [12, 10, 14, 13, 11]),  # middle of the list
        (12, [11, 10, 14, 13], [11, 10, 14, 13, 12]),  # head
        (13, [12, 11, 10, 14], [12, 11, 10, 14, 13]),  # tail
    ],
)
def test_incref_of_cached_block_unlinks_it_from_lru(
    pool: BlockPool, hit: int, after_hit: list[int], after_release: list[int]
) -> None:
    cached_chains(pool)
    pool.incref([hit])
    assert pool.state(hit) == ACTIVE
    assert pool.refcount(hit) == 1
    assert pool.lru_order() == after_hit
    assert pool.counts() == counts(free=3, active=1, cached=4)
    pool.check()
    pool.decref([hit])
    assert pool.state(hit) == CACHED
    assert pool.lru_order() == after_release
    assert pool.counts() == counts(free=3, cached=5)
    pool.check()


def lru_hits_and_evictions(n: int, line_events) -> tuple[int, BlockPool, list[int], list[int]]:
    """``n`` cached blocks; 1,000 hits in the middle, then 2,000 evictions: (work, pool, hit ids, evicted ids)."""
    big = BlockPool(range(n))
    ids = big.allocate(n)
    big.mark_published(ids)
    big.decref(ids)
    middle = ids[n // 2 - 500 : n // 2 + 500]
    taken: list[int] = []

    def run() -> None:
        big.incref(middle)
        big.decref(middle)
        taken.extend(big.evict_begin(2_000))

    work = line_events(run)
    assert taken == ids[:2_000]  # never hit, oldest first
    return work, big, middle, taken


def test_incref_of_cached_block_is_constant_time(line_events) -> None:
    # Taking a cached block out of the LRU order on a hit is O(1), so the same
    # 1,000 hits and 2,000 evictions cost the same interpreted work whether
    # 6,000 or 60,000 blocks are cached. A Python-level scan of the order per
    # hit would add ~n/2 line events per hit (~3e6 vs ~3e7).
    small, _, _, _ = lru_hits_and_evictions(6_000, line_events)
    work, big, middle, taken = lru_hits_and_evictions(60_000, line_events)
    assert work == small
    order = big.lru_order()
    assert order[-1_000:] == middle
    assert len(order) == 60_000 - 2_000
    big.evict_finish(taken)
    big.check()


# ---------------------------------------------------------------- copy pins
def test_copy_pin_keeps_unreferenced_block_in_flight_then_frees_it(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.pin_for_copy([b])
    pool.decref([b])
    assert pool.state(b) == IN_FLIGHT
    assert pool.counts() == counts(free=7, in_flight=1)
    # Neither allocatable, nor referencable, nor evictable while the copy is pending.
    assert b not in pool.allocate(7)
    with pytest.raises(ValueError, match="in state in_flight"):
        pool.incref([b])
    assert pool.evict_begin(8) == []
    pool.check()
    pool.unpin_copied([b])
    assert pool.state(b) == FREE
    assert pool.counts() == counts(free=1, active=7)
    assert pool.allocate(1) == [b]
    pool.check()


def test_copy_pin_of_published_block_then_unpin_caches_it(pool: BlockPool) -> None:
    cached_chains(pool)
    (b,) = pool.allocate(1)  # 15
    pool.mark_published([b])
    pool.pin_for_copy([b])
    pool.decref([b])
    assert pool.state(b) == IN_FLIGHT
    assert pool.lru_order() == [12, 11, 10, 14, 13]
    assert pool.counts() == counts(free=2, cached=5, in_flight=1)
    pool.unpin_copied([b])
    assert pool.state(b) == CACHED
    assert pool.lru_order() == [12, 11, 10, 14, 13, 15]
    assert pool.counts() == counts(free=2, cached=6)
    pool.check()


def test_copy_pins_are_counted(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.pin_for_copy([b])
    pool.pin_for_copy([b])
    pool.decref([b])
    pool.unpin_copied([b])
    assert pool.state(b) == IN_FLIGHT  # one pin left
    pool.unpin_copied([b])
    assert pool.state(b) == FREE
    assert pool.counts() == counts(free=8)
    pool.check()


@pytest.mark.parametrize("repeat", [1, 3])
def test_many_pins_release_in_the_order_given(repeat: int) -> None:
    """Pins of 40 blocks (numpy's path), some listed twice: each released at its last occurrence, in order."""
    pool = BlockPool(range(100, 140))
    ids = pool.allocate(40)
    pool.mark_published(ids[::2])
    pinned = ids + ids[:repeat]  # the first blocks pinned twice (once for repeat=1: all distinct but 1)
    pool.pin_for_copy(pinned)
    assert pool.total_pins == 40 + repeat and pool.pinned_published() == []
    pool.decref(ids[::-1], distinct=True)
    assert pool.counts() == {"free": 0, "active": 0, "cached": 0, "in_flight": 40}
    assert pool.pinned_published() == ids[::2]
    with pytest.raises(ValueError, match="pinned fewer times"):
        pool.unpin_copied(ids[:1] * (repeat + 2))  # one more than pinned: nothing applied
    assert pool.total_pins == 40 + repeat
    order = ids[5:] + ids[:5][::-1] + ids[:repeat]
    entered = pool.unpin_copied(order)
    released = ids[5:] + ids[repeat:5][::-1] + ids[:repeat]  # the twice-pinned ones at their last occurrence
    assert entered == [b for b in released if (b - 100) % 2 == 0]
    assert pool.eviction_order() == entered and pool.total_pins == 0
    assert pool.counts() == {"free": 20, "active": 0, "cached": 20, "in_flight": 0}
    pool.check()


def test_unpin_of_still_referenced_block_keeps_it_active(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.pin_for_copy([b])
    pool.unpin_copied([b])
    assert pool.state(b) == ACTIVE
    assert pool.refcount(b) == 1
    pool.decref([b])
    assert pool.state(b) == FREE  # no stale pin left behind
    assert pool.counts() == counts(free=8)
    pool.check()


# ------------------------------------------------------------------- eviction
def test_evict_begin_skips_protected_blocks_in_place(pool: BlockPool) -> None:
    cached_chains(pool)
    taken = pool.evict_begin(2, skip={12, 10})
    assert taken == [11, 14]
    assert pool.lru_order() == [12, 10, 13]
    assert pool.counts() == counts(free=3, cached=3, in_flight=2)
    assert all(pool.state(x) == IN_FLIGHT for x in taken)
    pool.check()


def test_evict_finish_frees_and_unpublishes(pool: BlockPool) -> None:
    cached_chains(pool)
    taken = pool.evict_begin(2)
    assert taken == [12, 11]
    pool.evict_finish(taken)
    assert pool.counts() == counts(free=5, cached=3)
    assert not pool.is_published(12) and not pool.is_published(11)
    assert pool.state(12) == FREE and pool.state(11) == FREE
    # Evicted blocks go on the free stack: the last finished (11) comes out first.
    assert pool.allocate(3) == [11, 12, 15]
    pool.check()


def test_evict_finish_of_block_not_taken_raises(pool: BlockPool) -> None:
    cached_chains(pool)
    with pytest.raises(ValueError, match="evict_finish of block 12 in state cached"):
        pool.evict_finish([12])
    assert pool.counts() == counts(free=3, cached=5)
    pool.check()


def test_evict_abort_restores_exact_order(pool: BlockPool) -> None:
    cached_chains(pool)
    taken = pool.evict_begin(3)
    assert taken == [12, 11, 10]
    assert pool.lru_order() == [14, 13]
    pool.evict_abort(taken)
    assert pool.lru_order() == [12, 11, 10, 14, 13]
    assert pool.counts() == counts(free=3, cached=5)
    assert all(pool.state(x) == CACHED for x in taken)
    pool.check()


def test_evict_abort_after_skip_puts_taken_blocks_at_head(pool: BlockPool) -> None:
    cached_chains(pool)
    taken = pool.evict_begin(2, skip={12})
    assert taken == [11, 10]
    pool.evict_abort(taken)
    assert pool.lru_order() == [11, 10, 12, 14, 13]
    pool.check()


def test_evict_begin_more_than_cached_takes_all(pool: BlockPool) -> None:
    cached_chains(pool)
    assert pool.evict_begin(100) == [12, 11, 10, 14, 13]
    assert pool.lru_order() == []
    assert pool.counts() == counts(free=3, in_flight=5)
    pool.check()


def test_prefix_hit_on_published_block_pinned_by_a_copy(pool: BlockPool) -> None:
    # A published block whose last reference went while a copy still reads it
    # holds valid content: a prefix hit may take it; the pin only delays release.
    cached_chains(pool)
    (b,) = pool.allocate(1)  # 15
    pool.mark_published([b])
    pool.pin_for_copy([b])
    pool.decref([b])
    assert pool.state(b) == IN_FLIGHT
    pool.incref([b])
    assert pool.state(b) == ACTIVE
    assert pool.refcount(b) == 1
    assert pool.counts() == counts(free=2, active=1, cached=5)
    pool.unpin_copied([b])
    assert pool.state(b) == ACTIVE
    pool.decref([b])
    assert pool.lru_order() == [12, 11, 10, 14, 13, 15]
    assert pool.counts() == counts(free=2, cached=6)
    pool.check()


def test_evict_abort_to_mru_puts_blocks_at_the_tail(pool: BlockPool) -> None:
    cached_chains(pool)
    taken = pool.evict_begin(2)
    assert taken == [12, 11]
    pool.evict_abort(taken, to_mru=True)
    assert pool.lru_order() == [10, 14, 13, 12, 11]
    assert pool.counts() == counts(free=3, cached=5)
    pool.check()


def test_a_long_hit_leaves_the_slru_segments_at_once() -> None:
    """100 cached blocks taken by one incref (numpy's path): active, out of the order; a free one among them refuses all."""
    pool = BlockPool(range(0, 200), policy="slru")
    ids = pool.allocate(150)
    pool.mark_published(ids)
    pool.decref(ids[::-1], distinct=True)
    hit = ids[:100]
    with pytest.raises(ValueError, match="in state free"):
        pool.incref([*hit, 170], distinct=True, hit=True)
    assert pool.counts() == {"free": 50, "active": 0, "cached": 150, "in_flight": 0}
    pool.check()
    pool.incref(hit, distinct=True, hit=True)
    assert pool.counts() == {"free": 50, "active": 100, "cached": 50, "in_flight": 0}
    assert pool.eviction_order() == ids[100:][::-1]
    pool.decref(hit[::-1], distinct=True)
    assert pool.eviction_order() == ids[100:][::-1] + hit[::-1]  # never hit first, then the hit ones
    pool.check()


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_publish_in_flight_pins_allocated_blocks_until_their_copy_ran(policy: str) -> None:
    pool = BlockPool(range(BASE, BASE + N), policy=policy)
    ids = pool.allocate(3)
    off = pool.publish_in_flight(ids, np.array([2, 0, 1]))
    assert off.tolist() == [0, 1, 2]
    assert pool.counts() == counts(free=5, in_flight=3)
    assert [pool.state(b) for b in ids] == [IN_FLIGHT] * 3
    assert all(pool.is_published(b) and pool.is_pinned(b) and pool.refcount(b) == 0 for b in ids)
    assert pool.evict_begin(8) == []  # neither evictable nor free while the copy is pending
    pool.check()
    assert pool.unpin_copied(ids) == ids
    assert pool.counts() == counts(free=5, cached=3)
    if policy == "slru":
        assert [pool.num_hits(b) for b in ids] == [2, 0, 1]
        assert pool.eviction_order() == [ids[1], ids[0], ids[2]]  # blocks with hits in the protected segment
    else:
        assert pool.eviction_order() == ids
    pool.check()


def test_publish_in_flight_refuses_a_block_not_referenced_once_and_changes_nothing(pool: BlockPool) -> None:
    ids = pool.allocate(3)
    pool.incref([ids[1]])
    with pytest.raises(ValueError, match=f"block {ids[1]} with refcount 2"):
        pool.publish_in_flight(ids)
    assert pool.counts() == counts(free=5, active=3)
    assert not any(pool.is_published(b) or pool.is_pinned(b) for b in ids)
    pool.check()
