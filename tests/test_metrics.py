"""Prometheus metrics: a registry per manager whose counters count what the test did and equal ``kv.stats()``."""

from __future__ import annotations

import gc
import json
import random
import threading
import urllib.request
from pathlib import Path

import anyio
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.cli import main
from akv.errors import PoolExhausted, RequestTooLarge
from akv.obs.export import serve_metrics
from akv.replay import ReplayOptions, replay
from akv.storage import KVStorage
from tests.test_replay import BLOCK, TRACE_BLOCK, restore_logging, synthetic_requests

__all__ = ["restore_logging"]  # the fixture, imported for its use here


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


def scrape(registry) -> dict[tuple[str, tuple], float]:
    """Sample name and sorted labels -> value, parsed as a Prometheus client would."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def assert_agrees(samples: dict, stats) -> None:
    counters = {
        "akv_blocks_allocated_total": stats.blocks_allocated,
        "akv_blocks_freed_total": stats.blocks_freed,
        "akv_blocks_evicted_total": stats.blocks_evicted,
        "akv_eviction_batches_total": stats.eviction_batches,
        "akv_prefix_cache_queries_tokens_total": stats.prompt_tokens,
        "akv_prefix_cache_hits_tokens_total": stats.cached_tokens,
        "akv_prefix_cache_resumed_queries_tokens_total": stats.resumed_prompt_tokens,
        "akv_prefix_cache_resumed_hits_tokens_total": stats.resumed_cached_tokens,
        "akv_blocks_copied_on_write_total": stats.cow_copies,
        "akv_sequences_forked_total": stats.forks,
        "akv_sequences_added_total": stats.sequences_added,
        "akv_sequences_freed_total": stats.sequences_freed,
        "akv_sequences_preempted_total": stats.preemptions,
        "akv_pool_exhausted_refusals_total": stats.pool_exhausted,
        "akv_prefix_cache_host_hits_tokens_total": stats.host_hit_tokens,
        "akv_blocks_demoted_total": stats.demoted_blocks,
        "akv_blocks_promoted_total": stats.promoted_blocks,
        "akv_host_blocks_evicted_total": stats.host_evicted_blocks,
        "akv_sequences_swapped_out_total": stats.swapped_out,
        "akv_sequences_swapped_in_total": stats.swapped_in,
    }
    assert {name: value(samples, name) for name in counters} == counters
    if stats.host_blocks:
        for state in ("free", "cached", "swapped", "in_flight"):
            assert value(samples, "akv_host_blocks", state=state) == getattr(stats, f"host_{state}")
    for state in ("free", "active", "cached", "in_flight"):
        assert value(samples, "akv_blocks", state=state) == getattr(stats, state)
    assert value(samples, "akv_pool_usage_ratio") == pytest.approx(stats.usage)
    assert stats.blocks_allocated - stats.blocks_freed == stats.num_blocks - stats.free


def counters(samples: dict) -> dict[str, float]:
    """The ``akv_*_total`` counters of a scrape, by name (without the ``_total``)."""
    return {name[4:-6]: v for (name, labels), v in samples.items() if name.endswith("_total") and not labels}


def block_gauges(samples: dict) -> dict[str, float]:
    return {state: value(samples, "akv_blocks", state=state) for state in ("free", "active", "cached", "in_flight")}


NO_COUNTS = dict.fromkeys(
    [
        "blocks_allocated",
        "blocks_freed",
        "blocks_evicted",
        "eviction_batches",
        "prefix_cache_queries_tokens",
        "prefix_cache_hits_tokens",
        "prefix_cache_resumed_queries_tokens",
        "prefix_cache_resumed_hits_tokens",
        "blocks_copied_on_write",
        "sequences_forked",
        "sequences_added",
        "sequences_freed",
        "sequences_preempted",
        "pool_exhausted_refusals",
        "prefix_cache_host_hits_tokens",
        "blocks_demoted",
        "blocks_promoted",
        "host_blocks_evicted",
        "sequences_swapped_out",
        "sequences_swapped_in",
    ],
    0,
)


@pytest.mark.anyio
async def test_counters_count_the_operations_of_a_manual_workload(tiny_config) -> None:
    """Every counter and gauge against what the test's own operations must have done (16 blocks of 4)."""
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        assert counters(scrape(kv.metrics_registry)) == NO_COUNTS
        prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + a tail of 2
        assert await kv.add_sequence("a", prompt) == 0  # 3 blocks allocated
        await kv.commit("a", 10)  # a's 2 full blocks published
        assert await kv.add_sequence("b", prompt) == 8  # hits a's 2 blocks, allocates its own tail
        await kv.fork("b", ["c"])  # c shares b's 3 blocks
        await kv.append("b", [7])  # b and c share the partial tail: one copy-on-write (1 block allocated)
        await kv.free("a")  # a's tail returns to the free list; its full blocks stay held by b and c
        assert await kv.free("c", preempted=True)  # c's tail (the original, now c's alone) is freed
        await kv.wait_copies()
        # The shard settles a finished copy on its next message: before it, block 3 (the copy's
        # source, freed with c) still reads in flight and not yet freed.
        stats = await kv.stats()
        samples = scrape(kv.metrics_registry)
        expected = {
            **NO_COUNTS,
            "blocks_allocated": 3 + 1 + 1,
            "blocks_freed": 1 + 1,
            "prefix_cache_queries_tokens": 10 + 10,
            "prefix_cache_hits_tokens": 8,
            "blocks_copied_on_write": 1,
            "sequences_forked": 1,
            "sequences_added": 2,
            "sequences_freed": 2,
            "sequences_preempted": 1,
        }
        assert counters(samples) == expected
        # b alone holds its 2 shared full blocks and its copied tail; nothing cached (b still holds a's blocks).
        assert block_gauges(samples) == {"free": 13, "active": 3, "cached": 0, "in_flight": 0}
        assert value(samples, "akv_pool_usage_ratio") == 3 / 16
        assert value(samples, "akv_step_latency_seconds_count") == 7  # one step per call above
        assert value(samples, "akv_copy_bytes_count") == 1
        assert value(samples, "akv_copy_bytes_sum") == kv.config.bytes_per_block
        assert {k[1] for k in samples if k[0] == "akv_actor_inbox_messages"} == {(("actor", "pool_shard_0"),)}
        assert_agrees(samples, stats)
    # The registry stays readable after exit: final values.
    assert counters(scrape(kv.metrics_registry)) == expected


