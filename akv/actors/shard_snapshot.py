"""What a pool shard actor publishes: one immutable snapshot of its counts after every message.

Readers outside the shard's actor (the manager's gauges and ``stats``, the
eviction loop, the Prometheus scrape thread, the shard map's placement) never
read the shard's :class:`~akv.core.shard_state.ShardState`; they read
:attr:`PoolShardActor.snapshot <akv.actors.pool_shard.PoolShardActor.snapshot>`,
a :class:`ShardSnapshot` that the actor replaces after every message it serves
by one attribute assignment. A tuple is immutable and the assignment is atomic
(one ``STORE_ATTR``), so a reader on another thread sees either the previous
snapshot or the next one, never a mix of the two, and a reader on the event
loop sees the counts as of the shard's last message.

Only what readers need is published: pool counts by state, reservations, the
counters of :class:`~akv.core.shard_state.ShardCounters` (ints, read in one
``operator.attrgetter`` call), and a few sizes. Building one costs about 1 us
(a ``NamedTuple``: a frozen dataclass costs 3 us for the same fields).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from akv.core.shard_state import ShardCounters, ShardState

__all__ = ["COUNTER_NAMES", "ShardSnapshot", "take_snapshot"]

#: Names of :attr:`ShardSnapshot.counters`, in order (the fields of ``ShardCounters``).
COUNTER_NAMES: tuple[str, ...] = tuple(ShardCounters.__slots__)
_read_counters = operator.attrgetter(*COUNTER_NAMES)


class ShardSnapshot(NamedTuple):
    """Counts of one pool shard after the last message it served (units: blocks unless named otherwise).

    Attributes:
        shard: The shard's index.
        num_blocks: Usable blocks of the shard.
        free: Free blocks (reserved ones included).
        active: Blocks some block table references.
        cached: Blocks only the prefix cache holds (evictable).
        in_flight: Blocks a pending copy pins.
        reserved: Free blocks earmarked by reservations.
        num_sequences: Live sequences.
        prefix_cache_blocks: Blocks in the shard's prefix tree.
        blocks_freed: Blocks returned to the free queue since start.
        pinned_copies: Copy batches whose pins the shard has not released yet
            (``KVCacheManager.wait_copies`` settles those shards).
        version: Snapshots the shard published before this one (0: the
            one made at start); one is published after every message.
        counters: The values of :class:`~akv.core.shard_state.ShardCounters`,
            in the order of :data:`COUNTER_NAMES`.
        host: The host tier's blocks by state, ``(free, cached, swapped,
            in_flight)`` (swapped: held by swapped-out sequences); all 0
            without a host tier (:mod:`akv.core.tiers`).
        demoting: Device blocks in flight until a pending copy to the host
            has completed (free after it): the eviction loop counts them as
            free already.
        num_swapped: Sequences swapped out to the host tier.
    """

    shard: int
    num_blocks: int
    free: int
    active: int
    cached: int
    in_flight: int
    reserved: int
    num_sequences: int
    prefix_cache_blocks: int
    blocks_freed: int
    pinned_copies: int
    version: int
    counters: tuple[int, ...]
    host: tuple[int, int, int, int] = (0, 0, 0, 0)
    demoting: int = 0
    num_swapped: int = 0

    @property
    def num_free(self) -> int:
        """Free blocks no reservation holds (what an admission or the eviction loop may count on)."""
        return self.free - self.reserved

    @property
    def free_fraction(self) -> float:
        """Free blocks over the shard's blocks (0.0-1.0; reserved ones count as free)."""
        return self.free / self.num_blocks

    @property
    def blocks_in_use(self) -> int:
        """Referenced (active) plus in-flight blocks."""
        return self.active + self.in_flight

    @property
    def blocks_available(self) -> int:
        """Unreserved free plus evictable (cached) blocks."""
        return self.free - self.reserved + self.cached

    def counter_values(self) -> ShardCounters:
        """The counters as a new :class:`~akv.core.shard_state.ShardCounters` (named fields)."""
        return ShardCounters(**dict(zip(COUNTER_NAMES, self.counters, strict=True)))


def take_snapshot(state: ShardState, *, pinned_copies: int, version: int) -> ShardSnapshot:
    """A :class:`ShardSnapshot` of ``state`` now (O(1); call it on the shard's own task).

    Args:
        state: The shard's core state.
        pinned_copies: Copy batches whose pins are not released yet.
        version: Snapshots published before this one.

    Returns:
        The snapshot.
    """
    pool, host = state.pool, state.host
    return ShardSnapshot(
        state.shard_index,
        pool.num_blocks,
        pool.num_free,
        pool.num_active,
        pool.num_cached,
        pool.num_in_flight,
        state.num_reserved,
        len(state.sequences),
        len(state.tree),
        pool.blocks_freed,
        pinned_copies,
        version,
        _read_counters(state.counters),
        _NO_HOST if host is None else (host.num_free, host.num_cached, host.num_active, host.num_in_flight),
        state.num_device_pinned if state._transfers else 0,
        len(state.swapped),
    )


_NO_HOST = (0, 0, 0, 0)
