"""Eviction policies: which cached block a pool shard evicts first.

A policy is a small key function over two statistics of a cached block, as in
SGLang's ``mem_cache/evict_policy.py``: the cached block with the smallest key
is evicted first.

- ``num_hits``: prefix-cache hits on the block since it was allocated (forks
  do not count; the count resets when the block is evicted and reallocated).
- ``last_release``: a shard-wide monotonic counter (a logical clock, no unit
  of time) stamped when the block last entered the cache, i.e. when its
  refcount last dropped to zero. Every release gets a distinct stamp, and a
  sequence releases its blocks deepest first.

Ties on the key are broken by ``last_release`` (older first), so among equal
keys the deepest block of a finished sequence goes first.

A key must be non-decreasing in both statistics. Then a parent in the prefix
tree never has a smaller key than its cached child (every hit on a child is
also a hit on its parent, and a parent is released after its children), so
eviction meets leaves first and the tree rarely refuses a victim.

``"lru"`` is served by :class:`~akv.core.block_pool.BlockPool` with an
``OrderedDict`` (O(1) per operation, the hot path); ``"slru"`` by a
:class:`~akv.core.segmented_order.SegmentedOrder` (a FIFO per segment, O(1) amortized, the same order
as its key); every other policy by a :class:`KeyedOrder`, a binary heap with
lazy invalidation (O(log n)).

S3-FIFO (Yang et al., "FIFO Queues are All You Need for Cache Eviction",
SOSP 2023) is not offered: its small and main FIFOs and ghost list are queue
state that a per-block key cannot express.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

#: ``key(num_hits, last_release) -> tuple``; the smallest key is evicted first.
KeyFunction = Callable[[int, int], tuple]


def lru_key(num_hits: int, last_release: int) -> tuple[int]:
    """Least recently used: the block released longest ago goes first.

    Args:
        num_hits: Unused.
        last_release: Release stamp (logical clock).

    Returns:
        ``(last_release,)``.
    """
    return (last_release,)


def lfu_key(num_hits: int, last_release: int) -> tuple[int, int]:
    """Least frequently used, ties by recency (LRU among equally hit blocks).

    Classic least-frequently-used replacement (its strengths and its lack of
    aging are discussed by O'Neil, O'Neil and Weikum, "The LRU-K Page
    Replacement Algorithm for Database Disk Buffering", SIGMOD 1993). Counts
    start at zero on allocation, so there is no aging beyond a block's
    lifetime in the cache.

    Args:
        num_hits: Prefix hits since allocation.
        last_release: Release stamp (logical clock).

    Returns:
        ``(num_hits, last_release)``.
    """
    return (num_hits, last_release)


def slru_key(num_hits: int, last_release: int) -> tuple[int, int]:
    """Segmented LRU: never-hit (probationary) blocks go before hit (protected) ones.

    After Karedla, Love and Wherry, "Caching Strategies to Improve Disk System
    Performance", IEEE Computer 27(3), 1994: a block enters the probationary
    segment and moves to the protected segment on its first hit; each
    segment is LRU, and the probationary one is evicted first. This is what
    makes it scan resistant: a burst of one-off prompts only churns the
    probationary segment. Unlike the paper, the protected segment has no size
    limit (a per-block key cannot demote), so a block hit once outranks every
    never-hit block for as long as it stays cached.

    Args:
        num_hits: Prefix hits since allocation.
        last_release: Release stamp (logical clock).

    Returns:
        ``(0 if never hit else 1, last_release)``.
    """
    return (1 if num_hits else 0, last_release)


@dataclass(frozen=True, slots=True)
class EvictionPolicy:
    """A named eviction order.

    Args:
        name: Registry name (``KVCacheConfig.eviction_policy``).
        key: ``key(num_hits, last_release) -> tuple``, non-decreasing in both
            arguments; the cached block with the smallest key is evicted first.
    """

    name: str
    key: KeyFunction


#: Policies by name.
EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": EvictionPolicy("lru", lru_key),
    "lfu": EvictionPolicy("lfu", lfu_key),
    "slru": EvictionPolicy("slru", slru_key),
}


#: The default policy of ``KVCacheConfig`` and ``ShardState``: never-hit blocks go before hit ones
#: (docs/benchmarks.md, "Eviction quality").
DEFAULT_EVICTION_POLICY = "slru"


def eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """Resolve a policy name (or pass a policy through).

    Raises:
        ValueError: Unknown name; the message lists the known ones.
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return EVICTION_POLICIES[policy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {policy!r}; known: {', '.join(EVICTION_POLICIES)}") from None


# Heap entries: (lane, key, last_release, block_id). Lane 0 holds ordinary
# cached blocks, lane 1 the blocks the prefix tree refused (evicted last).
# ``last_release`` is unique per entry, so block ids are never compared.
_NORMAL = 0
_DEFERRED = 1


class HitCounts:
    """Prefix hits per block of one pool, shared by the orders that key on them.

    Args:
        first_block_id: Lowest block id of the pool.
        num_blocks: Blocks in the pool.
    """

    __slots__ = ("base", "hits")

    def __init__(self, first_block_id: int, num_blocks: int) -> None:
        self.base = first_block_id
        #: int64 ``(num_blocks,)``: prefix hits per block offset since its allocation.
        self.hits = np.zeros(num_blocks, dtype=np.int64)

    def record_hits(self, offsets: np.ndarray, *, distinct: bool) -> None:
        """Count one prefix hit on each block offset (``block_id - base``, an int array).

        ``distinct``: no offset repeats (one sequence's hits); else repeats count each.
        """
        if distinct:
            self.hits[offsets] += 1
        else:
            np.add.at(self.hits, offsets, 1)

    def reset(self, offsets) -> None:
        """Zero the statistics of freshly allocated blocks (offsets: an int array or list)."""
        self.hits[offsets] = 0


class KeyedOrder(HitCounts):
    """Cached blocks of one pool in the order of a key function (a lazy binary heap).

    It offers the subset of ``OrderedDict`` that :class:`~akv.core.block_pool.BlockPool`
    uses on its LRU order, so the pool's per-block code is the same for
    every policy: ``order[b] = None`` (``b`` entered the cache now),
    ``del order[b]`` (``b`` left it on a hit), ``len`` and iteration in
    eviction order. A block that leaves the cache leaves a stale heap entry
    behind, skipped when popped; the heap is rebuilt when stale entries
    outnumber live ones, so memory stays O(cached blocks).

    Complexity: enter O(log n), leave O(1), :meth:`pop_first` O(log n) per
    block taken or skipped (amortized, stale entries included), iteration
    O(n log n).

    Args:
        policy: The eviction policy.
        first_block_id: Lowest block id of the pool.
        num_blocks: Blocks in the pool.
    """

    __slots__ = ("_entry", "_heap", "_in", "_key", "_size", "_tick", "policy")

    def __init__(self, policy: EvictionPolicy, first_block_id: int, num_blocks: int) -> None:
        self.policy = policy
        self._key = policy.key
        super().__init__(first_block_id, num_blocks)
        self._entry: list[tuple | None] = [None] * num_blocks  # the block's latest heap entry
        self._in = [False] * num_blocks  # whether that entry is live (the block is in the order)
        self._heap: list[tuple] = []
        self._size = 0
        self._tick = 0

    # ------------------------------------------------- OrderedDict subset
    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_id: int) -> bool:
        return self._in[block_id - self.base]

    def __setitem__(self, block_id: int, _value: None) -> None:
        """``block_id`` entered the cache now: stamp it and order it by its key."""
        i = block_id - self.base
        tick = self._tick
        self._tick = tick + 1
        entry = (_NORMAL, self._key(int(self.hits[i]), tick), tick, block_id)
        self._push(i, entry)

    def extend(self, block_ids: list[int]) -> None:
        """Blocks entered the cache now, in this order (``order[b] = None`` for each)."""
        base, key, push, hits = self.base, self._key, self._push, memoryview(self.hits)
        tick = self._tick
        for b in block_ids:
            push(b - base, (_NORMAL, key(hits[b - base], tick), tick, b))
            tick += 1
        self._tick = tick

    def __delitem__(self, block_id: int) -> None:
        """``block_id`` left the cache (a hit took a reference); its heap entry goes stale."""
        i = block_id - self.base
        if not self._in[i]:
            raise KeyError(block_id)
        self._in[i] = False
        self._size -= 1

    def __iter__(self) -> Iterator[int]:
        """Block ids in eviction order (O(n log n))."""
        return (e[3] for e in sorted(self._live_entries()))

    # -------------------------------------------------------- eviction
    def pop_first(self, max_blocks: int, skip) -> list[int]:
        """Take up to ``max_blocks`` blocks with the smallest keys out of the order.

        Blocks in ``skip`` stay in the order with their keys unchanged.
        """
        heap, entries, live = self._heap, self._entry, self._in
        base = self.base
        out: list[int] = []
        kept: list[tuple] = []
        while heap and len(out) < max_blocks:
            entry = heapq.heappop(heap)
            b = entry[3]
            i = b - base
            if not live[i] or entries[i] is not entry:
                continue  # stale
            if skip and b in skip:
                kept.append(entry)
                continue
            live[i] = False
            out.append(b)
        for entry in kept:
            heapq.heappush(heap, entry)
        self._size -= len(out)
        return out

    def restore(self, block_ids: Iterable[int]) -> None:
        """Put blocks taken by :meth:`pop_first` back with their old keys (their old place)."""
        base, entries = self.base, self._entry
        for b in block_ids:
            i = b - base
            self._push(i, entries[i])

    def defer(self, block_ids: Iterable[int]) -> None:
        """Put blocks taken by :meth:`pop_first` at the evict-last end, in the given order.

        They stay behind every ordinary cached block until they leave the
        cache (for blocks the prefix tree cannot evict yet: non-leaves).
        """
        for b in block_ids:
            tick = self._tick
            self._tick = tick + 1
            self._push(b - self.base, (_DEFERRED, (), tick, b))

    def check(self, cached_ids: Iterable[int]) -> None:
        """Validate the heap against the pool's cached blocks.

        Raises:
            AssertionError: The live entries are not exactly ``cached_ids``,
                an entry is out of heap order, or an entry's key is not what
                the policy gives now.
        """
        heap = self._heap
        for k in range(1, len(heap)):
            if heap[(k - 1) // 2] > heap[k]:
                raise AssertionError(f"eviction heap out of order at entry {k} (block {heap[k][3]})")
        live = self._live_entries()
        ids = sorted(e[3] for e in live)
        if len(ids) != self._size or ids != sorted(cached_ids):
            raise AssertionError(
                f"eviction order holds {ids} (size {self._size}), cached blocks are {sorted(cached_ids)}"
            )
        for lane, key, tick, b in live:
            if lane == _NORMAL and key != self._key(int(self.hits[b - self.base]), tick):
                raise AssertionError(
                    f"block {b}: eviction key {key} but the policy gives {self._key(int(self.hits[b - self.base]), tick)}"
                )

    # ------------------------------------------------------- internals
    def _live_entries(self) -> list[tuple]:
        entries, live, base = self._entry, self._in, self.base
        return [e for e in self._heap if live[e[3] - base] and entries[e[3] - base] is e]

    def _push(self, i: int, entry: tuple) -> None:
        if self._in[i]:
            raise ValueError(f"block {entry[3]} is already in the eviction order")
        self._entry[i] = entry
        self._in[i] = True
        self._size += 1
        heap = self._heap
        heapq.heappush(heap, entry)
        if len(heap) > 2 * self._size + 64:
            self._heap = self._live_entries()
            heapq.heapify(self._heap)
