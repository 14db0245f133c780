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
:class:`SegmentedOrder` (a FIFO per segment, O(1) amortized, the same order
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
from itertools import chain

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


class SegmentedOrder(HitCounts):
    """Cached blocks in :func:`slru_key` order with O(1) operations: one FIFO per segment.

    Probationary (never hit) blocks in release order, then protected (hit)
    blocks in release order, then the evict-last lane (blocks the prefix tree
    refused). Because a block's hit count only changes while it is out of the
    cache (a hit takes a reference), release order within a segment is
    exactly the key order, so no heap is needed. Offers the same operations
    as :class:`KeyedOrder`.

    Each segment is a FIFO of entries ``tick << shift | offset`` (a list and
    the index of its head) with lazy invalidation: ``_stamp[offset]`` holds
    the block's live entry (0 when the block is not in the order), so a hit
    only clears the stamp and the entry goes stale where it lies. Taking from
    the front slices the list at the head and checks the stamps of the slice
    with numpy, dropping the stale entries it meets; the segments are rebuilt
    without stale entries when they outnumber live ones, and a list drops its
    taken front when that is over half of it. Entering, leaving and taking a
    block are O(1) amortized, putting blocks back at the front O(blocks). (A
    ``dict`` per segment, its former form, made taking from the front scan
    the slots of keys deleted since its last resize: 57 us per 200-block call
    on the conversation trace at 83,576 blocks.)

    Args:
        first_block_id: Lowest block id of the pool.
        num_blocks: Blocks in the pool.
    """

    __slots__ = ("_heads", "_lanes", "_mask", "_shift", "_size", "_stale", "_stamp", "_tick", "_tick_max", "policy")

    def __init__(self, first_block_id: int, num_blocks: int) -> None:
        self.policy = EVICTION_POLICIES["slru"]
        super().__init__(first_block_id, num_blocks)
        self._shift = max(1, (num_blocks - 1).bit_length())
        self._mask = (1 << self._shift) - 1
        #: int64 ``(num_blocks,)``: each block's live entry, 0 when it is not in the order.
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        #: Probationary, protected and deferred (evict-last) segments, oldest first.
        self._lanes: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._heads = [0, 0, 0]  # index of each segment's first entry not taken yet
        self._tick = 1  # the next entry's tick; from 1, so no entry is 0
        self._tick_max = (1 << (62 - self._shift)) - num_blocks  # then renumber (see _compact), so entries fit int64
        self._size = 0
        self._stale = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_id: int) -> bool:
        return bool(self._stamp[block_id - self.base])

    def __setitem__(self, block_id: int, _value: None) -> None:
        """``block_id`` entered the cache now: the tail of its segment."""
        self.extend([block_id])

    def extend(self, block_ids: list[int]) -> None:
        """Blocks entered the cache now, in this order: each at the tail of its segment.

        Raises:
            ValueError: A block is already in the order (it is left where it was, the
                blocks before it entered).
        """
        if self._tick + len(block_ids) > self._tick_max:
            self._compact()
        base, shift, hits, stamp = self.base, self._shift, memoryview(self.hits), memoryview(self._stamp)
        probation, protected = self._lanes[0].append, self._lanes[1].append
        tick = self._tick
        try:
            for b in block_ids:
                i = b - base
                if stamp[i]:
                    raise ValueError(f"block {b} is already in the eviction order")
                e = tick << shift | i
                tick += 1
                stamp[i] = e
                (protected if hits[i] else probation)(e)
        finally:
            self._size += tick - self._tick
            self._tick = tick

    def extend_offsets(self, offsets: np.ndarray) -> None:
        """:meth:`extend` of block offsets (``block_id - base``, a distinct intp array), with numpy.

        Raises:
            ValueError: A block is already in the order (nothing is applied then).
        """
        if self._tick + len(offsets) > self._tick_max:
            self._compact()
        stamp = self._stamp
        if stamp[offsets].any():
            b = int(offsets[np.argmax(stamp[offsets] != 0)]) + self.base
            raise ValueError(f"block {b} is already in the eviction order")
        hit = self.hits[offsets] != 0
        for lane, off in ((self._lanes[0], offsets[~hit]), (self._lanes[1], offsets[hit])):
            if len(off):
                entries = np.arange(self._tick, self._tick + len(off), dtype=np.int64) << self._shift | off
                self._tick += len(off)
                stamp[off] = entries
                lane.extend(entries.tolist())
        self._size += len(offsets)

    def __delitem__(self, block_id: int) -> None:
        """``block_id`` left the cache (a hit took a reference); its entry goes stale."""
        i = block_id - self.base
        if not self._stamp[i]:
            raise KeyError(block_id)
        self._stamp[i] = 0
        self._size -= 1
        self._stale += 1
        if self._stale > self._size + 1024:
            self._compact()

    def __iter__(self) -> Iterator[int]:
        """Block ids in eviction order."""
        base, mask, stamp = self.base, self._mask, self._stamp.tolist()
        entries = chain.from_iterable(lane[h:] for lane, h in zip(self._lanes, self._heads))
        return ((e & mask) + base for e in entries if stamp[e & mask] == e)

    def pop_first(self, max_blocks: int, skip) -> list[int]:
        """Take up to ``max_blocks`` blocks from the evict-first end; blocks in ``skip`` keep their place."""
        if skip:
            return self._pop_skipping(max_blocks, skip)
        mask, stamp, heads = self._mask, self._stamp, self._heads
        parts: list[np.ndarray] = []
        taken = stale = 0
        for li, lane in enumerate(self._lanes):
            h = heads[li]
            while taken < max_blocks and h < len(lane):
                chunk = np.array(lane[h : h + max_blocks - taken], dtype=np.int64)
                h += len(chunk)
                off = chunk & mask
                live = stamp[off] == chunk
                if not live.all():
                    off = off[live]
                    stale += len(chunk) - len(off)
                stamp[off] = 0
                parts.append(off)
                taken += len(off)
            self._advance(li, h)
        self._stale -= stale
        self._size -= taken
        if not parts:
            return []
        return ((np.concatenate(parts) if len(parts) > 1 else parts[0]) + self.base).tolist()

    def _pop_skipping(self, max_blocks: int, skip) -> list[int]:
        """:meth:`pop_first` with blocks to skip: one entry at a time, the skipped ones put back at the head."""
        base, mask, stamp = self.base, self._mask, memoryview(self._stamp)
        out: list[int] = []
        stale = 0
        for li, lane in enumerate(self._lanes):
            h = self._heads[li]
            kept: list[int] = []
            while len(out) < max_blocks and h < len(lane):
                e = lane[h]
                h += 1
                i = e & mask
                if stamp[i] != e:
                    stale += 1
                elif i + base in skip:
                    kept.append(e)
                else:
                    stamp[i] = 0
                    out.append(i + base)
            if kept:  # they were taken from just before the new head: they go back there
                h -= len(kept)
                lane[h : h + len(kept)] = kept
            self._advance(li, h)
        self._stale -= stale
        self._size -= len(out)
        return out

    def restore(self, block_ids: list[int]) -> None:
        """Put blocks taken by :meth:`pop_first` back at the head of their segment, in their old order."""
        hits, base = self.hits, self.base
        for li, hit in ((1, True), (0, False)):
            front = [b for b in block_ids if bool(hits[b - base]) is hit]
            if front:
                entries = self._entries(front)  # first: it may compact, which moves the heads
                h = self._heads[li]
                start = max(h - len(entries), 0)
                self._lanes[li][start:h] = entries
                self._heads[li] = start

    def defer(self, block_ids: Iterable[int]) -> None:
        """Put blocks taken by :meth:`pop_first` at the evict-last end, in the given order."""
        self._lanes[2].extend(self._entries(list(block_ids)))

    def check(self, cached_ids: Iterable[int]) -> None:
        """Validate the segments against the pool's cached blocks.

        Raises:
            AssertionError: The segments do not hold exactly ``cached_ids``
                (each once), a block sits in the wrong segment for its hit
                count, or the counts of live and stale entries are off.
        """
        ids = sorted(self)
        if len(ids) != len(set(ids)) or ids != sorted(cached_ids) or len(ids) != self._size:
            raise AssertionError(
                f"eviction order holds {ids} (size {self._size}), cached blocks are {sorted(cached_ids)}"
            )
        held = sum(len(lane) - h for lane, h in zip(self._lanes, self._heads))
        if held != self._size + self._stale:
            raise AssertionError(f"segments hold {held} entries, not {self._size} + {self._stale} stale")
        mask, stamp = self._mask, self._stamp
        for li, hit in ((0, False), (1, True)):
            for e in self._lanes[li][self._heads[li] :]:
                i = e & mask
                if stamp[i] == e and bool(self.hits[i]) is not hit:
                    which = "hit but in the probationary" if self.hits[i] else "never hit but in the protected"
                    raise AssertionError(f"block {i + self.base}: {which} segment")

    def _entries(self, block_ids: list[int]) -> list[int]:
        """Fresh entries for ``block_ids`` (not in the order), stamped, in order."""
        if self._tick + len(block_ids) > self._tick_max:
            self._compact()
        base, shift, stamp = self.base, self._shift, self._stamp
        tick = self._tick
        entries = []
        for b in block_ids:
            e = tick << shift | (b - base)
            tick += 1
            stamp[b - base] = e
            entries.append(e)
        self._tick = tick
        self._size += len(block_ids)
        return entries

    def _advance(self, li: int, head: int) -> None:
        """Set segment ``li``'s head; drop the taken front once it is over half the list (amortized O(1))."""
        lane = self._lanes[li]
        if head > 1024 and 2 * head > len(lane):
            del lane[:head]
            head = 0
        self._heads[li] = head

    def _compact(self) -> None:
        """Rebuild the segments without their stale entries, ticks renumbered from 1 (O(entries))."""
        mask, shift, stamp = self._mask, self._shift, self._stamp
        old = stamp.tolist()
        tick = 1
        for li, lane in enumerate(self._lanes):
            live = [e & mask for e in lane[self._heads[li] :] if old[e & mask] == e]
            entries = [(tick + k) << shift | i for k, i in enumerate(live)]
            tick += len(live)
            stamp[live] = entries
            lane[:] = entries
            self._heads[li] = 0
        self._tick = tick
        self._stale = 0