@pytest.mark.anyio
async def test_counters_count_forced_evictions_and_refusals(tiny_config) -> None:
    """8 blocks: two published prompts (4 cached blocks), an admission that must evict exactly one,
    one the pool cannot hold now (pool exhausted) and one it never can (too large: not counted)."""
    async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
        for i in range(2):  # 9 tokens: 3 blocks, 2 published; freed: 2 cached, the tail free
            await kv.add_sequence(f"p{i}", [100 * i + j for j in range(9)])
            await kv.commit(f"p{i}", 9)
            await kv.free(f"p{i}")
        assert await kv.add_sequence("big", list(range(500, 520))) == 0  # 5 blocks, 4 free: evicts 1
        with pytest.raises(PoolExhausted):
            await kv.add_sequence("later", list(range(600, 616)))  # 4 blocks, 0 free + 3 cached
        with pytest.raises(RequestTooLarge):
            await kv.add_sequence("huge", list(range(700, 740)))  # 10 blocks > 8
        samples = scrape(kv.metrics_registry)
        assert counters(samples) == {
            **NO_COUNTS,
            "blocks_allocated": 3 + 3 + 5,
            "blocks_freed": 1 + 1 + 1,  # the two tails, then the evicted block
            "blocks_evicted": 1,
            "eviction_batches": 1,
            "prefix_cache_queries_tokens": 9 + 9 + 20,  # refused admissions are not queries
            "sequences_added": 3,
            "sequences_freed": 2,
            "pool_exhausted_refusals": 1,
        }
        assert block_gauges(samples) == {"free": 0, "active": 5, "cached": 3, "in_flight": 0}
        assert_agrees(samples, await kv.stats())


