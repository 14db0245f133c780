"""Prometheus metrics of one manager: a registry of its own, counters read from the shards.

Counters and gauges are not kept twice: a custom collector reads the shards'
own counters (:class:`~akv.core.shard_state.ShardCounters`) and block-pool
counts when the registry is scraped, so a scrape can never disagree with
:meth:`KVCacheManager.stats` taken at the same quiescent point. Only what the
shards do not count is observed here: the histograms of step latency,
eviction batch time and copy sizes.

Each manager has its own :class:`prometheus_client.CollectorRegistry`
(nothing is registered in the global default registry), so two managers in
one process do not collide. Serve it with
``prometheus_client.start_http_server(port, registry=kv.metrics_registry)``
or render it with ``prometheus_client.generate_latest(kv.metrics_registry)``.

Names follow the Prometheus conventions (base units, ``_total`` on counters);
docs/metrics.md lists them.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

#: Counter name (without ``_total``) -> (field of ``MetricsSnapshot.counters``, help text).
COUNTERS: dict[str, tuple[str, str]] = {
    "akv_blocks_allocated": ("blocks_allocated", "Blocks taken off the free queue."),
    "akv_blocks_freed": ("blocks_freed", "Blocks put back on the free queue (released or evicted)."),
    "akv_blocks_evicted": ("blocks_evicted", "Cached blocks evicted from the prefix cache."),
    "akv_eviction_batches": ("eviction_batches", "Eviction passes that evicted at least one block."),
    "akv_prefix_cache_queries_tokens": (
        "prompt_tokens",
        "Prompt tokens of first admissions looked up in the prefix cache.",
    ),
    "akv_prefix_cache_hits_tokens": (
        "cached_tokens",
        "Prompt tokens of first admissions served from the prefix cache.",
    ),
    "akv_prefix_cache_resumed_queries_tokens": (
        "resumed_prompt_tokens",
        "Prompt tokens of re-admissions after preemption (counted apart from first admissions).",
    ),
    "akv_prefix_cache_resumed_hits_tokens": (
        "resumed_cached_tokens",
        "Prompt tokens of re-admissions after preemption served from the prefix cache.",
    ),
    "akv_blocks_copied_on_write": ("cow_copies", "Copy-on-write block copies."),
    "akv_sequences_forked": ("forks", "Child sequences created by forks."),
    "akv_sequences_added": ("sequences_added", "Sequences admitted (first admissions and re-admissions)."),
    "akv_sequences_freed": ("sequences_freed", "Sequences freed (finished or preempted)."),
    "akv_sequences_preempted": ("preemptions", "Sequences freed as preemptions by the scheduler."),
    "akv_pool_exhausted_refusals": ("pool_exhausted", "Appends or admissions refused for lack of blocks."),
    "akv_prefix_cache_host_hits_tokens": (
        "host_hit_tokens",
        "Of the prefix-cache hit tokens, those served from the host tier (promoted to the device).",
    ),
    "akv_blocks_demoted": ("demoted_blocks", "Cached blocks moved from the device to the host tier by eviction."),
    "akv_blocks_promoted": ("promoted_blocks", "Host-tier blocks moved back to the device by prefix hits."),
    "akv_host_blocks_evicted": ("host_evicted", "Cached blocks the host tier dropped for room."),
    "akv_sequences_swapped_out": ("swapped_out", "Sequences swapped out to the host tier."),
    "akv_sequences_swapped_in": ("swapped_in", "Sequences swapped back in from the host tier."),
}

#: Bucket bounds of ``akv_step_latency_seconds`` and ``akv_eviction_batch_seconds`` (seconds).
LATENCY_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
#: Bucket bounds of ``akv_copy_bytes`` (bytes per copy batch).
COPY_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(11))  # 1 KiB .. 1 GiB


@dataclass(kw_only=True, slots=True)
class MetricsSnapshot:
    """What the collector reads from a manager at scrape time.

    Attributes:
        counters: Counter field (see :data:`COUNTERS`) -> value, summed over shards.
        blocks: Block state (free, active, cached, in_flight) -> blocks.
        num_blocks: Blocks in the pool.
        inbox_depths: Actor name -> messages waiting now.
        reserved_blocks: Free blocks earmarked by reservations (see
            :mod:`akv.core.reservation`), summed over shards.
        host_blocks: Host-tier state (free, cached, swapped, in_flight) ->
            blocks (empty without a host tier).
    """

    counters: Mapping[str, int] = field(default_factory=dict)
    blocks: Mapping[str, int] = field(default_factory=dict)
    num_blocks: int = 0
    inbox_depths: Mapping[str, int] = field(default_factory=dict)
    reserved_blocks: int = 0
    host_blocks: Mapping[str, int] = field(default_factory=dict)


class _SnapshotCollector(Collector):
    """Turns a :class:`MetricsSnapshot` read at scrape time into metric families."""

    def __init__(self, read: Callable[[], MetricsSnapshot]) -> None:
        # A bound method is held weakly: the manager owns this collector's registry.
        self._read = weakref.WeakMethod(read) if inspect.ismethod(read) else lambda: read

    def collect(self) -> Iterator:
        read = self._read()
        if read is None:  # the manager is gone: a registry kept alive by a caller reports nothing
            return
        snap = read()
        for name, (key, text) in COUNTERS.items():
            yield CounterMetricFamily(name, text, value=snap.counters.get(key, 0))
        blocks = GaugeMetricFamily("akv_blocks", "Blocks per state.", labels=["state"])
        for state in ("free", "active", "cached", "in_flight"):
            blocks.add_metric([state], snap.blocks.get(state, 0))
        yield blocks
        yield GaugeMetricFamily(
            "akv_blocks_reserved",
            "Free blocks earmarked by reservations (max_new_tokens); counted in akv_blocks{state=free} too.",
            value=snap.reserved_blocks,
        )
        free = snap.blocks.get("free", 0)
        usage = 1.0 - free / snap.num_blocks if snap.num_blocks else 0.0
        yield GaugeMetricFamily("akv_pool_usage_ratio", "Fraction of blocks not free (0-1).", value=usage)
        host = GaugeMetricFamily(
            "akv_host_blocks", "Host-tier blocks per state (none without a tier).", labels=["state"]
        )
        for state, n in snap.host_blocks.items():
            host.add_metric([state], n)
        yield host
        depth = GaugeMetricFamily("akv_actor_inbox_messages", "Messages waiting in an actor's inbox.", labels=["actor"])
        for actor, n in sorted(snap.inbox_depths.items()):
            depth.add_metric([actor], n)
        yield depth


#: Buckets of the snapshot save and load histograms (seconds).
SNAPSHOT_BUCKETS_S = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class ManagerMetrics:
    """The registry of one manager and the histograms it observes.

    Args:
        read: Returns the manager's :class:`MetricsSnapshot`; called at each
            scrape (from the scraping thread: it must only read plain counters).

    Attributes:
        registry: The manager's own ``CollectorRegistry``.
        step_latency_s: Histogram of ``KVCacheManager.step`` wall time (seconds).
        eviction_batch_s: Histogram of one eviction-loop batch (seconds).
        copy_bytes: Histogram of bytes per submitted copy batch.
        snapshot_save_s, snapshot_load_s: Histograms of snapshot saves and
            loads (seconds, see :mod:`akv.manager_snapshot`).
        snapshot_blocks: Counter of snapshot blocks by ``op`` (saved, loaded, dropped).
        snapshot_refusals: Counter of snapshots refused on load, by ``cause``.
    """

    def __init__(self, read: Callable[[], MetricsSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(read))
        self.step_latency_s = Histogram(
            "akv_step_latency_seconds",
            "Wall time of one KVCacheManager.step call.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.eviction_batch_s = Histogram(
            "akv_eviction_batch_seconds",
            "Wall time of one eviction-loop batch.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.copy_bytes = Histogram(
            "akv_copy_bytes",
            "Bytes per submitted copy-on-write batch (block bytes times blocks).",
            buckets=COPY_BYTES_BUCKETS,
            registry=self.registry,
        )
        self.snapshot_save_s = Histogram(
            "akv_snapshot_save_seconds",
            "Wall time of one save_snapshot.",
            buckets=SNAPSHOT_BUCKETS_S,
            registry=self.registry,
        )
        self.snapshot_load_s = Histogram(
            "akv_snapshot_load_seconds",
            "Wall time of one load_snapshot.",
            buckets=SNAPSHOT_BUCKETS_S,
            registry=self.registry,
        )
        self.snapshot_blocks = Counter(
            "akv_snapshot_blocks", "Snapshot blocks saved, loaded or dropped.", ["op"], registry=self.registry
        )
        self.snapshot_refusals = Counter(
            "akv_snapshot_refusals",
            "Snapshots refused on load, by SnapshotError cause.",
            ["cause"],
            registry=self.registry,
        )
