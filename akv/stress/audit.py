"""The harness's independent oracle of block bookkeeping: recounts and the published-prefix record.

The manager checks its own counters (``debug_invariants``, ``kv.check()``);
this module checks them against what the harness itself did, with no akv key,
count or tree code:

- :class:`PublishRecord`: every ``(namespace, full-block prefix)`` some task
  committed (recorded just before its commit is sent), so the prefix cache
  can only ever hold, and an admission only ever hit, a recorded prefix.
- :func:`audit`: at a quiescent point (no call in flight) recount every
  block's refcount from the live block tables (``kv.sequence()`` of every id
  a task may own) and compare with :meth:`KVCacheManager.block_refcounts`;
  compare the live sequences, active blocks and prefix-cache size of
  ``kv.stats()`` with the recount and the record; ``kv.lookup()`` every
  recorded prefix.
- with a host tier, :func:`audit` also checks every block of both tiers
  (:func:`check_tiers`): nothing in flight, every device block free, active
  or cached, and every host block free, cached or held by a sequence the
  tasks swapped out (exactly one host block per block of each, recounted
  from the tasks' own record, with ``kv.host_block_refcounts()`` block by
  block); the prefix-cache check covers host blocks too (a lookup reaches
  them and ``prefix_cache_blocks`` counts them).
- :func:`postmortem`: the same recount on the state a crashed manager left
  behind (its stopped shards), so a fault still yields leak figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from akv.errors import UnknownSequence
from akv.manager import KVCacheManager
from akv.results import CacheStats
from akv.stress.kv_io import quiesce

#: Token appended to a recorded prefix for a lookup (the last token is never served from the cache).
_PROBE_TOKEN = 0


class PublishRecord:
    """What the harness allows the prefix cache to hold: committed full-block prefixes per namespace.

    Args:
        block_size: Tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prefixes: dict[Hashable, set[tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return sum(len(p) for p in self._prefixes.values())

    def add(self, namespace: Hashable, tokens: list[int], start_blocks: int, stop_blocks: int) -> None:
        """Record the prefixes of ``tokens`` of ``start_blocks + 1 .. stop_blocks`` full blocks."""
        bs = self.block_size
        have = self._prefixes.setdefault(namespace, set())
        for k in range(start_blocks + 1, stop_blocks + 1):
            have.add(tuple(tokens[: k * bs]))

    def allows(self, namespace: Hashable, tokens: list[int], num_tokens: int) -> bool:
        """Whether a hit of ``num_tokens`` leading tokens of ``tokens`` in ``namespace`` was ever committed."""
        if num_tokens == 0:
            return True
        return tuple(tokens[:num_tokens]) in self._prefixes.get(namespace, ())

    def items(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """Every recorded ``(namespace, prefix)``."""
        return [(ns, p) for ns, prefixes in self._prefixes.items() for p in prefixes]

    def discard(self, namespace: Hashable, prefix: tuple[int, ...]) -> None:
        """Forget a prefix found evicted (a later commit records it again)."""
        self._prefixes.get(namespace, set()).discard(prefix)


@dataclass(kw_only=True, slots=True)
class AuditResult:
    """What one audit found (units: blocks, sequences, prefixes).

    Attributes:
        live_sequences: Sequences found live among the ids the tasks may own.
        refcount_mismatches: Blocks whose refcount differs from the recount.
        unknown_sequences: Live sequences no task knows of.
        cached_prefixes: Recorded prefixes the cache holds now.
        swapped_sequences: Sequences the tasks hold swapped out.
        tier_mismatches: Block states of either tier that disagree with the
            tasks' record (a block in flight at a quiescent point, states
            that do not add up, host blocks held by no swapped-out sequence).
        unrecorded_hits: Lookups that hit more than the record allows.
        prefix_cache_mismatch: ``prefix_cache_blocks`` minus the cached
            recorded prefixes (0 with one shard; extra nodes mean blocks the
            record never allowed, or cached blocks no lookup can reach).
        errors: What disagreed, first few.
    """

    live_sequences: int = 0
    refcount_mismatches: int = 0
    unknown_sequences: int = 0
    cached_prefixes: int = 0
    swapped_sequences: int = 0
    tier_mismatches: int = 0
    unrecorded_hits: int = 0
    prefix_cache_mismatch: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def violations(self) -> int:
        """Disagreements found, all kinds together."""
        return (
            self.refcount_mismatches
            + self.tier_mismatches
            + self.unknown_sequences
            + self.unrecorded_hits
            + (1 if self.prefix_cache_mismatch else 0)
        )

    def note(self, text: str) -> None:
        """Keep the first few disagreements."""
        if len(self.errors) < 8:
            self.errors.append(text)


def compare_refcounts(result: AuditResult, tables: Iterable[Iterable[int]], refcounts: dict[int, int]) -> None:
    """Recount refcounts from ``tables`` (block tables) and compare with ``refcounts`` block by block."""
    recount: Counter[int] = Counter()
    for table in tables:
        recount.update(table)
    for b in sorted(set(recount) | set(refcounts)):
        if recount.get(b, 0) != refcounts.get(b, 0):
            result.refcount_mismatches += 1
            result.note(f"block {b}: refcount {refcounts.get(b, 0)} but {recount.get(b, 0)} block-table references")


async def audit(
    kv: KVCacheManager,
    seq_ids: Iterable[Hashable],
    record: PublishRecord,
    swapped: dict[Hashable, int] | None = None,
) -> AuditResult:
    """Recount refcounts and compare the prefix cache with ``record``; call at a quiescent point.

    Args:
        kv: The running manager, with no call in flight but the audit's own.
        seq_ids: Every id a task may own (ids not live are skipped).
        record: The harness's record of committed prefixes; prefixes found
            evicted are dropped from it.
        swapped: The tasks' swapped-out sequences -> host blocks each holds
            (default: none).

    Returns:
        What disagreed.

    Raises:
        ActorCrashed, ManagerClosed: The manager is not running.
        TimeoutError: The eviction loop did not become quiet within 30 s.
    """
    result = AuditResult()
    await quiesce(kv, timeout_s=30.0)  # lookups and tree size must see the same cache
    seq_ids = set(seq_ids)
    tables = []
    live_ids = set()
    for seq_id in seq_ids:
        try:
            tables.append((await kv.sequence(seq_id)).block_ids)
        except UnknownSequence:
            continue
        live_ids.add(seq_id)
    refcounts = kv.block_refcounts()
    stats = await kv.stats()
    result.live_sequences = len(tables)
    compare_refcounts(result, tables, refcounts)
    live_swapped = [s for s in swapped or {} if s in live_ids]
    if live_swapped:
        result.tier_mismatches += len(live_swapped)
        result.note(f"sequences {live_swapped[:4]} are live, but their tasks swapped them out")
    check_tiers(result, stats, swapped or {}, kv.host_block_refcounts())
    if stats.num_sequences != len(tables):
        result.unknown_sequences = stats.num_sequences - len(tables)
        result.note(f"{stats.num_sequences} live sequences, the tasks know {len(tables)}")
    if stats.active != len(refcounts):
        result.refcount_mismatches += 1
        result.note(f"{stats.active} active blocks but {len(refcounts)} with a refcount")
    await _check_prefix_cache(kv, record, result)
    return result


def check_tiers(
    result: AuditResult, stats: CacheStats, swapped: dict[Hashable, int], host_refs: dict[int, int]
) -> None:
    """Every block of both tiers in a state the tasks' record allows, at a quiescent point.

    Device: nothing in flight, free + active + cached = all. Host: nothing in
    flight, free + cached + held = all, the held ones exactly the host blocks
    of the sequences the tasks swapped out (``swapped``: id -> blocks), one
    reference each (``host_refs``: ``kv.host_block_refcounts()``).
    """
    result.swapped_sequences = len(swapped)
    problems = []
    if stats.in_flight or stats.free + stats.active + stats.cached != stats.num_blocks:
        problems.append(
            f"device: {stats.free} free + {stats.active} active + {stats.cached} cached + "
            f"{stats.in_flight} in flight of {stats.num_blocks} at a quiescent point"
        )
    held = sum(swapped.values())
    if stats.host_in_flight or stats.host_free + stats.host_cached + stats.host_swapped != stats.host_blocks:
        problems.append(
            f"host: {stats.host_free} free + {stats.host_cached} cached + {stats.host_swapped} swapped + "
            f"{stats.host_in_flight} in flight of {stats.host_blocks} at a quiescent point"
        )
    if stats.num_swapped != len(swapped) or stats.host_swapped != held:
        problems.append(
            f"{stats.num_swapped} sequences hold {stats.host_swapped} host blocks swapped out; "
            f"the tasks swapped out {len(swapped)} holding {held}"
        )
    if len(host_refs) != held or any(r != 1 for r in host_refs.values()):
        bad = sorted(h for h, r in host_refs.items() if r != 1)[:4]
        problems.append(f"{len(host_refs)} host blocks referenced (refcount != 1: {bad}); {held} expected")
    result.tier_mismatches += len(problems)
    for p in problems:
        result.note(p)


async def _check_prefix_cache(kv: KVCacheManager, record: PublishRecord, result: AuditResult) -> None:
    """Look up every recorded prefix; the cache must hold recorded prefixes only, all reachable."""
    for ns, prefix in record.items():
        hit = await kv.lookup([*prefix, _PROBE_TOKEN], namespace=ns)
        if not record.allows(ns, list(prefix), hit):
            result.unrecorded_hits += 1
            result.note(f"lookup of a recorded prefix in {ns!r} hit {hit} tokens, not a recorded prefix")
        if hit == len(prefix):
            result.cached_prefixes += 1
        elif kv.config.num_shards == 1:  # with several, lookup asks one shard: another may still hold it
            record.discard(ns, prefix)
    stats = await kv.stats()
    extra = stats.prefix_cache_blocks - result.cached_prefixes
    if kv.config.num_shards > 1:
        extra = min(extra, 0)  # one prefix may be cached in several shards
    result.prefix_cache_mismatch = extra
    if extra:
        result.note(
            f"{stats.prefix_cache_blocks} prefix-cache blocks but {result.cached_prefixes} recorded prefixes hit"
        )


@dataclass(kw_only=True, slots=True)
class Leaks:
    """Leak figures recounted from the state a crashed manager left behind (units: blocks, sequences).

    Attributes:
        blocks: Device blocks with a refcount that no surviving block table holds.
        host_blocks: Host blocks with a refcount that no surviving swapped-out
            sequence holds.
        sequences: Surviving sequences (live or swapped out) no task may own.
        audit: Refcount mismatches and the core's own full check's verdict.
    """

    blocks: int = 0
    host_blocks: int = 0
    sequences: int = 0
    audit: AuditResult = field(default_factory=AuditResult)


def postmortem(kv: KVCacheManager, owned: set[Hashable]) -> Leaks:
    """Leak figures of a crashed manager, recounted from the state its stopped shards left behind.

    The shards are stopped, so their state is read directly (the harness
    reaches in on purpose: a crashed manager answers no call). A block is
    leaked when it is active but no surviving block table holds it (a host
    block: no surviving swapped-out sequence); a live or swapped-out sequence
    is leaked when no task may own it (the tasks could not free theirs once
    the manager had failed, so those are not leaks).
    """
    leaks = Leaks()
    result = leaks.audit
    for shard in kv._shards:
        state = shard.state
        try:
            state.check()  # its prefix tree and its host tier included
        except AssertionError as exc:
            result.refcount_mismatches += 1
            result.note(f"{shard.name}: {exc}")
        tables = [seq.block_ids.tolist() for seq in state.sequences.values()]
        held = {b for t in tables for b in t}
        pool = state.pool
        compare_refcounts(result, tables, {b: r for b in _block_ids(pool) if (r := pool.refcount(b))})
        leaks.blocks += sum(1 for b in _block_ids(pool) if pool.refcount(b) and b not in held)
        leaks.sequences += sum(1 for seq_id in (*state.sequences, *state.swapped) if seq_id not in owned)
        result.live_sequences += len(tables)
        if state.host is not None:
            swapped = [rec.host_ids for rec in state.swapped.values()]
            on_host = {h for ids in swapped for h in ids}
            host = state.host
            compare_refcounts(result, swapped, {h: r for h in _block_ids(host) if (r := host.refcount(h))})
            leaks.host_blocks += sum(1 for h in _block_ids(host) if host.refcount(h) and h not in on_host)
            result.swapped_sequences += len(swapped)
    return leaks


def _block_ids(pool) -> range:
    return range(pool.first_block_id, pool.first_block_id + pool.num_blocks)