@pytest.mark.anyio
async def test_resumed_admissions_are_counted_apart(tiny_config) -> None:
    from akv import Admit

    async with KVCacheManager(tiny_config()) as kv:
        await kv.step(admits=[Admit(seq_id="a", prompt=list(range(1, 10)), prefill_done=True)])
        await kv.step(preempted=["a"])
        await kv.step(admits=[Admit(seq_id="a", prompt=list(range(1, 12)), prefill_done=True, resumed=True)])
        stats = await kv.stats()
        assert (stats.prompt_tokens, stats.cached_tokens) == (9, 0)
        assert (stats.resumed_prompt_tokens, stats.resumed_cached_tokens) == (11, 8)
        assert (stats.preemptions, stats.sequences_resumed, stats.sequences_added) == (1, 1, 2)
        assert_agrees(scrape(kv.metrics_registry), stats)


@pytest.mark.anyio
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_tight_replay_metrics_agree_with_stats_and_report(num_shards: int) -> None:
    requests = synthetic_requests(60)
    cfg = KVCacheConfig(
        num_blocks=48 * num_shards, block_size=BLOCK, debug_invariants=True, num_shards=num_shards, high_watermark=0.2
    )
    async with KVCacheManager(cfg) as kv:
        report = await replay(kv, requests, ReplayOptions(max_batch=16, trace_block_tokens=TRACE_BLOCK))
        await kv.wait_copies()
        stats = await kv.stats()
        samples = scrape(kv.metrics_registry)
    assert_agrees(samples, stats)
    assert report.preemptions > 0
    assert value(samples, "akv_sequences_preempted_total") == report.preemptions
    assert value(samples, "akv_prefix_cache_queries_tokens_total") == report.prompt_tokens
    assert value(samples, "akv_prefix_cache_hits_tokens_total") == report.cached_tokens
    assert value(samples, "akv_prefix_cache_resumed_queries_tokens_total") == report.readmit_prompt_tokens
    assert value(samples, "akv_prefix_cache_resumed_hits_tokens_total") == report.readmit_cached_tokens
    assert value(samples, "akv_step_latency_seconds_count") == report.decode_steps
    assert stats.cached_tokens <= stats.prompt_tokens
    if stats.eviction_loop_batches:
        assert value(samples, "akv_eviction_batch_seconds_count") == stats.eviction_loop_batches


