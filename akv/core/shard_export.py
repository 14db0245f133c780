"""Export and import of a shard's prefix cache for snapshots (part of :class:`~akv.core.shard_state.ShardState`).

Export takes, at a message boundary, every published full block of the shard
(cached and active) in topological order, with what
:class:`~akv.storage.snapshot_record.SnapshotBlocks` records but the content
keys (the caller chains them from the tokens outside the actor: hashing is
most of the cost): parents, namespaces (the tree's namespace key without the
shard index), token ids and eviction statistics. ``last_release``
is the block's rank in the pool's eviction order (0 is evicted first); active
blocks rank after every cached one, deeper blocks first, so that they count
as the most recently used and a parent is never colder than its child.

While a save copies K/V out, the exported blocks are *held*: eviction skips
them (they keep their place in the eviction order, unlike a reference) and
the room checks do not count them, so no held block is evicted or reused
before :meth:`ShardExports.release_hold`. Published full blocks are
immutable, so a held block's K/V can be read at any time.

Import is two-phase so that K/V are written before a block can be matched:
:meth:`ShardExports.import_reserve` allocates blocks and writes their token
ids; they stay in flight (a copy pin, no reference, not in the tree) while
the caller writes their K/V; :meth:`ShardExports.import_publish` inserts the
chains into the tree, marks them published, sets their hit counts and
releases the pins coldest first, so the eviction order is the saved one.
:meth:`ShardExports.import_abort` releases them to the free queue instead.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from akv.core.block_pool import CACHED
from akv.errors import InvalidInput


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardExport:
    """The published blocks of one shard, as record columns (``n`` rows, topological order).

    Attributes:
        namespaces: ``n`` namespaces (plain values or ``None``; no shard index).
        parent: ``(n,)`` int64 row of each parent, ``-1`` for a first block.
        tokens: ``(n, block_size)`` int32 token ids.
        num_hits: ``(n,)`` int64 prefix hits.
        last_release: ``(n,)`` int64 rank in the eviction order (0: evicted first).
        block_ids: ``(n,)`` int64 block id of each row (where to read its K/V).
    """

    namespaces: list
    parent: np.ndarray
    tokens: np.ndarray
    num_hits: np.ndarray
    last_release: np.ndarray
    block_ids: np.ndarray


class ShardExports:
    """Snapshot export, holds and import; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes).

    It comes before :class:`~akv.core.room.ShardRoom` in the bases: its
    ``_evict``, ``_evictable`` and ``evictable_now`` skip held blocks.
    """

    __slots__ = ()

    #: Block ids a snapshot save is copying out (empty: no save running).
    snapshot_hold: frozenset[int] | set[int] = frozenset()

    # ------------------------------------------------------------- export
    def export_snapshot(self, *, hold: bool) -> ShardExport:
        """Every published block of the shard, parents first; O(blocks), about 0.3 µs a block.

        Args:
            hold: Hold the exported blocks until :meth:`release_hold` (a save
                that copies their K/V out).

        Raises:
            InvalidInput: A save is already holding this shard's blocks.
        """
        if hold and self.snapshot_hold:
            raise InvalidInput(f"shard {self.shard_index}: a snapshot save is already running")
        base, bs = self.pool.first_block_id, self.block_size
        last_row: dict[int, int] = {}  # the last block of each run -> its row (runs hang below a run's last block)
        namespaces: list = []
        parents: list[int] = []
        ids: list[int] = []
        for (_, namespace), parent, blocks in self.tree.runs():
            first = len(ids)
            parents.append(-1 if parent is None else last_row[parent])
            parents.extend(range(first, first + len(blocks) - 1))
            last_row[blocks[-1]] = first + len(blocks) - 1
            namespaces.extend([namespace] * len(blocks))
            ids.extend(blocks)
        block_ids = np.array(ids, dtype=np.int64)
        if hold:
            self.snapshot_hold = set(ids)
        n = len(ids)
        return ShardExport(
            namespaces=namespaces,
            parent=np.array(parents, dtype=np.int64),
            tokens=self.block_tokens[block_ids - base].reshape(n, bs).copy(),
            num_hits=self.pool.hit_counts(block_ids),
            last_release=self._release_ranks(block_ids),
            block_ids=block_ids,
        )

    def _release_ranks(self, block_ids: np.ndarray) -> np.ndarray:
        """Rank of each row: cached blocks in eviction order, then the others, later rows (deeper) first."""
        base, n = self.pool.first_block_id, block_ids.size
        row_at = np.full(self.pool.num_blocks, -1, dtype=np.int64)
        row_at[block_ids - base] = np.arange(n, dtype=np.int64)
        order = row_at[np.array(self.pool.eviction_order(), dtype=np.int64) - base]
        order = order[order >= 0]
        rank = np.full(n, -1, dtype=np.int64)
        rank[order] = np.arange(order.size, dtype=np.int64)
        rest = np.flatnonzero(rank < 0)[::-1]
        rank[rest] = np.arange(order.size, n, dtype=np.int64)
        return rank

    def release_hold(self, block_ids: list[int] | None = None) -> None:
        """Stop holding ``block_ids`` (their K/V are copied out), or every held block for ``None``."""
        if block_ids is None or not self.snapshot_hold:
            self.snapshot_hold = frozenset()
            return
        self.snapshot_hold.difference_update(block_ids)
        if not self.snapshot_hold:
            self.snapshot_hold = frozenset()

    # -------------------------------------------------- eviction with holds
    def _evict(self, num_blocks: int, protected, out=None, held: bool = False) -> int:
        hold = self.snapshot_hold
        if hold:
            protected = hold.union(protected)
        return super()._evict(num_blocks, protected, out, held)

    def _evictable(self, protected: dict[int, int]) -> int:
        hold = self.snapshot_hold
        if not hold:
            return super()._evictable(protected)
        return self.pool.num_cached - self.pool.num_cached_among(hold.union(protected))

    def evictable_now(self) -> int:
        """As :meth:`ShardRoom.evictable_now`, less the held cached blocks (and, being ancestor-closed, all above them)."""
        hold = self.snapshot_hold
        if not hold:
            return super().evictable_now()
        state = self.pool.state
        return max(0, super().evictable_now() - sum(1 for b in hold if state(b) == CACHED))

    # ------------------------------------------------------------- import
    def import_reserve(self, tokens: np.ndarray) -> list[int]:
        """Allocate one block per row of ``tokens`` and write its token ids; nothing is matchable yet.

        Args:
            tokens: ``(m, block_size)`` int32 token ids of the blocks to load.

        Returns:
            The ``m`` block ids, row order.

        Raises:
            InvalidInput: The shard has live sequences, a save holds its
                blocks, or fewer than ``m`` free blocks (nothing allocated).
        """
        m = int(tokens.shape[0])
        if self.sequences or self.snapshot_hold:
            raise InvalidInput(f"shard {self.shard_index} has live sequences or a save running: cannot load")
        if m > self.pool.num_free - self.num_reserved:
            raise InvalidInput(f"shard {self.shard_index}: {m} blocks to load, {self.pool.num_free} free")
        ids = self.pool.allocate(m)
        self.counters.blocks_allocated += m
        if m:
            self.block_tokens[np.array(ids, dtype=np.intp) - self.pool.first_block_id] = tokens
        self.pool.pin_for_copy(ids)  # in flight while their K/V are written: neither free nor matchable
        self.pool.decref(ids, distinct=True)
        return ids

    def import_abort(self, block_ids: list[int]) -> None:
        """Free blocks :meth:`import_reserve` allocated (a load that failed before publishing)."""
        self.pool.unpin_copied(block_ids)

    def import_publish(
        self,
        block_ids: list[int],
        parent: np.ndarray,
        namespaces: list[Hashable],
        num_hits: np.ndarray,
        last_release: np.ndarray,
    ) -> int:
        """Publish reserved blocks as cached prefix-cache blocks in the saved eviction order.

        A block whose chain is already cached here (loaded twice, or cached
        before the load) stays private and is freed; its children hang below
        the cached one.

        Args:
            block_ids: From :meth:`import_reserve`, one per row.
            parent: ``(m,)`` int64 parent rows (``-1``: a first block), topological.
            namespaces: ``m`` namespaces (no shard index).
            num_hits: ``(m,)`` int64 prefix hits.
            last_release: ``(m,)`` int64 release ranks (smaller: evicted first).

        Returns:
            Blocks now in the tree as loaded (the others were duplicates).
        """
        tree, base, w = self.tree, self.pool.first_block_id, 4 * self.block_size
        raw = self.block_tokens.astype("<i4", copy=False)
        placed: list[int] = []  # the block in the tree standing for each row
        published: list[int] = []
        for row, b in enumerate(block_ids):
            up = int(parent[row])
            ns_key = self.namespace_key(namespaces[row])
            tokens = raw[b - base].tobytes()
            below = None if up < 0 else placed[up]
            if tree.insert(ns_key, below, tokens, [b]) == 1:
                placed.append(b)
                published.append(row)
                continue
            found = tree.match(ns_key, tokens, below=below)
            placed.append(found[0] if len(found) == 1 and len(tokens) == w else b)
        rows = np.array(published, dtype=np.int64)
        kept = [block_ids[r] for r in published]
        self.pool.mark_published(kept)
        self.pool.set_num_hits(kept, num_hits[rows].tolist() if rows.size else [])
        order = rows[np.argsort(last_release[rows], kind="stable")] if rows.size else rows
        dropped = sorted(set(block_ids) - set(kept))
        self.pool.unpin_copied([block_ids[r] for r in order.tolist()])  # each release takes the next place
        self.pool.unpin_copied(dropped)
        return len(kept)
