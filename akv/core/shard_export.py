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
        block_ids: ``(n,)`` int64 block id of each row (where to read its K/V):
            a device block, or a host-tier id (``>= host_base``) for a block
            on the host tier.
        on_host: ``(n,)`` bool: the row's block is on the host tier.
    """

    namespaces: list
    parent: np.ndarray
    tokens: np.ndarray
    num_hits: np.ndarray
    last_release: np.ndarray
    block_ids: np.ndarray
    on_host: np.ndarray


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
        bs = self.block_size
        last_row: dict[int, int] = {}  # the last block of each run -> its row (runs hang below a run's last block)
        namespaces: list = []
        parents: list[int] = []
        ids: list[int] = []
        chunks: list[bytes] = []
        for (_, namespace), parent, blocks, raw in self.tree.runs(tokens=True):
            first = len(ids)
            parents.append(-1 if parent is None else last_row[parent])
            parents.extend(range(first, first + len(blocks) - 1))
            last_row[blocks[-1]] = first + len(blocks) - 1
            namespaces.extend([namespace] * len(blocks))
            ids.extend(blocks)
            chunks.append(raw)
        block_ids = np.array(ids, dtype=np.int64)
        if hold:
            self.snapshot_hold = set(ids)
        n = len(ids)
        on_host = block_ids >= self.host_base if self.host_base is not None else np.zeros(n, dtype=bool)
        hits = np.zeros(n, dtype=np.int64)
        hits[~on_host] = self.pool.hit_counts(block_ids[~on_host])
        if on_host.any():
            hits[on_host] = self.host.hit_counts(block_ids[on_host])
        return ShardExport(
            namespaces=namespaces,
            parent=np.array(parents, dtype=np.int64),
            tokens=np.frombuffer(b"".join(chunks), dtype="<i4").reshape(n, bs).astype(np.int32),
            num_hits=hits,
            last_release=self._release_ranks(block_ids),
            block_ids=block_ids,
            on_host=on_host,
        )

    def _release_ranks(self, block_ids: np.ndarray) -> np.ndarray:
        """Rank of each row: host-tier cached blocks in their order, device cached blocks in theirs, then the others, later rows (deeper) first."""
        n = block_ids.size
        pools = [self.pool] if self.host is None else [self.host, self.pool]  # demoted blocks are the coldest
        order = np.concatenate([_rows_in_order(pool, block_ids) for pool in pools])
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

    def _evictable(self, protected) -> int:
        hold = self.snapshot_hold
        return super()._evictable(hold.union(protected) if hold else protected)

    def evictable_now(self) -> int:
        """As :meth:`ShardRoom.evictable_now`, less the held cached blocks (and, being ancestor-closed, all above them)."""
        hold = self.snapshot_hold
        if not hold:
            return super().evictable_now()
        state = self.pool.state
        return max(0, super().evictable_now() - sum(1 for b in hold if state(b) == CACHED))

    # ------------------------------------------------------------- import
    def import_reserve(self, tokens: np.ndarray, on_host: np.ndarray | None = None) -> list[int]:
        """Allocate one block per row of ``tokens`` and write its token ids; nothing is matchable yet.

        Args:
            tokens: ``(m, block_size)`` int32 token ids of the blocks to load.
            on_host: ``(m,)`` bool: the rows to load into the host tier
                (default: none).

        Returns:
            The ``m`` block ids, row order (host-tier ids for ``on_host`` rows).

        Raises:
            InvalidInput: The shard has live sequences, a save holds its
                blocks, fewer free blocks than rows on either tier, or rows
                for a host tier the shard does not have (nothing allocated).
        """
        m = int(tokens.shape[0])
        on_host = np.zeros(m, dtype=bool) if on_host is None else np.asarray(on_host, dtype=bool)
        num_host = int(on_host.sum())
        if self.sequences or self.snapshot_hold:
            raise InvalidInput(f"shard {self.shard_index} has live sequences or a save running: cannot load")
        if m - num_host > self.pool.num_free - self.num_reserved:
            raise InvalidInput(f"shard {self.shard_index}: {m - num_host} blocks to load, {self.pool.num_free} free")
        if num_host and (self.host is None or num_host > self.host.num_free):
            free = 0 if self.host is None else self.host.num_free
            raise InvalidInput(f"shard {self.shard_index}: {num_host} blocks to load on the host tier, {free} free")
        dev = self.pool.allocate(m - num_host)
        self.counters.blocks_allocated += m - num_host
        if dev:
            self.block_tokens[np.array(dev, dtype=np.intp) - self.pool.first_block_id] = tokens[~on_host]
        host = self.host.allocate(num_host) if num_host else []
        for pool, blocks in ((self.pool, dev), (self.host, host)):
            if blocks:
                pool.pin_for_copy(blocks)  # in flight while their K/V are written: neither free nor matchable
                pool.decref(blocks, distinct=True)
        ids = np.empty(m, dtype=np.int64)
        ids[~on_host] = dev
        ids[on_host] = host
        return ids.tolist()

    def import_abort(self, block_ids: list[int]) -> None:
        """Free blocks :meth:`import_reserve` allocated (a load that failed before publishing)."""
        dev, host = self._by_tier(block_ids)
        self.pool.unpin_copied(dev)
        if host:
            self.host.unpin_copied(host)

    def _by_tier(self, block_ids: list[int]) -> tuple[list[int], list[int]]:
        """``block_ids`` split into device blocks and host-tier ids, order kept."""
        hb = self.host_base
        if hb is None:
            return block_ids, []
        return [b for b in block_ids if b < hb], [b for b in block_ids if b >= hb]

    def import_publish(
        self,
        block_ids: list[int],
        parent: np.ndarray,
        namespaces: list[Hashable],
        num_hits: np.ndarray,
        last_release: np.ndarray,
        tokens: np.ndarray,
    ) -> int:
        """Publish reserved blocks as cached prefix-cache blocks in the saved eviction order.

        A block whose chain is already cached here (loaded twice, or cached
        before the load) stays private and is freed; its children hang below
        the cached one. A device block whose parent is cached on the host
        tier is freed with its subtree (device blocks stay ancestor-closed).

        Args:
            block_ids: From :meth:`import_reserve`, one per row.
            parent: ``(m,)`` int64 parent rows (``-1``: a first block), topological.
            namespaces: ``m`` namespaces (no shard index).
            num_hits: ``(m,)`` int64 prefix hits.
            last_release: ``(m,)`` int64 release ranks (smaller: evicted first).
            tokens: ``(m, block_size)`` int32 token ids.

        Returns:
            Blocks now in the tree as loaded (the others were duplicates).
        """
        tree, w, hb = self.tree, 4 * self.block_size, self.host_base
        raw = np.ascontiguousarray(tokens, dtype="<i4")
        placed: list[int] = []  # the block in the tree standing for each row
        published: list[int] = []
        for row, b in enumerate(block_ids):
            up = int(parent[row])
            ns_key = self.namespace_key(namespaces[row])
            chunk = raw[row].tobytes()
            below = None if up < 0 else placed[up]
            below_host = hb is not None and below is not None and below >= hb
            if not (below_host and b < hb) and tree.insert(ns_key, below, chunk, [b]) == 1:
                placed.append(b)
                published.append(row)
                continue
            found = tree.match(ns_key, chunk, below=below)
            placed.append(found[0] if len(found) == 1 and len(chunk) == w else b)
        ids = np.array(block_ids, dtype=np.int64)
        on_host = ids >= hb if hb is not None else np.zeros(len(ids), dtype=bool)
        kept = np.zeros(len(ids), dtype=bool)
        kept[published] = True
        for pool, mine in ((self.pool, ~on_host), (self.host, on_host)):
            rows = np.flatnonzero(mine & kept)
            if rows.size:
                pool.mark_published(ids[rows].tolist())
                pool.set_num_hits(ids[rows].tolist(), num_hits[rows].tolist())
                # each release takes the next place in its tier's eviction order: the saved order
                pool.unpin_copied(ids[rows[np.argsort(last_release[rows], kind="stable")]].tolist())
            if (mine & ~kept).any():
                pool.unpin_copied(ids[mine & ~kept].tolist())
        return len(published)


def _rows_in_order(pool, block_ids: np.ndarray) -> np.ndarray:
    """The rows of ``block_ids`` that are cached in ``pool``, in its eviction order: int64 ``(k,)``."""
    base = pool.first_block_id
    row_at = np.full(pool.num_blocks, -1, dtype=np.int64)
    mine = (block_ids >= base) & (block_ids < base + pool.num_blocks)
    row_at[block_ids[mine] - base] = np.flatnonzero(mine)
    order = row_at[np.array(pool.eviction_order(), dtype=np.int64) - base]
    return order[order >= 0]
