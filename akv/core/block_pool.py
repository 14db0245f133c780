"""Block pool of one shard: block states, refcounts, free queue and eviction order of cached blocks.

Pure and synchronous. Every block id in ``block_ids`` is in exactly one state:

- ``FREE``: on the free queue, owned by nobody.
- ``ACTIVE``: refcount >= 1 (held by at least one sequence's block table).
- ``CACHED``: refcount 0, published in the prefix cache, in the eviction
  order; an eviction may reclaim it.
- ``IN_FLIGHT``: refcount 0 but still the source of a pending copy (or being
  evicted right now); neither allocatable nor evictable.

Complexities: allocate ``O(n)`` for ``n`` blocks, free/incref/decref ``O(1)``
per block, and taking a cached block out of the LRU order on a hit ``O(1)``:
the order is an ``OrderedDict`` (a hash map threaded by a doubly linked list,
in C), which gives what vLLM v1's ``FreeKVCacheBlockQueue`` gets from its
intrusive list (``vllm/v1/core/kv_cache_utils.py``) at a fraction of the
Python-level cost.

Other eviction policies (:mod:`akv.core.eviction_policy`) replace the
``OrderedDict`` with a :class:`~akv.core.eviction_policy.KeyedOrder` (a lazy
heap, O(log n) per block entering the order or evicted) that offers the same
mapping operations, so the per-block code paths are shared and LRU pays
nothing for the choice.

The eviction order is kept here, beside the refcounts, because a block enters
it exactly when its refcount drops to zero and leaves it exactly when a hit
takes a reference: one owner makes "match then pin" atomic (see
docs/architecture.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable

from akv.core.eviction_policy import EvictionPolicy, KeyedOrder, SegmentedOrder, eviction_policy, lru_key, slru_key

FREE = 0
ACTIVE = 1
CACHED = 2
IN_FLIGHT = 3
STATE_NAMES = ("free", "active", "cached", "in_flight")


class BlockPool:
    """Blocks ``block_ids`` (a contiguous range) of one shard.

    Args:
        block_ids: The global block ids this pool owns, e.g. ``range(0, 4096)``.
        policy: Eviction policy: a name in
            :data:`~akv.core.eviction_policy.EVICTION_POLICIES` (default
            ``"lru"``) or an :class:`~akv.core.eviction_policy.EvictionPolicy`.

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
        "_copy_pins",
        "_counts",
        "_free",
        "_keyed",
        "_lru",
        "_published",
        "_refcount",
        "_state",
        "blocks_freed",
        "first_block_id",
        "num_blocks",
        "policy",
        "total_refs",
    )

    def __init__(self, block_ids: range, *, policy: str | EvictionPolicy = "lru") -> None:
        #: The eviction policy in use.
        self.policy = eviction_policy(policy)
        if block_ids.step != 1 or len(block_ids) == 0:
            raise ValueError(f"block_ids must be a non-empty contiguous range, got {block_ids!r}")
        self.first_block_id = block_ids.start
        self.num_blocks = len(block_ids)
        n = self.num_blocks
        self._state = [FREE] * n
        self._refcount = [0] * n
        self._published = [False] * n
        self._copy_pins: dict[int, int] = {}
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
        return self._state[block_id - self.first_block_id]

    def refcount(self, block_id: int) -> int:
        """Number of block-table references to ``block_id``."""
        return self._refcount[block_id - self.first_block_id]

    def is_published(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the prefix cache."""
        return self._published[block_id - self.first_block_id]

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

    # ---------------------------------------------------------------- mutations
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the free queue, each with refcount 1.

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
        if self._keyed is not None:
            self._keyed.reset(ids)
        base, state, ref = self.first_block_id, self._state, self._refcount
        for b in ids:
            i = b - base
            state[i] = ACTIVE
            ref[i] = 1
        self._counts[FREE] -= num_blocks
        self._counts[ACTIVE] += num_blocks
        self.total_refs += num_blocks
        return ids

    def incref(self, block_ids: Iterable[int], *, hit: bool = False) -> None:
        """Add one reference to each block; a cached block leaves the eviction order.

        Args:
            block_ids: The blocks, any state but free (see Raises).
            hit: These are prefix-cache hits of an admission (not a fork):
                count an access for policies that use hit counts.

        Raises:
            ValueError: A block is free, being evicted, or an unpublished copy
                source (it cannot be referenced). Blocks before it in
                ``block_ids`` keep their new reference.
        """
        if hit and self._keyed is not None:
            block_ids = list(block_ids)
            self._keyed.record_hits(block_ids)
        base, state, ref = self.first_block_id, self._state, self._refcount
        for b in block_ids:
            i = b - base
            s = state[i]
            if s == CACHED:
                del self._lru[b]
                state[i] = ACTIVE
                self._counts[CACHED] -= 1
                self._counts[ACTIVE] += 1
            elif s == IN_FLIGHT and ref[i] == 0 and b in self._copy_pins and self._published[i]:
                # A published block still read by a pending copy: its content is
                # valid, so a prefix hit may take it; the pin only delays its release.
                state[i] = ACTIVE
                self._counts[IN_FLIGHT] -= 1
                self._counts[ACTIVE] += 1
            elif s != ACTIVE:
                raise ValueError(f"incref of block {b} in state {STATE_NAMES[s]}")
            ref[i] += 1
            self.total_refs += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        A block reaching refcount 0 becomes ``IN_FLIGHT`` if a pending copy
        still reads it, else ``CACHED`` (entering the eviction order) if published,
        else ``FREE``. Pass a sequence's blocks deepest first so its deepest
        block is evicted first.

        Raises:
            ValueError: A block's refcount is already 0 (a double free).
        """
        base, ref, state, published = self.first_block_id, self._refcount, self._state, self._published
        pins, free, counts = self._copy_pins, self._free, self._counts
        cached: list[int] = []
        keyed = self._keyed is not None
        lru = self._lru
        for b in block_ids:
            i = b - base
            r = ref[i] - 1
            if r < 0:
                raise ValueError(f"decref of block {b} with refcount 0 (double free)")
            ref[i] = r
            self.total_refs -= 1
            if r:
                continue
            counts[ACTIVE] -= 1
            if pins and b in pins:
                state[i] = IN_FLIGHT
                counts[IN_FLIGHT] += 1
            elif published[i]:
                state[i] = CACHED
                counts[CACHED] += 1
                if keyed:
                    cached.append(b)
                else:
                    lru[b] = None
            else:
                state[i] = FREE
                counts[FREE] += 1
                free.append(b)
                self.blocks_freed += 1
        if cached:  # a keyed order takes them in one call, in release order
            self._keyed.extend(cached)

    def mark_published(self, block_ids: Iterable[int]) -> None:
        """Record that these (referenced) blocks are now in the prefix cache."""
        base, pub = self.first_block_id, self._published
        for b in block_ids:
            pub[b - base] = True

    def pin_for_copy(self, block_ids: Iterable[int]) -> None:
        """Keep blocks alive as sources of a pending copy (they must be referenced now)."""
        pins = self._copy_pins
        for b in block_ids:
            pins[b] = pins.get(b, 0) + 1

    def unpin_copied(self, block_ids: Iterable[int]) -> None:
        """Release copy pins; an unreferenced block then becomes cached or free."""
        base, pins = self.first_block_id, self._copy_pins
        for b in block_ids:
            left = pins[b] - 1
            if left:
                pins[b] = left
                continue
            del pins[b]
            i = b - base
            if self._state[i] == IN_FLIGHT:
                self._counts[IN_FLIGHT] -= 1
                self._release(i)

    def evict_begin(self, max_blocks: int, skip: Container[int] = frozenset()) -> list[int]:
        """Take up to ``max_blocks`` cached blocks for eviction, first in eviction order first.

        Blocks in ``skip`` (prefix hits about to be pinned) keep their place.
        The taken blocks move to ``IN_FLIGHT`` until :meth:`evict_finish`
        (removed from the prefix cache, now free) or :meth:`evict_abort` (back
        at the head). O(taken + skipped) for LRU, O((taken + skipped) log
        cached) amortized for the other policies.
        """
        base, state, lru = self.first_block_id, self._state, self._lru
        if self._keyed is not None:
            out = self._keyed.pop_first(max_blocks, skip)
            for b in out:
                state[b - base] = IN_FLIGHT
        elif not skip:
            out = []
            for _ in range(min(max_blocks, len(lru))):
                b = lru.popitem(last=False)[0]
                state[b - base] = IN_FLIGHT
                out.append(b)
        else:
            out = []
            for b in lru:
                if len(out) >= max_blocks:
                    break
                if b not in skip:
                    out.append(b)
            for b in out:
                del lru[b]
                state[b - base] = IN_FLIGHT
        self._counts[CACHED] -= len(out)
        self._counts[IN_FLIGHT] += len(out)
        return out

    def evict_finish(self, block_ids: Iterable[int]) -> None:
        """Blocks taken by :meth:`evict_begin` left the prefix cache: free them."""
        base = self.first_block_id
        k = 0
        for b in block_ids:
            i = b - base
            if self._state[i] != IN_FLIGHT:
                raise ValueError(f"evict_finish of block {b} in state {STATE_NAMES[self._state[i]]}")
            self._published[i] = False
            self._state[i] = FREE
            self._free.append(b)
            k += 1
        self._counts[IN_FLIGHT] -= k
        self._counts[FREE] += k
        self.blocks_freed += k

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
        base, lru = self.first_block_id, self._lru
        if self._keyed is not None:
            for b in block_ids:
                self._state[b - base] = CACHED
            if to_mru:
                self._keyed.defer(block_ids)
            else:
                self._keyed.restore(block_ids)
        else:
            for b in block_ids if to_mru else reversed(block_ids):
                self._state[b - base] = CACHED
                lru[b] = None
                if not to_mru:
                    lru.move_to_end(b, last=False)
        self._counts[IN_FLIGHT] -= len(block_ids)
        self._counts[CACHED] += len(block_ids)

    # ---------------------------------------------------------------- internals
    def _release(self, i: int) -> None:
        """Move unreferenced offset ``i`` to in-flight, cached or free."""
        if (i + self.first_block_id) in self._copy_pins:
            self._state[i] = IN_FLIGHT
            self._counts[IN_FLIGHT] += 1
        elif self._published[i]:
            self._state[i] = CACHED
            self._counts[CACHED] += 1
            self._lru[i + self.first_block_id] = None
        else:
            self._state[i] = FREE
            self._counts[FREE] += 1
            self._free.append(i + self.first_block_id)
            self.blocks_freed += 1

    def check(self) -> None:
        """Full O(num_blocks) consistency check, the eviction order's structure included.

        Raises:
            AssertionError: Naming the first inconsistent block.
        """
        counts = [0, 0, 0, 0]
        for i, s in enumerate(self._state):
            counts[s] += 1
            b = i + self.first_block_id
            r = self._refcount[i]
            if (s == ACTIVE) != (r > 0):
                raise AssertionError(f"block {b}: state {STATE_NAMES[s]} with refcount {r}")
            if s == CACHED and not self._published[i]:
                raise AssertionError(f"block {b}: cached but not published")
            if s == FREE and self._published[i]:
                raise AssertionError(f"block {b}: free but still published")
        if sum(self._refcount) != self.total_refs:
            raise AssertionError(f"refcount sum {sum(self._refcount)} != total_refs {self.total_refs}")
        if counts != self._counts:
            raise AssertionError(f"state counters {self._counts} != recount {counts}")
        if sorted(self._free) != sorted(i + self.first_block_id for i, s in enumerate(self._state) if s == FREE):
            raise AssertionError("free queue does not hold exactly the free blocks")
        cached = [i + self.first_block_id for i, s in enumerate(self._state) if s == CACHED]
        if self._keyed is not None:
            self._keyed.check(cached)
        elif len(self._lru) != len(cached) or any(self._state[b - self.first_block_id] != CACHED for b in self._lru):
            raise AssertionError(f"eviction order {list(self._lru)} does not hold exactly the cached blocks {cached}")
