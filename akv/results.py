"""What the manager hands back to a scheduler and model runner (torch tensors, snapshots)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class CopyCompletion:
    """The copy-on-write copies of one step, submitted to the stream worker.

    On CUDA, ``fences`` holds one ``torch.cuda.Event`` per shard batch; the
    model runner makes its stream wait on them before attention reads (or the
    next write touches) the copied blocks::

        for fence in result.copies.fences:
            torch.cuda.current_stream().wait_event(fence)

    On CPU, await :meth:`wait` (it does not block the event loop).

    Args:
        tickets: The stream worker's tickets, one per shard that copied.
    """

    __slots__ = ("tickets",)

    def __init__(self, tickets: Sequence[Any] = ()) -> None:
        self.tickets = tuple(tickets)

    @property
    def num_blocks(self) -> int:
        """Blocks copied by this step."""
        return sum(t.num_blocks for t in self.tickets)

    @property
    def nbytes(self) -> int:
        """Bytes copied by this step (0 in metadata mode)."""
        return sum(t.nbytes for t in self.tickets)

    @property
    def fences(self) -> list:
        """CUDA events to wait on (empty on CPU and when nothing was copied)."""
        return [t.fence for t in self.tickets if t.fence is not None]

    def done(self) -> bool:
        """Whether every copy has run (non-blocking)."""
        return all(t.done() for t in self.tickets)

    async def wait(self) -> None:
        """Wait until every copy has run; re-raise a copy failure.

        Raises:
            ActorCrashed: The stream worker failed a copy.
        """
        for t in self.tickets:
            await t.wait_async()


NO_COPIES = CopyCompletion()


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """Everything a model runner needs for one step, plus what the scheduler must know.

    Rows are the scheduled sequences: successful appends, then successful
    admissions, in request order.

    Attributes:
        seq_ids: Scheduled sequence ids, one per row.
        block_tables: int32 ``(batch, max_blocks)``; past each row's
            ``ceil(context_len / block_size)`` blocks, padded with the null
            block id (``kv.null_block_id == config.num_blocks``: a block the
            storage holds past the usable ones, never allocated; reading it
            or writing garbage into it touches no sequence's K/V). None when
            the step asked for ``block_tables="updates"``.
        block_table_updates: With ``block_tables="updates"`` (else None):
            int32 ``(num_entries, 3)``, each entry ``(row, column, block_id)``,
            for a runner that keeps its own copy of each sequence's block table
            (vLLM's model runner keeps one and applies each step's new block
            ids). Writing them in (``table[slot_of[row], column] = block_id``)
            makes its rows equal to ``block_tables`` up to each row's
            ``ceil(context_len / block_size)`` blocks (past them: its own
            padding), provided it applied every earlier step's updates. A
            row's entries are the columns its new tokens fall in (a decode
            step: one per row), or its whole table when the runner may not
            hold it (a sequence admitted or forked since it was last
            scheduled with metadata, or one a step changed without metadata).
            Entries are grouped by row, in row order, columns ascending.
        context_lens: int32 ``(batch,)``: tokens per sequence including this
            step's new ones.
        query_start_loc: int32 ``(batch + 1,)``: row ``i``'s new tokens are
            ``slot_mapping[query_start_loc[i]:query_start_loc[i+1]]``.
        slot_mapping: int64 ``(num_new_tokens,)``: where each new token's K/V
            goes, ``block_id * block_size + offset`` (vLLM's ``slot_mapping``).
        cached_tokens: Admitted id -> prompt tokens served from the prefix cache.
        rejected: Id -> :class:`~akv.errors.PoolExhausted` or
            :class:`~akv.errors.RequestTooLarge` for appends and admissions not
            applied (their state is unchanged).
        copies: The step's copies (copy-on-write; with a host tier also
            demotions, promotions and swaps); wait on them before writing or
            reading the step's blocks. With a host tier a step that copies
            nothing itself may carry an earlier step's batch: a block it
            handed out is still being copied to the host (see
            :mod:`akv.core.tiers`).
        freed: Ids that were live and are now freed.
        evicted_blocks: Blocks evicted on demand during the step.
    """

    seq_ids: tuple[Hashable, ...] = ()
    block_tables: torch.Tensor | None = None
    block_table_updates: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    cached_tokens: Mapping[Hashable, int] = field(default_factory=dict)
    rejected: Mapping[Hashable, Exception] = field(default_factory=dict)
    copies: CopyCompletion = NO_COPIES
    freed: tuple[Hashable, ...] = ()
    evicted_blocks: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheStats:
    """Snapshot of the whole manager (units: blocks and tokens unless named).

    Attributes:
        num_blocks: Blocks in the pool.
        block_size: Tokens per block.
        free, active, cached, in_flight: Blocks per state; they add up to
            ``num_blocks`` at every quiescent point.
        reserved_blocks: Of the ``free`` blocks, those earmarked by
            reservations (``Admit(max_new_tokens=...)``): only their sequences
            may take them (see :mod:`akv.core.reservation`).
        usage: ``1 - free / num_blocks`` (0.0-1.0).
        num_sequences: Live sequences.
        prefix_cache_blocks: Blocks in the prefix tree.
        prompt_tokens: Prompt tokens of first admissions (``Admit(resumed=False)``).
        cached_tokens: Of those, tokens served from the prefix cache.
        hit_rate: ``cached_tokens / prompt_tokens`` (0.0 when none; never above 1).
        resumed_prompt_tokens, resumed_cached_tokens: The same for re-admissions
            after preemption (``Admit(resumed=True)``), counted apart.
        blocks_allocated, blocks_freed, blocks_evicted, eviction_batches,
        cow_copies, forks, sequences_added, sequences_resumed, sequences_freed,
        preemptions, pool_exhausted: Monotonic counters. ``blocks_allocated -
        blocks_freed`` equals ``num_blocks - free``.
        eviction_loop_batches, eviction_loop_blocks: Work of the background loop.
        max_inbox_depth: Actor name -> highest inbox depth seen (messages).
        pool_bytes: Bytes of K/V tensors (0 in metadata mode).
        host_blocks: Blocks of the host tier (0: none; see docs/host_tier.md).
        host_free, host_cached, host_swapped, host_in_flight: Host blocks
            per state (cached: in the prefix cache on the host; swapped: held
            by swapped-out sequences); they add up to ``host_blocks``.
        host_in_use: ``host_blocks - host_free``.
        device_hit_tokens, host_hit_tokens: ``cached_tokens`` split by the
            tier that served them (a host hit is promoted to the device).
        demoted_blocks, promoted_blocks: Blocks moved device -> host by
            eviction and host -> device by prefix hits (monotonic).
        host_evicted_blocks: Blocks the host tier dropped for room (monotonic).
        swapped_out, swapped_in: Sequences swapped out and in (monotonic);
            ``num_swapped`` are swapped out now.
    """

    num_blocks: int
    block_size: int
    free: int
    active: int
    cached: int
    in_flight: int
    usage: float
    num_sequences: int
    prefix_cache_blocks: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    blocks_allocated: int
    blocks_evicted: int
    eviction_batches: int
    cow_copies: int
    forks: int
    sequences_added: int
    sequences_freed: int
    pool_exhausted: int
    eviction_loop_batches: int
    eviction_loop_blocks: int
    max_inbox_depth: Mapping[str, int]
    pool_bytes: int
    blocks_freed: int = 0
    preemptions: int = 0
    sequences_resumed: int = 0
    resumed_prompt_tokens: int = 0
    resumed_cached_tokens: int = 0
    reserved_blocks: int = 0
    host_blocks: int = 0
    host_free: int = 0
    host_cached: int = 0
    host_swapped: int = 0
    host_in_flight: int = 0
    host_in_use: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    host_evicted_blocks: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    num_swapped: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockInfo:
    """Snapshot of one block, for inspection (:meth:`~akv.manager.KVCacheManager.block_info`).

    Attributes:
        block_id: The block.
        shard: Index of the shard that owns it.
        state: ``"free"``, ``"active"`` (refcount >= 1), ``"cached"``
            (refcount 0, in the prefix cache) or ``"in_flight"`` (a copy pending).
        refcount: Block tables that hold it.
        key: Its content key (:func:`akv.core.block_key.chain_keys`, 16 bytes)
            while it is a published full block in the prefix cache, else ``None``.
        depth: Blocks from its namespace's root down to it, itself included
            (0 when not published).
        num_tokens_in_chain: Tokens those blocks hold, ``depth * block_size``.
        namespace: The namespace it is cached under (``None`` is the default
            namespace, as for an unpublished block).
    """

    block_id: int
    shard: int
    state: str
    refcount: int
    key: bytes | None
    depth: int
    num_tokens_in_chain: int
    namespace: Hashable = None