@pytest.mark.anyio
async def test_two_managers_do_not_collide(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as one, KVCacheManager(tiny_config(num_blocks=32)) as two:
        await one.add_sequence("x", list(range(1, 10)))
        a, b = scrape(one.metrics_registry), scrape(two.metrics_registry)
        assert one.metrics_registry is not two.metrics_registry
        assert value(a, "akv_blocks_allocated_total") == 3
        assert value(b, "akv_blocks_allocated_total") == 0
        assert value(b, "akv_blocks", state="free") == 32


@pytest.mark.anyio
async def test_a_registry_kept_after_its_manager_is_freed_reports_no_pool(tiny_config) -> None:
    kv = KVCacheManager(tiny_config())
    async with kv:
        await kv.add_sequence("x", list(range(1, 10)))
        registry = kv.metrics_registry
        assert value(scrape(registry), "akv_blocks", state="active") == 3
    del kv  # the registry holds the manager weakly: it does not keep the pools alive
    gc.collect()
    names = {name for name, _ in scrape(registry)}  # scraping still works
    assert "akv_blocks" not in names and "akv_blocks_allocated_total" not in names


# ---------------------------------------------------------------------- CLI
def write_tight_trace(path: Path, n: int = 40) -> None:
    """Requests of 2-3 trace blocks (512 tokens) sharing their first block: evictions and preemptions in 200 blocks."""
    rng = random.Random(1)
    lines = []
    for i in range(n):
        length = rng.randint(600, 1400)
        ids = [rng.choice([0, 1]), *(1000 + 10 * i + j for j in range(1, -(-length // 512)))]
        lines.append(json.dumps({"timestamp": 10 * i, "input_length": length, "output_length": 40, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def test_cli_metrics_out_agrees_with_the_json_report(tmp_path: Path, restore_logging) -> None:
    trace, report_path, metrics_path = tmp_path / "t.jsonl", tmp_path / "r.json", tmp_path / "m.txt"
    write_tight_trace(trace)
    argv = ["replay", str(trace), "--num-blocks", "200", "--storage", "none", "--no-progress"]
    argv += ["--json", str(report_path), "--metrics-out", str(metrics_path), "--metrics-port", "0"]
    assert main(argv) == 0
    data = json.loads(report_path.read_text())
    samples = {}
    for family in text_string_to_metric_families(metrics_path.read_text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert data["preemptions"] > 0 and data["evictions"] > 0  # not vacuous
    assert value(samples, "akv_sequences_preempted_total") == data["preemptions"]
    assert value(samples, "akv_blocks_evicted_total") == data["evictions"]
    assert value(samples, "akv_blocks_copied_on_write_total") == data["cow_copies"]
    assert value(samples, "akv_prefix_cache_queries_tokens_total") == data["prompt_tokens"]
    assert value(samples, "akv_prefix_cache_hits_tokens_total") == data["cached_tokens"]
    assert value(samples, "akv_prefix_cache_resumed_queries_tokens_total") == data["readmit_prompt_tokens"]
    assert value(samples, "akv_prefix_cache_resumed_hits_tokens_total") == data["readmit_cached_tokens"]
    assert value(samples, "akv_step_latency_seconds_count") == data["decode_steps"]
    assert value(samples, "akv_blocks", state="active") == 0


@pytest.mark.anyio
async def test_served_metrics_parse_and_agree_with_stats(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as kv:
        await kv.add_sequence("a", list(range(1, 10)))
        stats = await kv.stats()
        with serve_metrics(kv.metrics_registry, 0) as port:
            url = f"http://127.0.0.1:{port}/metrics"
            text = await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert counters(samples) == {
        **NO_COUNTS,
        "blocks_allocated": 3,
        "prefix_cache_queries_tokens": 9,
        "sequences_added": 1,
    }
    assert block_gauges(samples) == {"free": 13, "active": 3, "cached": 0, "in_flight": 0}
    assert_agrees(samples, stats)


@pytest.mark.anyio
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_scrape_right_after_wait_copies_shows_no_block_in_flight(tiny_config, monkeypatch, num_shards) -> None:
    real_copy = KVStorage._copy_unchecked
    go = threading.Event()

    def gated_copy(self: KVStorage, src, dst) -> None:
        go.wait(timeout=60)  # on the copy thread: the copy runs once the test has freed its source
        real_copy(self, src, dst)

    monkeypatch.setattr(KVStorage, "_copy_unchecked", gated_copy)
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=num_shards)) as kv:
        await kv.add_sequence("a", list(range(1, 7)))  # 2 blocks, partial tail
        await kv.fork("a", ["b"])
        await kv.append("a", [7])  # a copies the shared tail; b keeps the original (the copy's source)
        await kv.free("b")  # frees the source while the copy is pending: it goes in flight
        go.set()
        await kv.wait_copies()
        assert block_gauges(scrape(kv.metrics_registry))["in_flight"] == 0
        assert kv.blocks_in_use == 2  # a's two blocks; the copy's source is free, not in flight


@pytest.mark.anyio
async def test_host_tier_counters_and_gauges_agree_with_stats(tiny_config) -> None:
    """Demotions, promotions, host drops and swaps show in the scrape exactly as in stats()."""
    async with KVCacheManager(tiny_config(num_blocks=16, host_blocks=8)) as kv:
        for i in range(6):  # 3 full blocks each, all different: the device fills, the host takes the rest
            prompt = list(range(100 * i, 100 * i + 13))
            await (await kv.step(admits=[Admit(seq_id=i, prompt=prompt, prefill_done=True)])).copies.wait()
            await kv.free(i)
        result = await kv.step(admits=[Admit(seq_id="again", prompt=list(range(13)), prefill_done=True)])  # host hit
        await result.copies.wait()  # as a runner does (each step above too): else blocks are still in flight
        await kv.swap_out("again")
        await kv.swap_in("again")
        await kv.wait_copies()
        stats = await kv.stats()
        assert stats.demoted_blocks and stats.promoted_blocks and stats.host_hit_tokens == 12
        assert (stats.swapped_out, stats.swapped_in) == (1, 1)
        assert_agrees(scrape(kv.metrics_registry), stats)
