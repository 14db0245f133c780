"""The SLRU eviction order with O(1) operations (:class:`SegmentedOrder`), for :func:`~akv.core.eviction_policy.slru_key`.

In its own module beside :mod:`akv.core.eviction_policy` (the policies, their
keys and the heap that serves every other key) to keep both files short.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from itertools import chain

import numpy as np

from akv.core.eviction_policy import EVICTION_POLICIES, HitCounts

__all__ = ["SegmentedOrder"]


#: Fewest lane entries :meth:`SegmentedOrder.pop_first` reads per numpy slice.
_MIN_SLICE = 256


def _slice_take(
    chunk: np.ndarray, off: np.ndarray, live: np.ndarray, held: np.ndarray | None, want: int
) -> tuple[int, np.ndarray, int, np.ndarray | None]:
    """What :meth:`SegmentedOrder.pop_first` takes from one slice of a lane, entries consumed in order.

    Args:
        chunk: int64 lane entries; ``off`` their pool offsets; ``live`` whether
            each is current (not stale); ``held`` the skip mask over offsets, or None.
        want: Blocks still wanted (>= 1).

    Returns:
        ``(end, taken, stale, kept)``: the entries consumed (up to the last one
        taken, or all), the offsets taken (at most ``want``), the stale entries
        among the consumed, and the consumed live entries to skip (to go back
        before the head), or None.
    """
    take = live if held is None else live & ~held[off]
    at = np.flatnonzero(take)
    end = len(chunk) if len(at) < want else int(at[want - 1]) + 1
    stale = end - int(np.count_nonzero(live[:end]))
    kept = None
    if held is not None:
        keep = live[:end] & held[off[:end]]
        if np.count_nonzero(keep):
            kept = chunk[:end][keep]
    return end, off[at[:want]], stale, kept


class SegmentedOrder(HitCounts):
    """Cached blocks in :func:`~akv.core.eviction_policy.slru_key` order with O(1) operations: one FIFO per segment.

    Probationary (never hit) blocks in release order, then protected (hit)
    blocks in release order, then the evict-last lane (blocks the prefix tree
    refused). Because a block's hit count only changes while it is out of the
    cache (a hit takes a reference), release order within a segment is
    exactly the key order, so no heap is needed. Offers the same operations
    as :class:`~akv.core.eviction_policy.KeyedOrder`.

    Each segment is a FIFO of entries ``tick << shift | offset`` (an
    ``array('q')`` and the index of its head) with lazy invalidation: ``_stamp[offset]`` holds
    the block's live entry (0 when the block is not in the order), so a hit
    only clears the stamp and the entry goes stale where it lies. Taking from
    the front slices the list at the head and checks the stamps of the slice
    with numpy, dropping the stale entries it meets; the segments are rebuilt
    without stale entries when they outnumber live ones, and a list drops its
    taken front when that is over half of it. Entering, leaving and taking a
    block are O(1) amortized, putting blocks back at the front O(blocks). (A
    ``dict`` per segment, its former form, made taking from the front scan
    the slots of keys deleted since its last resize: 57 us per 200-block call
    on the conversation trace at 83,576 blocks. A ``list`` per segment, the
    form after it, held a Python int object per entry, which numpy converted
    one by one on every take; an ``array('q')`` holds the entries as int64,
    which numpy reads in place and writes in one copy.)

    Args:
        first_block_id: Lowest block id of the pool.
        num_blocks: Blocks in the pool.
    """

    __slots__ = (
        "_from_deferred",
        "_heads",
        "_held",
        "_lanes",
        "_mask",
        "_shift",
        "_size",
        "_stale",
        "_stamp",
        "_tick",
        "_tick_max",
        "policy",
    )

    def __init__(self, first_block_id: int, num_blocks: int) -> None:
        self.policy = EVICTION_POLICIES["slru"]
        super().__init__(first_block_id, num_blocks)
        self._shift = max(1, (num_blocks - 1).bit_length())
        self._mask = (1 << self._shift) - 1
        #: int64 ``(num_blocks,)``: each block's live entry, 0 when it is not in the order.
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        #: Probationary, protected and deferred (evict-last) segments, oldest first.
        self._lanes: tuple[array, array, array] = (array("q"), array("q"), array("q"))
        self._heads = [0, 0, 0]  # index of each segment's first entry not taken yet
        self._tick = 1  # the next entry's tick; from 1, so no entry is 0
        self._tick_max = (1 << (62 - self._shift)) - num_blocks  # then renumber (see _compact), so entries fit int64
        self._size = 0
        self._stale = 0
        self._from_deferred: set[int] | tuple = ()  # blocks the last pop_first took from the evict-last lane
        self._held: np.ndarray | None = None  # scratch bool (num_blocks,) for pop_first's skip, made on first use

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
        if np.count_nonzero(stamp[offsets]):
            b = int(offsets[np.argmax(stamp[offsets] != 0)]) + self.base
            raise ValueError(f"block {b} is already in the eviction order")
        hit = self.hits[offsets] != 0
        for lane, off in ((self._lanes[0], offsets[~hit]), (self._lanes[1], offsets[hit])):
            if len(off):
                entries = np.arange(self._tick, self._tick + len(off), dtype=np.int64) << self._shift | off
                self._tick += len(off)
                stamp[off] = entries
                lane.frombytes(entries.tobytes())
        self._size += len(offsets)

    def requeue_offsets(self, offsets: np.ndarray) -> None:
        """Blocks at ``offsets`` (a distinct intp array, all in the order) enter again now, in this order.

        Raises:
            KeyError: A block is not in the order (nothing is applied then).
        """
        self.discard_offsets(offsets)
        self.extend_offsets(offsets)

    def discard_offsets(self, offsets: np.ndarray) -> None:
        """Blocks at ``offsets`` (a distinct intp array, all in the order) leave it: ``del`` of each, one numpy pass.

        Raises:
            KeyError: A block is not in the order (nothing is applied then).
        """
        stamp = self._stamp
        if np.count_nonzero(stamp[offsets]) != len(offsets):
            raise KeyError(int(offsets[np.argmin(stamp[offsets] != 0)]) + self.base)
        stamp[offsets] = 0
        self._size -= len(offsets)
        self._stale += len(offsets)
        if self._stale > self._size + 1024:
            self._compact()

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
        """Take up to ``max_blocks`` blocks from the evict-first end; blocks in ``skip`` keep their place.

        Each segment is taken from in slices of the blocks still wanted, each
        checked with numpy (live entries, then ``skip`` through a mask over the
        pool's offsets), so a pass costs a few numpy calls per slice, not a
        Python step per block; skipped blocks go back just before the new head,
        in order, where they were. O(taken + stale + skipped + len(skip)).

        Args:
            max_blocks: Blocks to take at most.
            skip: Block ids to leave in place (a sized collection, such as
                a set or a dict, read once into a mask; ids outside the pool
                ignored).

        Returns:
            The taken block ids, evict-first first.
        """
        mask, stamp, heads, base = self._mask, self._stamp, self._heads, self.base
        held, marked = self._skip_mask(skip) if skip else (None, None)
        parts: list[np.ndarray] = []
        taken = stale = 0
        self._from_deferred = ()
        for li, lane in enumerate(self._lanes):
            h = heads[li]
            kept: list[np.ndarray] = []
            size = 0  # the first slice: what is wanted
            while taken < max_blocks and h < len(lane):
                want = max_blocks - taken
                # Later slices at least _MIN_SLICE entries: a long run of stale (or skipped) entries
                # is crossed in a few numpy calls, not one per wanted block.
                size = max(want, _MIN_SLICE) if size else want
                chunk = np.frombuffer(lane[h : h + size], dtype=np.int64)
                off = chunk & mask
                live = stamp[off] == chunk
                end = len(chunk)
                if held is not None or end > want or np.count_nonzero(live) < end:  # else all live, all wanted
                    end, off, dropped, keep = _slice_take(chunk, off, live, held, want)
                    stale += dropped
                    if keep is not None:
                        kept.append(keep)
                h += end
                stamp[off] = 0
                parts.append(off)
                taken += len(off)
                if li == 2 and len(off):
                    self._from_deferred = {*self._from_deferred, *(off + base).tolist()}
            if kept:  # taken from just before the new head: they go back there, in order
                back = array("q", (np.concatenate(kept) if len(kept) > 1 else kept[0]).tobytes())
                h -= len(back)
                lane[h : h + len(back)] = back
            self._advance(li, h)
        if held is not None:
            held[marked] = False
        self._stale -= stale
        self._size -= taken
        if not parts:
            return []
        return ((np.concatenate(parts) if len(parts) > 1 else parts[0]) + base).tolist()

    def _skip_mask(self, skip) -> tuple[np.ndarray, np.ndarray]:
        """The scratch bool mask over the pool's offsets set at the blocks of ``skip``, and those offsets.

        The caller clears the mask at the offsets after use.
        """
        held = self._held
        if held is None:
            held = self._held = np.zeros(len(self._stamp), dtype=bool)
        off = np.fromiter(skip, dtype=np.int64, count=len(skip)) - self.base
        off = off[(off >= 0) & (off < len(held))]
        held[off] = True
        return held, off

    def restore(self, block_ids: list[int]) -> None:
        """Put blocks taken by the last :meth:`pop_first` back at the head of their segment, in their old order.

        A block taken from the evict-last lane goes back to that lane's head
        (as :class:`~akv.core.eviction_policy.KeyedOrder` restores its old entry).
        """
        hits, base, deferred = self.hits, self.base, self._from_deferred
        for li, hit in ((2, None), (1, True), (0, False)):
            if li == 2:
                front = [b for b in block_ids if b in deferred]
            else:
                front = [b for b in block_ids if b not in deferred and bool(hits[b - base]) is hit]
            if front:
                entries = self._entries(front)  # first: it may compact, which moves the heads
                h = self._heads[li]
                start = max(h - len(entries), 0)
                self._lanes[li][start:h] = array("q", entries)
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
            lane[:] = array("q", entries)
            self._heads[li] = 0
        self._tick = tick
        self._stale = 0
