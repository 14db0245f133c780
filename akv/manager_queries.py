"""ManagerQueries: the read side of :class:`~akv.manager.KVCacheManager` (a mixin).

It holds the calls that change no sequence: ``lookup``, ``sequence``,
``block_info``, ``stats``, ``check``, ``wait_copies``, the audit view
``block_refcounts``, the gauges (``usage``, ``blocks_in_use``,
``blocks_available``, ``inbox_depths``, ``null_block_id``) and the
``metrics_registry``; and ``evict``, which frees only cached blocks no
sequence holds. It relies on the manager's ``config``, ``storage``,
``_shards``, ``_actors``, ``_shard_map``, ``_sharded_lock``, ``_tickets``,
``_eviction``, ``_metrics``, ``_check_running`` and ``_ask``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from akv.actors.messages import Check, Evict, Inspect, InspectBlock, Lookup, PendingCopies, Stats
from akv.actors.shard_snapshot import ShardSnapshot
from akv.actors.shard_views import SequenceInfo
from akv.core.ids import NUMPY_INTEGER_TYPES, describe, plain_id
from akv.core.tokens import as_token_array
from akv.errors import InvalidInput
from akv.manager_results import cache_stats
from akv.results import BlockInfo, CacheStats

__all__ = ["ManagerQueries"]


class ManagerQueries:
    """Queries, gauges and ``evict`` of :class:`~akv.manager.KVCacheManager` (see the module docstring)."""

    @property
    def metrics_registry(self) -> Any:
        """This manager's own ``prometheus_client.CollectorRegistry`` (see docs/metrics.md).

        Counters and block gauges are read from the shards at scrape time, so
        they equal :meth:`stats` at any quiescent point; they stay readable
        after exit (final values).
        """
        return self._metrics.registry

    async def lookup(self, prompt: Any, *, namespace: Hashable = None) -> int:
        """Prompt tokens that would be served from the cache right now; no side effects.

        For cache-aware routers: touches neither recency nor refcounts. With
        ``num_shards > 1`` it asks the shard an admission of this prompt
        would be placed on now (prefix-affine, :mod:`akv.core.shard_map`), so
        it predicts what ``add_sequence`` gets unless the pool changes in
        between; an admission with ``max_new_tokens`` may spill to another
        shard (its reservation does not fit the affine one), and then get fewer.

        Args:
            prompt: Token ids, as for :meth:`add_sequence`.
            namespace: As for :meth:`add_sequence`: ``None`` or a plain value
                (:mod:`akv.core.ids`); only blocks cached under an equal
                namespace count.

        Raises:
            InvalidInput: ``namespace`` is not a plain value.
            InvalidTokens: Bad prompt.
        """
        self._check_running()
        namespace = plain_id(namespace, "namespace of lookup()", allow_none=True)
        arr = as_token_array(prompt, self.config.vocab_size, what="prompt")
        bs = self.config.block_size
        if len(self._shards) == 1:
            return await self._ask(self._shards[0], Lookup(namespace, arr)) * bs
        if len(arr) <= bs:  # no block of it can be served from the cache
            return 0
        snaps = [s.snapshot for s in self._shards]
        shard = self._shard_map.place(
            namespace,
            arr,
            -(-len(arr) // bs),
            [x.num_free / x.num_blocks for x in snaps],
            [x.blocks_available for x in snaps],
        )
        return await self._ask(self._shards[shard], Lookup(namespace, arr)) * bs

    async def sequence(self, seq_id: Hashable) -> SequenceInfo:
        """Snapshot of one sequence (tokens, block table, counts).

        Raises:
            UnknownSequence: Not live.
            InvalidInput: ``seq_id`` is not a plain value (:mod:`akv.core.ids`).
        """
        self._check_running()
        seq_id = plain_id(seq_id, "seq_id of sequence()")
        if len(self._shards) == 1:
            return await self._ask(self._shards[0], Inspect(seq_id))
        return await self._ask(self._shards[self._shard_map.owner(seq_id)], Inspect(seq_id))

    async def evict(self, max_blocks: int) -> int:
        """Evict up to ``max_blocks`` cached blocks now; return how many were evicted.

        The path the background eviction loop takes (an ``Evict`` message to a
        shard): only cached leaves of the prefix cache, deepest first, in the
        eviction policy's order within a shard; never a block a sequence
        references or a pending copy pins. An admission's prefix hits are
        protected inside the shard's step, which is atomic, so no message runs
        between its match and its pin. Each shard's policy clock is its own:
        with several shards they are asked in index order, each for what is
        still wanted. Evicted blocks are free at once.

        Args:
            max_blocks: Most blocks to evict (an ``int >= 0``; 0 evicts nothing).

        Returns:
            Blocks evicted (``<= max_blocks``; fewer when fewer are evictable).

        Raises:
            InvalidInput: ``max_blocks`` is not an int ``>= 0`` (a bool is refused).
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        if type(max_blocks) not in (int, *NUMPY_INTEGER_TYPES) or max_blocks < 0:
            raise InvalidInput(f"max_blocks must be an int >= 0, got {describe(max_blocks)}")
        want = int(max_blocks)
        if len(self._shards) == 1:
            return await self._ask(self._shards[0], Evict(want)) if want else 0
        evicted = 0
        async with self._sharded_lock:  # not between a sharded step's validation and its application
            with self._events_batch():  # one event batch for every shard's evictions
                for shard in self._shards:
                    if evicted >= want:
                        break
                    evicted += await self._ask(shard, Evict(want - evicted))
        return evicted

    async def block_info(self, block_id: int) -> BlockInfo:
        """Snapshot of one block: its state, refcount and, if published, its content key.

        The key is computed on demand (``O(depth)`` hashes, in the owning
        shard) from the block's chain in the prefix tree: for the block at
        position ``i`` of a cached prompt it equals
        ``akv.core.block_key.chain_keys(prompt, block_size, namespace)[i]``,
        whichever shard and block id hold it.

        Args:
            block_id: An ``int`` (or numpy integer) in ``[0, num_blocks)``; not a bool.

        Returns:
            A frozen :class:`~akv.results.BlockInfo`.

        Raises:
            InvalidInput: ``block_id`` is not an integer in range (checked
                before any message is sent).
        """
        self._check_running()
        if type(block_id) in NUMPY_INTEGER_TYPES:
            block_id = int(block_id)
        if type(block_id) is not int or not 0 <= block_id < self.config.num_blocks:
            raise InvalidInput(f"block_id must be an int in [0, {self.config.num_blocks}), got {describe(block_id)}")
        shard = next(i for i, ids in enumerate(self.config.shard_ranges()) if block_id in ids)
        return await self._ask(self._shards[shard], InspectBlock(block_id))

    async def wait_copies(self) -> None:
        """Wait until every copy submitted so far has run, and settle the shards.

        A shard releases a finished copy's pins when it serves its next
        message; this call asks each shard that published pins not yet
        released for its pending copies (those of background evictions and
        demotions too), waits for them and sends it one more message
        (:class:`Stats`), so right after it returns
        :meth:`stats`, the metrics scrape and the gauges show no block in
        flight for those copies.

        Raises:
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        self._check_running()
        for ticket in list(self._tickets):
            await ticket.wait_async()
        self._tickets = [t for t in self._tickets if not t.done()]
        for shard in self._shards:
            if shard.snapshot.pinned_copies:  # the eviction loop's and evict()'s copies too
                for ticket in await self._ask(shard, PendingCopies()):
                    await ticket.wait_async()
                await self._ask(shard, Stats())

    async def stats(self) -> CacheStats:
        """Snapshot of block states, counters and actor inbox depths.

        Asks every shard for a fresh snapshot (:class:`Stats`: it settles
        finished copies first), so the counts are exact at a quiescent point.
        """
        self._check_running()
        shard_stats: list[ShardSnapshot] = [await self._ask(s, Stats()) for s in self._shards]
        return cache_stats(
            self.config,
            shard_stats,
            eviction=self._eviction.stats,
            max_inbox_depth={a.name: a.max_inbox_depth for a in self._actors},
            pool_bytes=self.storage.nbytes if self.storage is not None else 0,
        )

    async def check(self) -> None:
        """Full consistency check at a quiescent point (waits for pending copies first).

        Checks every block's state against refcounts and block tables, the free
        queue, the LRU list, that exactly the published blocks are in the
        prefix tree, that the tree's links are consistent, and that the
        reservations' earmarks add up (at most the free blocks).

        Raises:
            ActorCrashed: An inconsistency was found (the check's AssertionError
                crashes the shard: a broken invariant is never silent).
        """
        self._check_running()
        await self.wait_copies()
        for shard in self._shards:
            await self._ask(shard, Check())

    def block_refcounts(self) -> dict[int, int]:
        """Block id -> refcount of every block that some block table holds (read-only audit view).

        Synchronous, without a message: each shard's own audit call
        (:meth:`PoolShardActor.block_refcounts`), so take it at a quiescent
        point (no call in flight). It works after a crash too (a stopped
        shard serves no message, but its audit call reads the state it left
        behind), which is what the stress harness audits after a fault; it
        recounts the result from the block tables.

        Returns:
            ``{block_id: refcount}`` for every block with refcount >= 1. O(num_blocks).
        """
        out: dict[int, int] = {}
        for shard in self._shards:
            out.update(shard.block_refcounts())
        return out

    def host_block_refcounts(self) -> dict[int, int]:
        """Host id -> refcount of every host-tier block a swapped-out sequence holds (read-only audit view).

        The host tier's :meth:`block_refcounts`, with the same rules (no
        message; take it at a quiescent point; it works after a crash).
        Host ids are ``config.host_block_base + slot``. Each swapped-out
        sequence holds one host block per block of its table, so every
        refcount is 1 and there are ``CacheStats.host_swapped`` of them.

        Returns:
            ``{host_id: refcount}``; empty without a host tier. O(host blocks).
        """
        out: dict[int, int] = {}
        for shard in self._shards:
            out.update(shard.host_block_refcounts())
        return out

    def shard_of(self, seq_id: Hashable) -> int:
        """Index of the shard that holds a live sequence's blocks; no message.

        A scheduler that preempts on ``PoolExhausted`` uses it to pick a
        victim on the shard that ran out (preempting a sequence elsewhere
        frees nothing there). With one shard every id maps to 0 without a
        check; with several, the manager's record of owners is read.

        Raises:
            UnknownSequence: With ``num_shards > 1``, ``seq_id`` is not live.
            InvalidInput: ``seq_id`` is not a plain value (:mod:`akv.core.ids`).
        """
        seq_id = plain_id(seq_id, "seq_id")
        if len(self._shards) == 1:
            return 0
        return self._shard_map.owner(seq_id)

    @property
    def null_block_id(self) -> int:
        """The block id that pads every block table: ``config.num_blocks`` (see :attr:`KVCacheConfig.null_block_id`).

        Never allocated, cached or evicted; the storage has one block for it
        past the usable ones, so a model runner may read it or write garbage
        into its slots without touching any sequence's K/V.
        """
        return self.config.null_block_id

    @property
    def usage(self) -> float:
        """Fraction of blocks not free (0.0-1.0), as published by the shards after their last message.

        A gauge, read without a message: cheap enough to sample every step.
        """
        if not self._shards:
            return 0.0
        free = sum(s.snapshot.free for s in self._shards)
        return 1.0 - free / self.config.num_blocks

    @property
    def blocks_in_use(self) -> int:
        """Blocks referenced by sequences or pending copies (not free, not merely cached); a gauge."""
        return sum(s.snapshot.blocks_in_use for s in self._shards)

    @property
    def blocks_available(self) -> int:
        """Free plus evictable blocks, as published by the shards after their last message; a gauge.

        A scheduler can skip an admission that cannot fit (vLLM's ``can_allocate``)
        without a message: a prompt of ``n`` blocks fits at most when
        ``n <= blocks_available`` plus its hits on blocks other sequences hold.
        """
        return sum(s.snapshot.blocks_available for s in self._shards)

    @property
    def inbox_depths(self) -> dict[str, int]:
        """Messages waiting in each actor's inbox now."""
        return {a.name: a.inbox_depth for a in self._actors}
