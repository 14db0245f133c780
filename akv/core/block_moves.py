"""Block transitions of a :class:`~akv.core.block_pool.BlockPool` for moves between tiers.

A block leaving the device for the host tier, or taking a host slot, skips
the states an ordinary release or allocation passes through: an evicted
device block whose demotion copy still reads it stays in flight
(:meth:`BlockMoves.evict_hold`), a host block evicted for room is taken again
at once (:meth:`BlockMoves.evict_reuse`), and a demotion's new host block is
published and cached (copies done at once, :meth:`BlockMoves.cache_allocated`)
or published and in flight until its copy ran
(:meth:`BlockMoves.publish_in_flight`). Each is one vectorized pass where the
ordinary path takes several calls.
"""

from __future__ import annotations

import numpy as np

from akv.core.block_refs import ACTIVE, IN_FLIGHT, STATE_NAMES


class BlockMoves:
    """Tier-move transitions; a mixin of :class:`~akv.core.block_pool.BlockPool` (uses its slots and :class:`~akv.core.block_refs.BlockRefs`)."""

    __slots__ = ()

    def evict_hold(self, block_ids: list[int]) -> None:
        """Blocks taken by :meth:`evict_begin` left the prefix cache but a pending copy still reads them.

        They stay in flight, unpublished and pinned (:meth:`pin_for_copy`),
        and become free at :meth:`unpin_copied` (or cached again if they are
        published again before it: a failed demotion put back).

        Raises:
            ValueError: A block is not being evicted (nothing is applied then).
        """
        if not block_ids:
            return
        idx = np.array(block_ids, dtype=np.intp) - self.first_block_id
        s = self._state[idx]
        if (s != IN_FLIGHT).any() or self._pins[idx].any():
            b = block_ids[int(np.argmax(s != IN_FLIGHT))]
            raise ValueError(f"evict_hold of block {b} in state {STATE_NAMES[self.state(b)]} or already pinned")
        self._published[idx] = False
        self.pin_for_copy(block_ids)

    def evict_reuse(self, block_ids: list[int]) -> None:
        """Blocks taken by :meth:`evict_begin` left the prefix cache and are taken again at once, as :meth:`allocate` takes them.

        Each is referenced once (refcount 1), unpublished, its hit count
        reset, without passing through the free queue: one pass where
        :meth:`evict_finish` and :meth:`allocate` take two. The caller checked
        they are in flight (taken by ``evict_begin`` and removed).
        """
        if not block_ids:
            return
        idx = np.array(block_ids, dtype=np.intp) - self.first_block_id
        self._published[idx] = False
        self._state[idx] = ACTIVE
        self._refcount[idx] = 1
        if self._keyed is not None:
            self._keyed.reset(idx)
        k = len(block_ids)
        self._counts[IN_FLIGHT] -= k
        self._counts[ACTIVE] += k
        self.total_refs += k

    def cache_allocated(self, block_ids: list[int], num_hits: np.ndarray | None = None) -> None:
        """Allocated blocks (refcount 1, held by no table) enter the prefix cache at once, in order.

        :meth:`mark_published`, the hit counts and :meth:`decref` in one pass
        (a demotion's new host blocks).

        Args:
            block_ids: Distinct blocks from :meth:`allocate` or :meth:`evict_reuse`.
            num_hits: int ``(len(block_ids),)`` hit counts to give them, or None.
        """
        if not block_ids:
            return
        off = np.array(block_ids, dtype=np.intp) - self.first_block_id
        self._published[off] = True
        if num_hits is not None and self._keyed is not None:
            self._keyed.hits[off] = num_hits
        self._refcount[off] = 0
        self.total_refs -= len(block_ids)
        self._release_many(off.tolist())

    def publish_in_flight(self, block_ids: list[int], num_hits: np.ndarray | None = None) -> np.ndarray:
        """Allocated blocks (refcount 1, held by no table) become published copy destinations, in flight.

        :meth:`mark_published`, the hit counts, :meth:`pin_for_copy` and
        :meth:`decref` in one pass (a demotion's new host blocks, until their
        copy ran): each is pinned once, unreferenced and in flight; the copy's
        :meth:`unpin_copied` puts it in the eviction order.

        Args:
            block_ids: Distinct blocks from :meth:`allocate` or :meth:`evict_reuse`.
            num_hits: int ``(len(block_ids),)`` hit counts to give them, or None.

        Returns:
            Their offsets in this pool (intp), for the caller's own arrays.

        Raises:
            ValueError: A block is not referenced exactly once (nothing is applied then).
        """
        off = np.array(block_ids, dtype=np.intp) - self.first_block_id
        if not len(off):
            return off
        if (self._refcount[off] != 1).any():
            b = block_ids[int(np.argmax(self._refcount[off] != 1))]
            raise ValueError(f"publish_in_flight of block {b} with refcount {self.refcount(b)}, not 1")
        self._published[off] = True
        if num_hits is not None and self._keyed is not None:
            self._keyed.hits[off] = num_hits
        self._pins[off] += 1
        self._refcount[off] = 0
        self._state[off] = IN_FLIGHT
        k = len(off)
        self.total_pins += k
        self.total_refs -= k
        self._counts[ACTIVE] -= k
        self._counts[IN_FLIGHT] += k
        return off
