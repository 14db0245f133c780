"""Block pool of one shard: block states, refcounts, free queue and eviction order of cached blocks.

Pure and synchronous. Every block id in ``block_ids`` is in exactly one state:

- ``FREE``: on the free queue, owned by nobody.
- ``ACTIVE``: refcount >= 1 (held by at least one sequence's block table).
- ``CACHED``: refcount 0, published in the prefix cache, in the eviction
  order; an eviction may reclaim it.
- ``IN_FLIGHT``: refcount 0 but still the source of a pending copy (or being
  evicted right now); neither allocatable nor evictable.

States, refcounts and published flags are numpy arrays indexed by block
offset, so a batch of blocks (an admission's prefix hits, a step's freed
sequences) is updated with a few vectorized operations; Python-level work
per block is left only where a block enters or leaves the eviction order.

Complexities: allocate ``O(n)`` for ``n`` blocks, free/incref/decref ``O(1)`` per
block (vectorized), and taking a cached block out of the LRU order on a hit ``O(1)``:
the order is an ``OrderedDict`` (a hash map threaded by a doubly linked list, in C),
what vLLM v1's ``FreeKVCacheBlockQueue`` gets from its intrusive list
(``vllm/v1/core/kv_cache_utils.py``) at a fraction of the Python-level cost.

Other eviction policies (:mod:`akv.core.eviction_policy`) replace the
``OrderedDict`` with a :class:`~akv.core.eviction_policy.KeyedOrder` (a lazy
heap, O(log n) per block entering the order or evicted) that offers the same
mapping operations, so the per-block code paths are shared and LRU pays
nothing for the choice.

Refcount transitions and copy pins are in :mod:`akv.core.block_refs`, the
transitions of blocks moving between tiers in :mod:`akv.core.block_moves`;
this module keeps the free queue, allocation, published flags and eviction steps.

The eviction order is kept here, beside the refcounts, because a block enters
it exactly when its refcount drops to zero and leaves it exactly when a hit
takes a reference: one owner makes "match then pin" atomic (see
docs/architecture.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

import numpy as np

from akv.core.block_moves import BlockMoves
from akv.core.block_refs import ACTIVE, CACHED, FREE, IN_FLIGHT, STATE_NAMES, BlockRefs
from akv.core.eviction_policy import (
    DEFAULT_EVICTION_POLICY,
    EvictionPolicy,
    KeyedOrder,
    eviction_policy,
    lru_key,
    slru_key,
)
from akv.core.segmented_order import SegmentedOrder

__all__ = ["ACTIVE", "CACHED", "FREE", "IN_FLIGHT", "STATE_NAMES", "BlockPool"]


class BlockPool(BlockRefs, BlockMoves):
    """Blocks ``block_ids`` (a contiguous range) of one shard.

    Args:
        block_ids: The global block ids this pool owns, e.g. ``range(0, 4096)``.
        policy: Eviction policy: a name in
            :data:`~akv.core.eviction_policy.EVICTION_POLICIES` (default
            ``"slru"``, :data:`~akv.core.eviction_policy.DEFAULT_EVICTION_POLICY`) or an :class:`~akv.core.eviction_policy.EvictionPolicy`.

    Raises:
        ValueError: ``block_ids`` is empty or not contiguous, or the policy
            name is unknown.

    The free queue hands out the lowest ids first on a fresh pool and reuses
    the most recently freed block first afterwards (a stack: warm memory).
    The eviction order of cached blocks (by default LRU) evicts the least
    recently released first among equal keys; a sequence releases its blocks
    deepest first, so on ties the deepest block of a finished sequence is
    evicted first.
    """

    __slots__ = (
        "_counts",
        "_free",
        "_keyed",
        "_lru",
        "_pins",
        "_published",
        "_refcount",
        "_state",
        "blocks_freed",
        "first_block_id",
        "num_blocks",
        "policy",
        "total_pins",
        "total_refs",
    )

    def __init__(self, block_ids: range, *, policy: str | EvictionPolicy = DEFAULT_EVICTION_POLICY) -> None:
        #: The eviction policy in use.
        self.policy = eviction_policy(policy)
        if block_ids.step != 1 or len(block_ids) == 0:
            raise ValueError(f"block_ids must be a non-empty contiguous range, got {block_ids!r}")
        self.first_block_id = block_ids.start
        self.num_blocks = len(block_ids)
        n = self.num_blocks
        self._state = np.zeros(n, dtype=np.int8)  # FREE
        self._refcount = np.zeros(n, dtype=np.int32)
        self._published = np.zeros(n, dtype=bool)
        self._pins = np.zeros(n, dtype=np.int32)  # pending copies reading or writing each block
        #: Sum of all copy pins (0: nothing pinned).
        self.total_pins = 0
        self._free = list(reversed(block_ids))  # pop() yields the lowest id first
        # Cached block ids in eviction order: an OrderedDict (oldest first) for
        # LRU, else a KeyedOrder, which offers the same mapping operations.
        self._keyed: KeyedOrder | SegmentedOrder | None = None
        if self.policy.name == "lru" and self.policy.key is lru_key:
            self._lru: OrderedDict[int, None] | KeyedOrder | SegmentedOrder = OrderedDict()
        elif self.policy.key is slru_key:
            self._keyed = self._lru = SegmentedOrder(self.first_block_id, n)
        else:
            self._keyed = self._lru = KeyedOrder(self.policy, self.first_block_id, n)
        self._counts = [n, 0, 0, 0]
        #: Sum of all refcounts; equals the block-table references of live sequences.
        self.total_refs = 0
        #: Blocks put back on the free queue since creation (monotonic; the
        #: initial free blocks are not counted).
        self.blocks_freed = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks on the free queue."""
        return self._counts[FREE]

    @property
    def num_active(self) -> int:
        """Blocks with refcount >= 1."""
        return self._counts[ACTIVE]

    @property
    def num_cached(self) -> int:
        """Cached blocks with refcount 0: what eviction can reclaim."""
        return self._counts[CACHED]

    @property
    def num_in_flight(self) -> int:
        """Blocks held only by a pending copy or an eviction in progress."""
        return self._counts[IN_FLIGHT]

    def counts(self) -> dict[str, int]:
        """Blocks per state name; the values add up to :attr:`num_blocks`."""
        return dict(zip(STATE_NAMES, self._counts))

    def owns(self, block_id: int) -> bool:
        """Whether ``block_id`` belongs to this pool."""
        return 0 <= block_id - self.first_block_id < self.num_blocks

    def state(self, block_id: int) -> int:
        """State constant of ``block_id`` (``FREE``, ``ACTIVE``, ``CACHED``, ``IN_FLIGHT``)."""
        return int(self._state[block_id - self.first_block_id])

    def states(self, block_ids: np.ndarray) -> np.ndarray:
        """State constants (int8) of ``block_ids``, an int array of this pool's blocks."""
        return self._state[block_ids - self.first_block_id]

    def num_cached_among(self, block_ids: Collection[int]) -> int:
        """How many of the distinct ``block_ids`` are cached blocks of this pool (other ids are ignored). O(len(block_ids))."""
        if not block_ids:
            return 0
        ids = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids)) - self.first_block_id
        if ids.min() < 0 or ids.max() >= self.num_blocks:  # another tier's ids: not among this pool's
            ids = ids[(ids >= 0) & (ids < self.num_blocks)]
        return int(np.count_nonzero(self._state[ids] == CACHED))

    def refcount(self, block_id: int) -> int:
        """Number of block-table references to ``block_id``."""
        return int(self._refcount[block_id - self.first_block_id])

    def is_published(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the prefix cache."""
        return bool(self._published[block_id - self.first_block_id])

    @property
    def num_published(self) -> int:
        """Blocks in the prefix cache (any state but free)."""
        return int(np.count_nonzero(self._published))

    def eviction_order(self) -> list[int]:
        """Cached block ids in the order eviction would take them.

        O(cached) for LRU (least to most recently released), O(cached log
        cached) for the other policies.
        """
        return list(self._lru)

    #: Former name of :meth:`eviction_order` (the order is LRU by default).
    lru_order = eviction_order

    def num_hits(self, block_id: int) -> int:
        """Prefix hits on ``block_id`` since its allocation; always 0 under LRU (not counted)."""
        return 0 if self._keyed is None else self._keyed.hits[block_id - self.first_block_id]

    def hit_counts(self, block_ids: np.ndarray) -> np.ndarray:
        """Prefix hits of each of ``block_ids`` (an int array of this pool's blocks): int64, zeros under LRU."""
        if self._keyed is None:
            return np.zeros(len(block_ids), dtype=np.int64)
        return self._keyed.hits[np.asarray(block_ids, dtype=np.intp) - self.first_block_id].astype(np.int64)

    def set_num_hits(self, block_ids: list[int], num_hits: list[int]) -> None:
        """Set the prefix-hit counts of referenced blocks (a snapshot restored); a no-op under LRU.

        Args:
            block_ids: Blocks of this pool.
            num_hits: Their counts (ints >= 0), one per block.
        """
        if self._keyed is not None and block_ids:
            self._keyed.hits[np.array(block_ids, dtype=np.intp) - self.first_block_id] = num_hits

    # ---------------------------------------------------------------- mutations
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the free queue, each with refcount 1.

        Returns:
            The block ids (Python ints), lowest first on a fresh pool.

        Raises:
            ValueError: Fewer than ``num_blocks`` free blocks (the caller checks
                :attr:`num_free` first; this is a broken invariant, not a shortage).
        """
        if num_blocks > self._counts[FREE]:
            raise ValueError(f"allocate({num_blocks}) with only {self._counts[FREE]} free blocks")
        if num_blocks <= 0:
            return []
        ids = self._free[-num_blocks:]
        del self._free[-num_blocks:]
        ids.reverse()
        base = self.first_block_id
        if num_blocks <= _SCALAR_MAX:
            state, ref = self._state, self._refcount
            hits = self._keyed.hits if self._keyed is not None else None
            for b in ids:
                state[b - base] = ACTIVE
                ref[b - base] = 1
                if hits is not None:
                    hits[b - base] = 0
        else:
            idx = np.array(ids, dtype=np.intp)
            idx -= base
            self._state[idx] = ACTIVE
            self._refcount[idx] = 1
            if self._keyed is not None:
                self._keyed.reset(idx)
        self._counts[FREE] -= num_blocks
        self._counts[ACTIVE] += num_blocks
        self.total_refs += num_blocks
        return ids

    def mark_published(self, block_ids: Iterable[int]) -> None:
        """Record that these (referenced) blocks are now in the prefix cache."""
        if isinstance(block_ids, (list, tuple)) and len(block_ids) <= _SCALAR_MAX:
            base, pub = self.first_block_id, self._published
            for b in block_ids:
                pub[b - base] = True
            return
        ids = block_ids if isinstance(block_ids, np.ndarray) else np.fromiter(block_ids, dtype=np.intp)
        self._published[ids.astype(np.intp) - self.first_block_id] = True

    def unpublish(self, block_ids: list[int]) -> int:
        """Blocks left the prefix cache without an eviction (a reset): cached ones are freed now, others on release.

        A referenced block stays valid for its holders and is freed, not
        cached, when its last reference goes; so is a copy source a pin holds.

        Args:
            block_ids: Published blocks of this pool, distinct.

        Returns:
            Blocks freed now (those that were cached).
        """
        if not block_ids:
            return 0
        idx = np.array(block_ids, dtype=np.intp) - self.first_block_id
        cached = [int(b) for b, s in zip(block_ids, self._state[idx].tolist()) if s == CACHED]
        if cached:
            self.incref(cached, distinct=True)  # out of the eviction order
        self._published[idx] = False
        if cached:
            self.decref(cached, distinct=True)  # unpublished at refcount 0: free
        return len(cached)

    def evict_begin(self, max_blocks: int, skip: Collection[int] = frozenset()) -> list[int]:
        """Take up to ``max_blocks`` cached blocks for eviction, first in eviction order first.

        Blocks in ``skip`` (prefix hits about to be pinned) keep their place.
        The taken blocks move to ``IN_FLIGHT`` until :meth:`evict_finish`
        (removed from the prefix cache, now free) or :meth:`evict_abort` (back
        at the head). O(taken + skipped) for LRU, O((taken + skipped) log
        cached) amortized for the other policies.
        """
        lru = self._lru
        if skip:
            skip = self._cached_among(skip)
        if self._keyed is not None:
            out = self._keyed.pop_first(max_blocks, skip)
        elif not skip:
            popitem = lru.popitem
            out = [popitem(last=False)[0] for _ in range(min(max_blocks, len(lru)))]
        else:
            out = []
            for b in lru:
                if len(out) >= max_blocks:
                    break
                if b not in skip:
                    out.append(b)
            for b in out:
                del lru[b]
        if out:
            self._state[np.array(out, dtype=np.intp) - self.first_block_id] = IN_FLIGHT
        self._counts[CACHED] -= len(out)
        self._counts[IN_FLIGHT] += len(out)
        return out

    def _cached_among(self, block_ids: Collection[int]) -> set[int] | tuple:
        """The cached blocks of this pool among ``block_ids`` (other ids ignored), as a set; ``()`` for none. One numpy pass."""
        ids = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids)) - self.first_block_id
        ids = ids[(ids >= 0) & (ids < self.num_blocks)]
        ids = ids[self._state[ids] == CACHED]
        return set((ids + self.first_block_id).tolist()) if len(ids) else ()

    def evict_finish(self, block_ids: Iterable[int]) -> None:
        """Blocks taken by :meth:`evict_begin` left the prefix cache: free them.

        Raises:
            ValueError: A block is not being evicted (nothing is applied then).
        """
        ids = list(block_ids)
        if not ids:
            return
        idx = np.array(ids, dtype=np.intp) - self.first_block_id
        s = self._state[idx]
        if (s != IN_FLIGHT).any():
            b = ids[int(np.argmax(s != IN_FLIGHT))]
            raise ValueError(f"evict_finish of block {b} in state {STATE_NAMES[self.state(b)]}")
        self._published[idx] = False
        self._state[idx] = FREE
        self._free.extend(ids)
        k = len(ids)
        self._counts[IN_FLIGHT] -= k
        self._counts[FREE] += k
        self.blocks_freed += k

    @property
    def counts_hits(self) -> bool:
        """Whether the policy counts prefix hits per block (every policy but plain LRU)."""
        return self._keyed is not None

    def evict_abort(self, block_ids: list[int], *, to_mru: bool = False) -> None:
        """Put blocks taken by :meth:`evict_begin` back in the eviction order, in order.

        Args:
            block_ids: The blocks, as :meth:`evict_begin` returned them.
            to_mru: Put them at the evict-last end instead of back at the head
                (for blocks that cannot be evicted yet: non-leaves of the
                prefix tree). Under LRU that is the most recently used end,
                which later releases pass; under the other policies a lane
                behind every other cached block, until the block leaves the
                cache. Without it, LRU puts them at the head and the other
                policies back in their old place (their keys are unchanged).
        """
        if not block_ids:
            return
        lru = self._lru
        self._state[np.array(block_ids, dtype=np.intp) - self.first_block_id] = CACHED
        if self._keyed is not None:
            if to_mru:
                self._keyed.defer(block_ids)
            else:
                self._keyed.restore(block_ids)
        else:
            for b in block_ids if to_mru else reversed(block_ids):
                lru[b] = None
                if not to_mru:
                    lru.move_to_end(b, last=False)
        self._counts[IN_FLIGHT] -= len(block_ids)
        self._counts[CACHED] += len(block_ids)

    def check(self) -> None:
        """Full O(num_blocks) consistency check, the eviction order's structure included.

        Raises:
            AssertionError: Naming the first inconsistent block.
        """
        base, state, ref, pub = self.first_block_id, self._state, self._refcount, self._published
        bad = np.flatnonzero((state == ACTIVE) != (ref > 0))
        if len(bad):
            i = int(bad[0])
            raise AssertionError(f"block {i + base}: state {STATE_NAMES[state[i]]} with refcount {ref[i]}")
        bad = np.flatnonzero((state == CACHED) & ~pub)
        if len(bad):
            raise AssertionError(f"block {int(bad[0]) + base}: cached but not published")
        bad = np.flatnonzero((state == FREE) & pub)
        if len(bad):
            raise AssertionError(f"block {int(bad[0]) + base}: free but still published")
        pins = self._pins
        if pins.min() < 0 or int(pins.sum()) != self.total_pins:
            raise AssertionError(f"copy pins sum to {int(pins.sum())}, {self.total_pins} counted")
        bad = np.flatnonzero((pins != 0) & ((state == FREE) | (state == CACHED)))
        if len(bad):
            raise AssertionError(f"block {int(bad[0]) + base}: pinned but {STATE_NAMES[state[bad[0]]]}")
        if int(ref.sum()) != self.total_refs:
            raise AssertionError(f"refcount sum {int(ref.sum())} != total_refs {self.total_refs}")
        counts = np.bincount(state, minlength=4).tolist()
        if counts != self._counts:
            raise AssertionError(f"state counters {self._counts} != recount {counts}")
        if sorted(self._free) != (np.flatnonzero(state == FREE) + base).tolist():
            raise AssertionError("free queue does not hold exactly the free blocks")
        cached = (np.flatnonzero(state == CACHED) + base).tolist()
        if self._keyed is not None:
            self._keyed.check(cached)
        elif len(self._lru) != len(cached) or any(state[b - base] != CACHED for b in self._lru):
            raise AssertionError(f"eviction order {list(self._lru)} does not hold exactly the cached blocks {cached}")


#: Up to this many blocks, :meth:`BlockPool.allocate` writes states one by one
#: (numpy's per-call overhead exceeds the per-element cost below it).
_SCALAR_MAX = 4
