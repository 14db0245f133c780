"""The synchronous heart of a pool shard: sequences, block tables, pool, prefix tree.

:class:`ShardState` owns one shard's :class:`~akv.core.radix_tree.RadixTree`
and calls it directly: the pool shard actor runs one method per message, and
tests run the same methods without any actor. No asyncio or torch is
imported here.

The step's phases are grouped by responsibility in mixins, one module each:
validation and invariant checks (:mod:`akv.core.checks`), commit and publish
(:mod:`akv.core.publish`), appends, decode and metadata
(:mod:`akv.core.decode`), admissions (:mod:`akv.core.admission`), room and
eviction (:mod:`akv.core.room`), snapshot export and import
(:mod:`akv.core.shard_export`). This module holds the state, the step's
order of phases, fork and free.

Every public mutation validates its whole input before changing anything, so
an error leaves the shard exactly as it was.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from akv.core.admission import PendingHits, ShardAdmission
from akv.core.block_pool import BlockPool
from akv.core.block_table import BlockTables
from akv.core.checks import ShardChecks
from akv.core.decode import ShardAppends
from akv.core.eviction_policy import DEFAULT_EVICTION_POLICY
from akv.core.publish import PendingPublish, ShardPublishing
from akv.core.radix_tree import RadixTree
from akv.core.reservation import reserved_blocks
from akv.core.room import ShardRoom
from akv.core.sequence import Sequence
from akv.core.shard_export import ShardExports
from akv.core.step import StepOutcome, StepRequest
from akv.core.swap import ShardSwaps, SwappedSequence
from akv.core.tiers import ShardTiers, TierTransfer
from akv.errors import UnknownSequence


@dataclass(kw_only=True, slots=True)
class ShardCounters:
    """Monotonic counters of one shard (units: blocks, tokens, sequences, events)."""

    blocks_allocated: int = 0
    blocks_evicted: int = 0
    eviction_batches: int = 0
    cow_copies: int = 0
    forks: int = 0
    sequences_added: int = 0
    sequences_freed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pool_exhausted: int = 0
    eviction_refusals: int = 0
    preemptions: int = 0
    sequences_resumed: int = 0
    resumed_prompt_tokens: int = 0
    resumed_cached_tokens: int = 0
    host_hit_tokens: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    host_evicted: int = 0
    swapped_out: int = 0
    swapped_in: int = 0


class ShardState(
    ShardChecks, ShardPublishing, ShardAppends, ShardExports, ShardRoom, ShardAdmission, ShardTiers, ShardSwaps
):
    """Sequences and blocks of one shard.

    Token ids are stored per block, beside the K/V they stand for:
    ``block_tokens[b - first_block_id]`` holds the ``block_size`` token ids
    of block ``b``. A sequence's history is its blocks' rows read in table
    order, so a fork shares tokens exactly as it shares blocks,
    copy-on-write copies a block's tokens with its K/V, and a decode step
    writes a batch's new tokens with one scatter through the slot mapping.

    Args:
        shard_index: Index of this shard; part of every prefix-cache namespace
            key, since a block can only serve sequences of its own partition.
        block_ids: Global block ids owned by the shard.
        block_size: Tokens per block.
        enable_prefix_cache: Publish committed full blocks and match prompts.
        eviction_policy: Eviction policy name, passed to :class:`BlockPool`.
        null_block_id: The block id that pads block tables (never allocated,
            owned by no shard: the manager passes ``config.null_block_id``);
            default ``block_ids.stop``, right for a lone shard of ``range(0, n)``.
        tree: The prefix tree of this shard's blocks (default: a new, empty
            :class:`RadixTree`, with ``host_ids.start`` as its host base when
            there is a host tier); the shard owns it from now on.
        host_ids: The tree ids of this shard's host-tier slots
            (:meth:`~akv.config.KVCacheConfig.host_shard_ranges`), or None
            (empty): no host tier (see :mod:`akv.core.tiers`).
        host_base: The tree id of host slot 0 of the whole pool
            (:attr:`~akv.config.KVCacheConfig.host_block_base`); default
            ``host_ids.start``, right for a lone shard.
        sync_copies: Copies complete where they are made (metadata mode, or
            tests without a stream worker): tier moves take effect at once
            and no :class:`~akv.core.tiers.TierTransfer` is kept.

    Raises:
        ValueError: ``tree`` has another ``block_size``, or host ids overlap
            the device ids.
    """

    def __init__(
        self,
        shard_index: int,
        block_ids: range,
        block_size: int,
        *,
        enable_prefix_cache: bool = True,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
        null_block_id: int | None = None,
        tree: RadixTree | None = None,
        host_ids: range | None = None,
        host_base: int | None = None,
        sync_copies: bool = True,
    ) -> None:
        self.shard_index = shard_index
        #: Padding of block tables (see :mod:`akv.core.block_table`).
        self.null_block_id = block_ids.stop if null_block_id is None else null_block_id
        if host_ids is not None and len(host_ids):
            if host_base is None:
                host_base = host_ids.start
            if host_base <= self.null_block_id or host_ids.start < host_base:
                raise ValueError(f"host ids {host_ids} must lie after the device ids and the null block")
        else:
            host_ids = host_base = None
        #: Tree id of host slot 0 (None: no host tier); host slot ``s`` is ``host_base + s``.
        self.host_base = host_base
        #: The host tier's blocks (None: no host tier); see :mod:`akv.core.tiers`.
        self.host = None if host_ids is None else BlockPool(host_ids, policy=eviction_policy)
        self.sync_copies = sync_copies
        #: Tree ids whose pending copy has not completed: never matched.
        self.unready: set[int] = set()
        self._transfers: dict[int, TierTransfer] = {}
        #: Device blocks demoted on demand whose copy to the host is pending -> its transfer id.
        self.released: dict[int, int] = {}
        self._next_transfer = 1
        #: Sequences swapped out to the host tier (:mod:`akv.core.swap`), by id.
        self.swapped: dict[Hashable, SwappedSequence] = {}
        #: The prefix cache index of this shard's published blocks.
        self.tree = RadixTree(block_size, host_base) if tree is None else tree
        if self.tree.block_size != block_size:
            raise ValueError(f"a tree of {self.tree.block_size}-token blocks for a shard of {block_size}-token blocks")
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = BlockPool(block_ids, policy=eviction_policy)
        self.tables = BlockTables(pad=self.null_block_id)
        self.sequences: dict[Hashable, Sequence] = {}
        #: Sequence id -> its row in :attr:`tables` (for vectorized batch lookups).
        self.rows: dict[Hashable, int] = {}
        #: int32 ``(num_blocks, block_size)``: the token ids whose K/V each block holds.
        self.block_tokens = np.zeros((len(block_ids), block_size), dtype=np.int32)
        self._flat_tokens = self.block_tokens.reshape(-1)
        #: Blocks a decode batch lacked when :meth:`_decode` last returned None.
        self._decode_shortfall = 0
        self._first_slot = block_ids.start * block_size
        self.counters = ShardCounters()
        #: Block-table references held by live sequences (equals pool.total_refs).
        self.table_refs = 0
        #: Free blocks earmarked by reservations (see :mod:`akv.core.reservation`); <= pool.num_free.
        self.num_reserved = 0
        #: Live sequences admitted with a reservation (0: no reservation code runs).
        self.num_reserved_seqs = 0

    def namespace_key(self, namespace: Hashable) -> tuple:
        """Tree namespace key of ``namespace`` in this shard."""
        return (self.shard_index, namespace)

    def get(self, seq_id: Hashable) -> Sequence:
        """The live sequence ``seq_id``.

        Raises:
            UnknownSequence: Not live in this shard.
        """
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def token_ids(self, seq: Sequence) -> np.ndarray:
        """Token history of ``seq``: int32 ``(num_tokens,)``, a new array."""
        ids = seq.block_ids.view().astype(np.intp) - self.pool.first_block_id
        return self.block_tokens[ids].reshape(-1)[: seq.num_tokens]

    def usage(self) -> float:
        """Fraction of blocks not free (0.0-1.0)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def lookup(self, namespace: Hashable, prompt: np.ndarray) -> int:
        """Blocks of ``prompt`` an admission in ``namespace`` would hit now (changes nothing).

        Args:
            namespace: Prefix-cache namespace of the prompt.
            prompt: Token ids, int32 ``(num_tokens,)``.

        Returns:
            Leading blocks of the prompt in the prefix cache (the last token
            is never served from the cache, so at most ``(len - 1) // block_size``).
        """
        n = (len(prompt) - 1) // self.block_size if len(prompt) else 0
        return self.tree.lookup(self.namespace_key(namespace), prompt[: n * self.block_size])

    def step(self, req: StepRequest) -> StepOutcome:
        """Apply one scheduler step (see :class:`~akv.core.step.StepRequest` for the order).

        Appends and admissions are each all-or-nothing: one that cannot get its
        blocks (even after evicting cached blocks) is listed in
        ``outcome.rejected`` and leaves no trace. Everything else is validated
        up front.

        A batch of one-token appends (a decode step) whose new blocks and
        copy-on-write copies fit in the free blocks takes a vectorized path:
        a few numpy operations over the batch's rows, no per-sequence Python
        work except for the ~1/block_size rows that start a block.

        Phases, in order: free (:meth:`_free`), commit (:meth:`_commit`, which
        queues the newly full blocks for the prefix tree), fork (:meth:`_fork`),
        publish and match (:meth:`_publish`, :meth:`_match_admissions`), append
        (:meth:`_append`), admit (:meth:`_admit`), then the metadata of the
        scheduled rows (:meth:`_fill_metadata`). Each phase records what it did
        in the one :class:`~akv.core.step.StepOutcome` returned, including the
        blocks stored in and removed from the prefix cache.

        Raises:
            UnknownSequence: A commit, fork or append names no live sequence.
            DuplicateSequence: An admission or fork child reuses a live id.
            InvalidInput: Bad commit counts or empty token arrays.
            PoolExhausted: A fork of a reserved sequence cannot earmark its
                copy-on-write block (:meth:`fork_room`); nothing is applied.
        """
        checked = self.validate(req)
        out = StepOutcome()
        # Made before anything is applied: frees only add room, commits take none.
        earmarks = self.fork_room(req.forks) if req.forks and self.num_reserved_seqs else []
        if earmarks:
            self._room_for_earmarks(len(earmarks), out)
        if req.frees:
            self._free(req, out)
            if req.frees_only:
                if req.want_metadata:
                    self._fill_metadata(out, None, [], req.block_table_updates)
                return out
        publishing = PendingPublish()
        if req.commits:
            self._commit(req.commits, checked, publishing)
        if publishing.entries:  # before the forks: a child copies its parent's published count
            self._publish(publishing, out)
        if req.forks:
            self._fork(req.forks, earmarks)
        matches = self._match_admissions(req.admits) if req.admits else {}
        # Prefix hits of admissions not processed yet must not be evicted to make
        # room for anything else in this step.
        protected = PendingHits()
        for i, hits in matches.items():
            protected.add(i, hits)
        # Scheduled rows besides a vectorized decode batch, in metadata order:
        # their ids and (row, first new position, new tokens).
        sched_ids: list = []
        sched: list[tuple[int, int, int]] = []
        decoded = self._append(req, checked, protected, out, sched_ids, sched) if req.appends else None
        if req.admits:
            self._admit(req.admits, matches, protected, out, sched_ids, sched)
        out.seq_ids = decoded[0] + sched_ids if decoded is not None else sched_ids
        if self.released:
            self._note_reused(out)
        if req.want_metadata:
            self._fill_metadata(out, decoded, sched, req.block_table_updates)
        return out

    def _fork(self, forks, earmarks: list[int]) -> None:
        """Fork phase: each child shares every block of its parent; earmark the copy-on-write blocks ``earmarks``."""
        seqs, pool, tables = self.sequences, self.pool, self.tables
        for parent_id, child_ids in forks:
            parent = seqs[parent_id]
            for child_id in child_ids:
                child = parent.fork(child_id, tables.new_row())
                ids = child.block_ids.view()
                pool.incref(ids, distinct=True)
                self.table_refs += len(ids)
                seqs[child_id] = child
                self.rows[child_id] = child.row
                self.counters.forks += 1
        if earmarks:
            tables.cow_reserved[earmarks] = True
            self.num_reserved += len(earmarks)

    def evict(self, max_blocks: int, out: StepOutcome | None = None) -> int:
        """Evict up to ``max_blocks`` cached blocks, in the eviction policy's order (leaves only).

        With a host tier the device leaves are demoted, and each stays in
        flight until its copy has completed (a transfer in ``out``; pass an
        outcome whenever copies are not synchronous).

        Args:
            max_blocks: Most blocks to evict.
            out: Where to record the removed blocks (``removed_block_ids``),
                the demotions (``demotes``) and their transfer, if given.

        Returns:
            Blocks evicted (removed from the prefix cache and free, or
            demoted: free once their copy has completed).
        """
        return self._evict(max_blocks, frozenset(), out, held=True)

    def release_copy_pins(self, block_ids: list[int]) -> None:
        """A copy batch finished: its source and destination blocks may become cached or free."""
        self.pool.unpin_copied(block_ids)

    def _free(self, req: StepRequest, out: StepOutcome) -> None:
        """Free the step's live sequences (unknown ids are ignored): one decref for all their blocks.

        Each sequence releases its blocks deepest first, so on ties the deepest
        block is evicted first; sequences release in request order.
        """
        seqs, rows = self.sequences, self.rows
        freed_rows = []
        for seq_id in req.frees:
            seq = seqs.pop(seq_id, None)
            if seq is None:
                continue
            freed_rows.append(rows.pop(seq_id))
            out.freed.append(seq_id)
            if seq_id in req.preempted:
                self.counters.preemptions += 1
        if self.swapped:
            self._free_swapped(req.frees, out)
        if not freed_rows:
            return
        self._release_rows(freed_rows)
        self.counters.sequences_freed += len(freed_rows)

    def _release_rows(self, rows: list[int]) -> None:
        """Give back the rows' reservations and block references (the sequences are gone already)."""
        if self.num_reserved_seqs:
            r = np.array(rows, dtype=np.intp)
            self.num_reserved -= int(reserved_blocks(self.tables, r, self.block_size).sum())
            self.num_reserved_seqs -= int(np.count_nonzero(self.tables.max_tokens[r]))
        ids = self.tables.release_many(rows)
        self.pool.decref(ids, distinct=len(rows) == 1)
        self.table_refs -= len(ids)
