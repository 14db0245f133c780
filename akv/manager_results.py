"""What the manager hands back: step results as tensors, stats and the metrics snapshot.

Pure conversions from the shards' replies (and their published counters) to
the public result types of :mod:`akv.results` and :mod:`akv.obs.metrics`; no
message is sent here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from akv.actors.shard_snapshot import COUNTER_NAMES, ShardSnapshot
from akv.config import KVCacheConfig
from akv.core.step import StepOutcome
from akv.obs.metrics import MetricsSnapshot
from akv.results import NO_COPIES, CacheStats, CopyCompletion, StepResult


def step_result(outcome: StepOutcome, tickets: list) -> StepResult:
    """The :class:`~akv.results.StepResult` of one (possibly merged) outcome.

    Args:
        outcome: The step's outcome; its numpy metadata arrays are wrapped
            without a copy (``torch.from_numpy``: int32 block tables
            ``[rows, width]`` or their int32 updates ``[entries, 3]``, context lengths ``[rows]``, int32 query start
            locations ``[rows + 1]``, slot mapping ``[tokens]``).
        tickets: The copy tickets the step submitted (may be empty).

    Returns:
        The step's result; ``copies`` completes when every ticket has run.
    """
    tables, updates, lens = outcome.block_tables, outcome.block_table_updates, outcome.context_lens
    qsl, slots = outcome.query_start_loc, outcome.slot_mapping
    return StepResult(
        seq_ids=tuple(outcome.seq_ids),
        block_tables=None if tables is None else _from_numpy(tables),
        block_table_updates=None if updates is None else _from_numpy(updates),
        context_lens=None if lens is None else _from_numpy(lens),
        query_start_loc=None if qsl is None else _from_numpy(qsl),
        slot_mapping=None if slots is None else _from_numpy(slots),
        cached_tokens=outcome.cached_tokens,
        rejected=outcome.rejected,
        copies=CopyCompletion(tickets) if tickets else NO_COPIES,
        freed=tuple(outcome.freed),
        evicted_blocks=outcome.evicted_blocks,
    )


def result_attributes(result: StepResult) -> dict[str, int]:
    """Span attributes of a step's result: rows scheduled, rejected, freed; blocks evicted and copied; bytes copied."""
    return {
        "akv.scheduled": len(result.seq_ids),
        "akv.rejected": len(result.rejected),
        "akv.freed": len(result.freed),
        "akv.evicted_blocks": result.evicted_blocks,
        "akv.copy_blocks": sum(t.num_blocks for t in result.copies.tickets),
        "akv.copy_bytes": result.copies.nbytes,
    }


#: ``_from_numpy(array)``: a tensor sharing the array's memory.
_from_numpy = torch.from_numpy


def cache_stats(
    config: KVCacheConfig,
    shard_stats: Sequence[ShardSnapshot],
    *,
    eviction: Any,
    max_inbox_depth: dict[str, int],
    pool_bytes: int,
) -> CacheStats:
    """Sum the shards' snapshots into one :class:`~akv.results.CacheStats`.

    Args:
        config: The manager's configuration (pool and block sizes).
        shard_stats: One :class:`~akv.actors.shard_snapshot.ShardSnapshot` per shard (the ``Stats`` replies).
        eviction: The eviction loop's stats (``batches``, ``blocks``).
        max_inbox_depth: Actor name -> deepest inbox seen.
        pool_bytes: Bytes of the K/V tensors (0 in metadata mode).

    Returns:
        The snapshot; ``usage`` and ``hit_rate`` are fractions in [0, 1].
    """
    c = [s.counter_values() for s in shard_stats]
    prompt = sum(x.prompt_tokens for x in c)
    cached = sum(x.cached_tokens for x in c)
    free = sum(s.free for s in shard_stats)
    return CacheStats(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        free=free,
        active=sum(s.active for s in shard_stats),
        cached=sum(s.cached for s in shard_stats),
        in_flight=sum(s.in_flight for s in shard_stats),
        usage=1.0 - free / config.num_blocks,
        num_sequences=sum(s.num_sequences for s in shard_stats),
        prefix_cache_blocks=sum(s.prefix_cache_blocks for s in shard_stats),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        blocks_allocated=sum(x.blocks_allocated for x in c),
        blocks_evicted=sum(x.blocks_evicted for x in c),
        eviction_batches=sum(x.eviction_batches for x in c),
        cow_copies=sum(x.cow_copies for x in c),
        forks=sum(x.forks for x in c),
        sequences_added=sum(x.sequences_added for x in c),
        sequences_freed=sum(x.sequences_freed for x in c),
        pool_exhausted=sum(x.pool_exhausted for x in c),
        eviction_loop_batches=eviction.batches,
        eviction_loop_blocks=eviction.blocks,
        max_inbox_depth=max_inbox_depth,
        pool_bytes=pool_bytes,
        blocks_freed=sum(s.blocks_freed for s in shard_stats),
        preemptions=sum(x.preemptions for x in c),
        sequences_resumed=sum(x.sequences_resumed for x in c),
        resumed_prompt_tokens=sum(x.resumed_prompt_tokens for x in c),
        resumed_cached_tokens=sum(x.resumed_cached_tokens for x in c),
        reserved_blocks=sum(s.reserved for s in shard_stats),
        **_host_stats(shard_stats, c, cached),
    )


