"""``akv replay --events-out``: the JSON lines rebuild exactly the final cached set."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from akv import KVCacheConfig, KVCacheManager
from akv.cli import main
from akv.events.index import InstanceIndex
from akv.events.jsonl import read_jsonl
from akv.replay import ReplayOptions, replay
from akv.replay.events_out import replay_with_events
from akv.trace import default_trace_path, read_trace


async def _replay_events(cfg: KVCacheConfig, limit: int, path) -> tuple:
    """Replay the first ``limit`` requests writing events to ``path``: (report, final, as_of, keys, now, stats)."""
    requests = read_trace(default_trace_path(), limit=limit)
    async with KVCacheManager(cfg) as kv:
        report, final, as_of = await replay_with_events(kv, lambda: replay(kv, requests, ReplayOptions()), path)
        keys, now = await kv.cached_keys()
        return report, final, as_of, keys, now, await kv.stats()


@pytest.mark.anyio
async def test_events_file_rebuilds_the_final_cached_set(tmp_path) -> None:
    # A tight pool of two shards: the replay evicts (on demand and in the background).
    cfg = KVCacheConfig(num_blocks=1200, block_size=16, storage="none", num_shards=2, enable_events=True)
    path = tmp_path / "events.jsonl"
    report, final, as_of, keys, now, stats = await _replay_events(cfg, 60, path)
    assert report.evictions > 0
    assert now == as_of
    batches = list(read_jsonl(path))
    assert [b.seq for b in batches] == list(range(1, as_of + 1))
    index = InstanceIndex(16)
    for batch in batches:
        assert index.apply(batch)
    rebuilt = {key: holders for (_m, key), (holders, _p, _ns) in index.entries().items()}
    assert rebuilt == dict(Counter(k.block_hash for k in keys))
    assert final == {"device": stats.prefix_cache_blocks} == {"device": len(keys)}


def test_cli_events_out_and_final_cached_blocks(tmp_path, capsys) -> None:
    events, report = tmp_path / "e.jsonl", tmp_path / "r.json"
    args = ["replay", "--limit", "40", "--num-blocks", "1500", "--storage", "none", "--no-progress"]
    assert main([*args, "--events-out", str(events), "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    index = InstanceIndex(16)
    for batch in read_jsonl(events):
        assert index.apply(batch)
    assert data["final_cached_blocks"] == {"device": len(index.keys())}
    assert data["final_cached_blocks"]["device"] > 0
    capsys.readouterr()


@pytest.mark.anyio
async def test_events_file_rebuilds_the_final_cached_set_per_medium_with_a_host_tier(tmp_path) -> None:
    # A small device pool and a smaller host tier: the replay demotes, promotes and drops host blocks.
    cfg = KVCacheConfig(num_blocks=600, block_size=16, storage="none", host_blocks=500, enable_events=True)
    path = tmp_path / "events.jsonl"
    _, final, as_of, keys, now, stats = await _replay_events(cfg, 40, path)
    assert stats.demoted_blocks > 0 and stats.promoted_blocks > 0 and stats.host_evicted_blocks > 0
    assert now == as_of
    index = InstanceIndex(16)
    for batch in read_jsonl(path):
        assert index.apply(batch)
    rebuilt = {slot: holders for slot, (holders, _p, _ns) in index.entries().items()}
    assert rebuilt == dict(Counter((k.medium, k.block_hash) for k in keys))
    assert final == {"device": stats.prefix_cache_blocks - stats.host_cached, "host": stats.host_cached}
    assert final == {medium: len(index.keys(medium)) for medium in final}


def test_cli_events_out_with_host_blocks(tmp_path, capsys) -> None:
    events, report = tmp_path / "e.jsonl", tmp_path / "r.json"
    args = ["replay", "--limit", "40", "--num-blocks", "600", "--host-blocks", "500", "--storage", "none"]
    assert main([*args, "--no-progress", "--events-out", str(events), "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    index = InstanceIndex(16)
    for batch in read_jsonl(events):
        assert index.apply(batch)
    assert data["final_cached_blocks"] == {medium: len(index.keys(medium)) for medium in ("device", "host")}
    assert data["final_cached_blocks"]["host"] > 0
    capsys.readouterr()
