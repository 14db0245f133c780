"""SLRU's segmented order (FIFOs with lazy invalidation) against the same key through the keyed heap.

The heap (:class:`~akv.core.eviction_policy.KeyedOrder` with :func:`slru_key`) is the
plain model: every operation must leave both pools with exactly the same eviction order,
through stale entries, compaction, tick renumbering and the numpy release path. (One
operation differs by design: an eviction aborted after a skip goes back to the head of its
segment under SLRU, to its old place in the heap; tests/test_eviction_policy.py pins the
SLRU order there, so here such an abort defers instead.)
"""

from __future__ import annotations

from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from akv.core.block_pool import BlockPool
from akv.core.block_refs import _NUMPY_RELEASE_MIN
from akv.core.eviction_policy import EvictionPolicy, KeyedOrder, slru_key
from akv.core.segmented_order import SegmentedOrder

BASE = 10


def pools(n: int) -> tuple[BlockPool, BlockPool]:
    fast = BlockPool(range(BASE, BASE + n), policy="slru")
    slow = BlockPool(range(BASE, BASE + n), policy=EvictionPolicy("slru-heap", lambda h, t: slru_key(h, t)))
    assert type(fast._keyed) is SegmentedOrder and type(slow._keyed) is KeyedOrder
    return fast, slow


def release(pair, k: int) -> list[int]:
    fast, slow = pair
    ids = fast.allocate(min(k, fast.num_free))
    assert slow.allocate(len(ids)) == ids
    for p in pair:
        p.mark_published(ids)
        p.decref(ids[::-1])
    return ids


def hit(pair, ids: list[int]) -> None:
    for p in pair:
        p.incref(ids, hit=True)
        p.decref(ids[::-1])


def same(pair) -> None:
    fast, slow = pair
    assert fast.eviction_order() == slow.eviction_order()
    fast.check()
    slow.check()


ops = st.lists(
    st.tuples(
        st.sampled_from(["release", "hit", "evict", "evict_skip", "finish", "abort", "defer"]),
        st.integers(0, 15),
        st.integers(1, 5),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(ops=ops, tick_max=st.sampled_from([None, 8, 20]))
# A block taken from the evict-last lane and put back by an aborted eviction goes back to that lane
# (it went to the head of its segment, ahead of every other cached block: found by a review).
@example(
    ops=[("release", 0, 1), ("evict", 0, 1), ("defer", 0, 1), ("evict", 0, 1), ("release", 0, 1), ("abort", 0, 1)],
    tick_max=None,
)
def test_segmented_order_matches_the_slru_heap(ops, tick_max) -> None:
    pair = pools(16)
    if tick_max is not None:
        pair[0]._keyed._tick_max = tick_max  # renumber the ticks often
    taken: list[int] = []
    skipped = False
    for kind, x, k in ops:
        note(f"{kind} {x} {k}; order {pair[0].eviction_order()}")
        if kind == "release" and pair[0].num_free:
            release(pair, k)
        elif kind == "hit":
            ids = pair[0].eviction_order()[x : x + k]
            if ids:
                hit(pair, ids)
        elif kind in ("evict", "evict_skip") and not taken:
            skip = set(pair[0].eviction_order()[x : x + 2]) if kind == "evict_skip" else frozenset()
            taken = pair[0].evict_begin(k, skip)
            assert pair[1].evict_begin(k, skip) == taken
            skipped = bool(skip)
        elif kind in ("finish", "abort", "defer") and taken:
            for p in pair:
                if kind == "finish":
                    p.evict_finish(taken)
                else:
                    p.evict_abort(taken, to_mru=kind == "defer" or skipped)
            taken = []
        same(pair)


def test_stale_entries_are_compacted_and_the_order_kept() -> None:
    pair = pools(100)
    ids = release(pair, 100)
    for _ in range(300):  # every hit leaves a stale entry behind
        hit(pair, ids[40:50])
    seg = pair[0]._keyed
    assert sum(len(lane) - h for lane, h in zip(seg._lanes, seg._heads)) <= 2 * len(seg) + 1024 + 1
    assert seg._stale < 3000  # compacted at least once
    same(pair)
    assert pair[0].evict_begin(100) == pair[1].evict_begin(100)


def test_a_long_release_takes_the_numpy_path_in_the_same_order() -> None:
    n = 2 * _NUMPY_RELEASE_MIN
    pair = pools(n)
    first = release(pair, n // 2)
    hit(pair, first[::3])
    both = [p.allocate(n // 2) for p in pair]
    assert both[0] == both[1]
    for p in pair:
        p.mark_published(both[0][::2])  # half published: cached, the rest freed
        p.decref(both[0][::-1])
    same(pair)
    assert pair[0].evict_begin(n) == pair[1].evict_begin(n)


def test_long_evictions_drop_the_taken_front_and_keep_the_order() -> None:
    pair = pools(6000)
    ids = release(pair, 6000)
    hit(pair, ids[3000:3100])  # stale entries in the probationary segment, live ones in the protected
    for k in (700, 1500, 9, 1200):
        assert pair[0].evict_begin(k) == pair[1].evict_begin(k)  # past the 1,024-entry trim point
        same(pair)
    skip = set(pair[0].eviction_order()[:5])
    taken = pair[0].evict_begin(50, skip)
    assert pair[1].evict_begin(50, skip) == taken
    for p in pair:
        p.evict_finish(taken)
    same(pair)
    seg = pair[0]._keyed
    assert seg._heads[0] < 1024 or 2 * seg._heads[0] <= len(seg._lanes[0])