def _host_stats(shard_stats: list[ShardSnapshot], c: list, cached: int) -> dict[str, int]:
    """The host-tier fields of :class:`CacheStats`, summed over the shards."""
    free, host_cached, swapped, in_flight = (sum(s.host[i] for s in shard_stats) for i in range(4))
    host_hits = sum(x.host_hit_tokens for x in c)
    total = free + host_cached + swapped + in_flight
    return dict(
        host_blocks=total,
        host_free=free,
        host_cached=host_cached,
        host_swapped=swapped,
        host_in_flight=in_flight,
        host_in_use=total - free,
        device_hit_tokens=cached - host_hits,
        host_hit_tokens=host_hits,
        demoted_blocks=sum(x.demoted_blocks for x in c),
        promoted_blocks=sum(x.promoted_blocks for x in c),
        host_evicted_blocks=sum(x.host_evicted for x in c),
        swapped_out=sum(x.swapped_out for x in c),
        swapped_in=sum(x.swapped_in for x in c),
        num_swapped=sum(s.num_swapped for s in shard_stats),
    )


def metrics_snapshot(num_blocks: int, snapshots: Iterable[ShardSnapshot], actors: Iterable[Any]) -> MetricsSnapshot:
    """Sum the shards' published snapshots (safe from a scrape thread: each is read once, whole).

    Args:
        num_blocks: Usable blocks of the whole pool.
        snapshots: The pool shards' :class:`~akv.actors.shard_snapshot.ShardSnapshot`
            (each read once by the caller, so every shard's counts are consistent).
        actors: Every actor (their ``name`` and ``inbox_depth``).

    Returns:
        Summed counters (``blocks_freed`` included), block counts by state,
        inbox depths and reserved blocks.
    """
    totals = dict.fromkeys(COUNTER_NAMES, 0)
    totals["blocks_freed"] = 0
    blocks = {"free": 0, "active": 0, "cached": 0, "in_flight": 0}
    reserved = 0
    host = [0, 0, 0, 0]
    for snap in snapshots:
        for i, n in enumerate(snap.host):
            host[i] += n
        for name, value in zip(COUNTER_NAMES, snap.counters, strict=True):
            totals[name] += value
        totals["blocks_freed"] += snap.blocks_freed
        blocks["free"] += snap.free
        blocks["active"] += snap.active
        blocks["cached"] += snap.cached
        blocks["in_flight"] += snap.in_flight
        reserved += snap.reserved
    return MetricsSnapshot(
        counters=totals,
        blocks=blocks,
        num_blocks=num_blocks,
        inbox_depths={a.name: a.inbox_depth for a in actors},
        reserved_blocks=reserved,
        host_blocks=dict(zip(("free", "cached", "swapped", "in_flight"), host)) if any(host) else {},
    )
