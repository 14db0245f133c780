"""Eviction loop: a control loop that keeps every shard's free blocks above its low watermark.

The shards publish a snapshot after every message
(:class:`~akv.actors.shard_snapshot.ShardSnapshot`; the loop reads its
unreserved free blocks: those that reservations earmark are taken, see
:mod:`akv.core.reservation`) and set a wake-up event when they drop below
the low watermark; the loop reads nothing else of a shard. The loop then asks that shard to
evict cached leaves (first in the eviction policy's order) in batches of
``eviction_batch_blocks`` until its free blocks reach the high watermark or
nothing is left to evict, logging one ``eviction.batch`` line per batch. A
shard with a host tier gets its whole deficit in one batch: its evictions are
demotions, and each batch is then one copy batch (one pipe write, ticket and
settlement). Both
watermarks are fractions of the shard, the high one capped in blocks
(:meth:`~akv.config.KVCacheConfig.watermark_blocks`).
It asks only the shards (which ask nobody), so no ask cycle exists.

Eviction here is pressure relief, not an error path: an allocation that finds
too few free blocks also evicts on demand inside its shard. The same
:class:`~akv.actors.messages.Evict` message serves ``KVCacheManager.evict``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from akv.actors.messages import Evict
from akv.actors.pool_shard import PoolShardActor
from akv.errors import AkvError
from akv.obs.tracing import AkvTracer


@dataclass(kw_only=True, slots=True)
class EvictionStats:
    """Counters of the eviction loop (units: blocks, batches, wake-ups, seconds)."""

    wakeups: int = 0
    batches: int = 0
    blocks: int = 0
    busy_s: float = 0.0


class EvictionLoop:
    """Background evictor for a set of shards.

    Args:
        shards: The pool shard actors; each carries its watermarks in free
            blocks (``low_free_blocks``, ``high_free_blocks``).
        batch_blocks: Blocks per eviction batch.
        logger: structlog logger.
        batch_seconds: Histogram (``observe(seconds)``) of each batch's wall time.
        tracer: :class:`~akv.obs.tracing.AkvTracer` (default: the global provider's).
    """

    def __init__(
        self,
        shards: list[PoolShardActor],
        *,
        batch_blocks: int,
        logger: Any = None,
        batch_seconds: Any = None,
        tracer: Any = None,
    ) -> None:
        self.shards = shards
        self.batch_blocks = batch_blocks
        self.log = (logger or structlog.get_logger("akv")).bind(actor="eviction_loop")
        self.stats = EvictionStats()
        self.batch_seconds = batch_seconds
        self.tracer = tracer or AkvTracer()
        self._wake = anyio.Event()
        self._stopping = False

    def wake(self) -> None:
        """Ask for a pass soon (non-blocking; safe to call from any actor on the loop)."""
        self._wake.set()

    def stop(self) -> None:
        """End the loop after the current batch."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        """Serve wake-ups until :meth:`stop`."""
        event_type = type(self._wake)  # the backend's own Event: anyio.Event() looks the backend up per call
        while not self._stopping:
            await self._wake.wait()
            self._wake = event_type()
            if self._stopping:
                break
            self.stats.wakeups += 1
            for shard in self.shards:
                await self._relieve(shard)

    async def _relieve(self, shard: PoolShardActor) -> None:
        high = shard.high_free_blocks
        # Blocks being demoted to a host tier are free once their copy completed: count them as free already.
        while not self._stopping and (free := shard.snapshot.num_free + shard.snapshot.demoting) < high:
            # With a host tier each batch is a copy batch (a ticket, a settlement, a pipe write):
            # the whole deficit goes in one, however small batch_blocks is.
            want = high - free if shard.demotes else min(self.batch_blocks, high - free)
            before = 1.0 - shard.snapshot.free_fraction
            with self.tracer.span("akv.evict_batch") as span:
                t0 = time.perf_counter()
                try:
                    evicted = await shard.ask(Evict(want))
                except AkvError:
                    # The shard is stopping (e.g. closed during the ask's checkpoint); the manager reports why.
                    if span.is_recording():
                        span.set_attributes({"akv.shard": shard.index, "akv.blocks_requested": want, "akv.blocks": 0})
                    return
                elapsed = time.perf_counter() - t0
                if span.is_recording():
                    span.set_attributes(
                        {
                            "akv.shard": shard.index,
                            "akv.blocks_requested": want,
                            "akv.blocks": evicted,
                            "akv.usage_before": before,
                            "akv.usage_after": 1.0 - shard.snapshot.free_fraction,
                        }
                    )
            if not evicted:
                return
            self.stats.batches += 1
            self.stats.blocks += evicted
            self.stats.busy_s += elapsed
            if self.batch_seconds is not None:
                self.batch_seconds.observe(elapsed)
            self.log.info(
                "eviction.batch",
                shard=shard.index,
                blocks=evicted,
                usage_before=round(before, 4),
                usage_after=round(1.0 - shard.snapshot.free_fraction, 4),
                elapsed_s=round(elapsed, 6),
            )
