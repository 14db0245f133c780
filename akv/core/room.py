"""Room for new blocks: eviction on demand and the exact room checks (part of :class:`~akv.core.shard_state.ShardState`).

Free blocks earmarked by reservations (:mod:`akv.core.reservation`) are not
room for other sequences. Eviction takes cached leaves in the policy's order;
a cached block above a published block that a pending copy pins waits for the
copy (:meth:`ShardRoom.evictable_now`).
"""

from __future__ import annotations

from collections.abc import Hashable

from akv.core.admission import PendingHits
from akv.core.block_pool import CACHED
from akv.core.reservation import fork_earmarks, row_reserved
from akv.core.step import StepOutcome
from akv.errors import PoolExhausted, RequestTooLarge


class ShardRoom:
    """Room and eviction; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes)."""

    __slots__ = ()

    def _evictable(self, protected) -> int:
        """Blocks eviction may free now: cached ones but the ``protected`` ones and those above a block a pending copy pins, plus pending held demotions.

        Exact, so that a refusal is decided before anything is evicted. The
        tree is walked only while a published block is pinned by a copy
        (O(pins + their depth)); otherwise one numpy pass over ``protected``.
        """
        pool = self.pool
        return pool.num_cached - pool.num_cached_among(self._skipped(protected)) + self._reclaimable()

    def _skipped(self, protected):
        """``protected`` plus the cached blocks above a published block a pending copy pins (they wait for it)."""
        pinned = self.pool.pinned_published()
        if not pinned:
            return protected
        blocked = self.tree.ancestors(pinned)
        blocked.update(protected)
        return blocked

    def _make_room(
        self, need: int, total: int, protected: PendingHits, out: StepOutcome, own: int = 0
    ) -> PoolExhausted | RequestTooLarge | None:
        """Ensure ``need`` free blocks for one sequence, evicting if needed; return an error instead if impossible.

        ``total`` is the blocks the sequence will hold in all: more than the
        shard has can never be served (:class:`RequestTooLarge`). ``own`` is
        the blocks earmarked for this sequence: it may take those and the
        free blocks no reservation holds.
        """
        pool = self.pool
        if total > pool.num_blocks:
            return RequestTooLarge(total, pool.num_blocks)
        held = self.num_reserved - own  # earmarked for other sequences
        if need <= pool.num_free - held:
            return None
        evictable = self._evictable(protected.blocks())
        if need > pool.num_free - held + evictable:
            self.counters.pool_exhausted += 1
            return PoolExhausted(need, pool.num_free - held, evictable)
        self._evict(need - pool.num_free + held, protected.blocks(), out)
        if need > pool.num_free - held:
            # Cached blocks above a published block that a pending copy still
            # pins cannot be evicted (only leaves can) until the copy has run.
            self.counters.pool_exhausted += 1
            return PoolExhausted(need, pool.num_free - held, (self.evictable_now()))
        return None

    def fork_room(self, forks) -> list[int]:
        """Check that the copy-on-write blocks ``forks`` must earmark fit now; return their rows.

        Exact, so that a step validated on every shard (``Validate`` asks
        this too) cannot fail on one shard after another shard applied its
        part: the blocks must be among the unreserved free blocks plus the
        cached blocks an eviction pass can take now (:meth:`evictable_now`).
        Changes nothing but the ``pool_exhausted`` counter.

        Args:
            forks: ``(parent_id, child_ids)`` pairs of validated live parents.

        Returns:
            The parent rows to earmark a block for (see
            :func:`~akv.core.reservation.fork_earmarks`).

        Raises:
            PoolExhausted: They do not fit (the step must be refused whole).
        """
        earmarks = fork_earmarks(self.tables, [self.sequences[p].row for p, _ in forks], self.block_size)
        free = self.pool.num_free - self.num_reserved
        if len(earmarks) > free:
            evictable = self.evictable_now()
            if len(earmarks) > free + evictable:
                self.counters.pool_exhausted += 1
                raise PoolExhausted(len(earmarks), free, evictable)
        return earmarks

    def evictable_now(self) -> int:
        """Cached blocks an eviction pass could take now (reads the tree; changes nothing).

        All cached blocks but those above a published block that only a
        pending copy still holds: the tree evicts only leaves, so they wait
        for the copy. (A referenced block's ancestors are referenced too: the
        same block table holds them.) With a host tier, likewise those above
        a host block whose demotion copy is pending: that block can be
        neither dropped nor promoted until the copy ran, so the blocks above
        it can leave the device only by a demotion, which needs host room
        that may not be there (counted out either way: a refusal never
        claims room it could not make). Walks the tree only while such a
        pinned block exists; O(pins + their depth).

        Plus the device blocks of held demotions whose copies are pending,
        which :meth:`_evict` takes on demand (:meth:`~akv.core.tiers.ShardTiers._reclaim_held`).

        Returns:
            The number of blocks (``int``) :meth:`_evict` can free now.
        """
        pool = self.pool
        held = self._reclaimable()
        pinned = pool.pinned_published()
        hb = self.host_base
        if hb is not None and self.unready:
            pinned += [b for b in self.unready if b >= hb]
        if not pinned:
            return pool.num_cached + held
        tree = self.tree
        above = tree.ancestors(pinned)
        return pool.num_cached + held - sum(1 for b in above if pool.owns(b) and pool.state(b) == CACHED)

    def _room_for_earmarks(self, num_blocks: int, out: StepOutcome) -> None:
        """Evict until ``num_blocks`` unreserved free blocks exist (:meth:`fork_room` found them); record it in ``out``."""
        pool = self.pool
        short = num_blocks - (pool.num_free - self.num_reserved)
        evicted = self._evict(short, frozenset(), out) if short > 0 else 0
        if num_blocks > pool.num_free - self.num_reserved:
            raise AssertionError(
                f"shard {self.shard_index}: fork earmarks of {num_blocks} blocks checked to fit, "
                f"but {pool.num_free - self.num_reserved} unreserved free after evicting {evicted}"
            )

    def room(self, seq_id: Hashable, num_tokens: int) -> tuple[int, int, int]:
        """Blocks ``seq_id`` needs to append ``num_tokens`` tokens, and the room there is for them (changes nothing).

        Args:
            seq_id: A live sequence.
            num_tokens: Tokens to append (>= 1).

        Returns:
            ``(need, free, evictable)``: new blocks plus a copy-on-write copy
            of a shared partial tail; free blocks this sequence may take (the
            unreserved ones plus its own earmark); cached blocks an eviction
            pass could take now (:meth:`evictable_now`). There is room when
            ``need <= free + evictable``.

        Raises:
            UnknownSequence: Not live.
            RequestTooLarge: The sequence would hold more blocks than the shard.
        """
        seq, pool, bs = self.get(seq_id), self.pool, self.block_size
        row = seq.row
        start = int(self.tables.num_tokens[row])
        total = -(-(start + num_tokens) // bs)
        if total > pool.num_blocks:
            raise RequestTooLarge(total, pool.num_blocks)
        tail = start % bs != 0 and pool.refcount(seq.block_ids.last()) > 1
        own = row_reserved(self.tables, row, bs) if self.num_reserved_seqs else 0
        evictable = self.evictable_now()
        return total - len(seq.block_ids) + tail, pool.num_free - self.num_reserved + own, evictable

    def _evict(self, num_blocks: int, protected, out: StepOutcome | None = None, held: bool = False) -> int:
        """Evict cached leaves in policy order; blocks the tree refuses go to the evict-last end.

        With a host tier (:mod:`akv.core.tiers`) a victim that is a device
        leaf is demoted to the host instead of dropped, as long as the host
        tier has (or can make) room; the others are dropped as without a tier.

        A cached block can stand above a block that is not evictable yet (a
        published block that a pending copy still pins): such blocks are
        skipped as ``protected`` ones are, keeping their place (refused and
        sent to the evict-last end, a whole chain of a long prompt would be
        taken and refused a batch at a time). The tree refuses any other
        non-leaf, which then waits at the evict-last end. The loop ends when
        every cached block was refused once since the last removal.

        Args:
            num_blocks: Blocks to evict at most.
            protected: Block ids to skip (a container: ``in`` and iteration).
            out: The step's outcome: its ``evicted_blocks``, ``demoted`` and
                ``removed_block_ids`` (the blocks removed from the prefix
                tree, in removal order) record the eviction.
            held: Demoted device blocks stay in flight until their copy has
                completed (background eviction) instead of being free at once.

        Returns:
            The number of blocks evicted (free now, or in flight to the host when ``held``).
        """
        pool, tree = self.pool, self.tree
        protected = self._skipped(protected)
        demote = self.host is not None
        evicted = 0
        untried = pool.num_cached
        while evicted < num_blocks and untried > 0:
            victims = pool.evict_begin(min(num_blocks - evicted, untried), protected)
            if not victims:
                break
            untried -= len(victims)
            moved = 0
            if demote:
                moved, victims = self._demote(victims, protected, out, held)
            removed, refused = tree.remove_leaves(victims) if victims else ([], [])
            pool.evict_finish(removed)
            evicted += moved + len(removed)
            if out is not None:
                out.removed_block_ids.extend(removed)
            if removed and self.unready:  # a promoted block whose copy is pending can be released and evicted
                self.unready.difference_update(removed)
            if refused:
                pool.evict_abort(refused, to_mru=True)
                self.counters.eviction_refusals += len(refused)
            if removed or moved:  # a removal can turn a refused parent into a leaf: try everything again
                untried = pool.num_cached
        if evicted < num_blocks and not held and self._transfers:
            self._reclaim_held(num_blocks - evicted)  # free now; counted as evicted when they were demoted
        if evicted:
            self.counters.blocks_evicted += evicted
            self.counters.eviction_batches += 1
            if out is not None:
                out.evicted_blocks += evicted
        return evicted
