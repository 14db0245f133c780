"""save_snapshot / load_snapshot through the manager: the prefix cache, its eviction order and its K/V come back."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import structlog
import torch

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.core.eviction_policy import EVICTION_POLICIES
from akv.errors import InvalidInput, SnapshotError
from akv.storage.snapshot_reader import load_snapshot as read_snapshot
from akv.storage.snapshot_record import hottest_that_fit

BS = 4


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


def config(**fields) -> KVCacheConfig:
    base = {"num_blocks": 96, "block_size": BS, "vocab_size": 1000, "storage": "none", "debug_invariants": True}
    return KVCacheConfig(**{**base, **fields})


def prompts(num: int = 8) -> list[np.ndarray]:
    """Prompts sharing prefixes: a common first block, then 4 families, then private tails."""
    rng = np.random.default_rng(0)
    families = [rng.integers(0, 1000, 3 * BS).astype(np.int32) for _ in range(4)]
    head = rng.integers(0, 1000, BS).astype(np.int32)
    return [
        np.concatenate([head, families[i % 4], rng.integers(0, 1000, 2 * BS + 1).astype(np.int32)]) for i in range(num)
    ]


async def fill(kv: KVCacheManager, items: list[np.ndarray], *, keep_last: bool = False, kv_seed: int | None = None):
    """Admit, (write K/V,) commit and free each prompt; the last stays live with ``keep_last``."""
    for i, prompt in enumerate(items):
        cached = await kv.add_sequence(i, prompt)
        if kv_seed is not None:
            info = await kv.sequence(i)
            ids = torch.tensor(info.block_ids, dtype=torch.int64)
            gen = torch.Generator().manual_seed(kv_seed + i)
            for cache in kv.storage.kv_caches:
                fresh = torch.randn(cache[:, ids].shape, generator=gen, dtype=cache.dtype)
                mask = torch.arange(len(ids)) >= cached // BS  # the model runner writes only the computed blocks
                cache[:, ids[mask]] = fresh[:, mask]
        await kv.commit(i, len(prompt) - cached)
        if not (keep_last and i == len(items) - 1):
            await kv.free(i)


def ranked_keys(directory, policy: str) -> list[bytes]:
    """The saved blocks' keys in the order the policy evicts them (its key of the saved statistics)."""
    blocks = read_snapshot(directory).blocks
    key = EVICTION_POLICIES[policy].key
    order = sorted(range(blocks.num_blocks), key=lambda r: key(int(blocks.num_hits[r]), int(blocks.last_release[r])))
    return [blocks.keys[row].tobytes() for row in order]


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["lru", "slru", "lfu"])
async def test_round_trip_keeps_every_hit_and_the_eviction_order(tmp_path, policy) -> None:
    items = prompts()
    async with KVCacheManager(config(eviction_policy=policy)) as kv:
        await fill(kv, items, keep_last=True)
        await kv.add_sequence("again", items[1])  # a hit: hit counts differ between blocks
        await kv.free("again")
        before = [await kv.lookup(p) for p in items]
        await kv.save_snapshot(tmp_path / "a")
    async with KVCacheManager(config(eviction_policy=policy)) as kv:
        loaded = await kv.load_snapshot(tmp_path / "a")
        await kv.check()
        assert loaded.dropped_blocks == 0 and loaded.loaded_blocks == loaded.saved_blocks > 0
        registry = kv.metrics_registry
        assert registry.get_sample_value("akv_snapshot_blocks_total", {"op": "loaded"}) == loaded.loaded_blocks
        assert registry.get_sample_value("akv_snapshot_load_seconds_count") == 1
        assert [await kv.lookup(p) for p in items] == before
        stats = await kv.stats()
        assert (stats.cached, stats.active, stats.in_flight) == (loaded.loaded_blocks, 0, 0)
        await kv.save_snapshot(tmp_path / "b")
    a, b = read_snapshot(tmp_path / "a").blocks, read_snapshot(tmp_path / "b").blocks
    assert ranked_keys(tmp_path / "a", policy) == ranked_keys(tmp_path / "b", policy)
    hits_a = dict(zip(map(bytes, a.keys), a.num_hits.tolist(), strict=True))
    assert hits_a == dict(zip(map(bytes, b.keys), b.num_hits.tolist(), strict=True))
    assert policy == "lru" or max(hits_a.values()) > 0


@pytest.mark.anyio
async def test_smaller_pool_loads_the_hottest_ancestor_closed_blocks(tmp_path) -> None:
    items = prompts()
    async with KVCacheManager(config()) as kv:
        await fill(kv, items)
        await kv.save_snapshot(tmp_path / "big")
    saved = read_snapshot(tmp_path / "big").blocks
    async with KVCacheManager(config(num_blocks=12)) as kv:
        loaded = await kv.load_snapshot(tmp_path / "big")
        await kv.check()
        room = 12 - config(num_blocks=12).watermark_blocks(12)[1]  # the eviction loop's headroom stays free
        assert loaded.loaded_blocks == room and loaded.dropped_blocks == saved.num_blocks - room
        await kv.save_snapshot(tmp_path / "small")
    rows, _ = hottest_that_fit(saved, room)
    kept = {saved.keys[r].tobytes() for r in rows.tolist()}
    assert {k.tobytes() for k in read_snapshot(tmp_path / "small").blocks.keys} == kept


@pytest.mark.anyio
async def test_two_shards_round_trip(tmp_path) -> None:
    items = prompts()
    async with KVCacheManager(config(num_shards=2)) as kv:
        await fill(kv, items)
        before = [await kv.lookup(p) for p in items]
        await kv.save_snapshot(tmp_path)
    async with KVCacheManager(config(num_shards=2)) as kv:
        await kv.load_snapshot(tmp_path)
        await kv.check()
        assert [await kv.lookup(p) for p in items] == before
        assert sum(before) > 0


@pytest.mark.anyio
async def test_restored_hit_reads_back_the_saved_kv(tmp_path) -> None:
    items = prompts(4)
    cfg = config(storage="tensors")
    expected = {}
    async with KVCacheManager(cfg) as kv:
        await fill(kv, items, kv_seed=7)
        for i, prompt in enumerate(items):
            await kv.add_sequence(("read", i), prompt)
            table = torch.tensor((await kv.sequence(("read", i))).block_ids)
            n = (len(prompt) - 1) // BS * BS
            expected[i] = [kv.storage.gather(layer, table, n) for layer in range(cfg.model.num_layers)]
            await kv.free(("read", i))
        await kv.save_snapshot(tmp_path)
    async with KVCacheManager(cfg) as kv:
        for cache in kv.storage.kv_caches:
            cache.fill_(-1.0)  # nothing left over from a pool that happened to hold the same values
        await kv.load_snapshot(tmp_path)
        for i, prompt in enumerate(items):
            n = (len(prompt) - 1) // BS * BS
            assert await kv.add_sequence(i, prompt) == n
            table = torch.tensor((await kv.sequence(i)).block_ids)
            for layer in range(cfg.model.num_layers):
                key, value = kv.storage.gather(layer, table, n)
                assert torch.equal(key, expected[i][layer][0]) and torch.equal(value, expected[i][layer][1])


@pytest.mark.anyio
async def test_load_is_refused_with_a_live_sequence_and_for_a_bad_snapshot(tmp_path) -> None:
    items = prompts(4)
    async with KVCacheManager(config()) as kv:
        await fill(kv, items)
        await kv.save_snapshot(tmp_path / "good")
    (tmp_path / "bad").mkdir()
    async with KVCacheManager(config()) as kv:
        await kv.add_sequence("live", items[0])
        with pytest.raises(InvalidInput, match="live"):
            await kv.load_snapshot(tmp_path / "good")
        await kv.commit("live", len(items[0]))
        await kv.free("live")
        before = await kv.stats()
        with pytest.raises(SnapshotError) as missing:
            await kv.load_snapshot(tmp_path / "bad")
        assert missing.value.cause == "missing"
        manifest = next((tmp_path / "good").glob("gen-*/blocks.safetensors"))
        data = bytearray(manifest.read_bytes())
        data[-1] ^= 1
        manifest.write_bytes(bytes(data))
        with pytest.raises(SnapshotError) as corrupt:
            await kv.load_snapshot(tmp_path / "good")
        assert corrupt.value.cause == "corrupt"
        registry = kv.metrics_registry
        for cause in ("missing", "corrupt"):
            assert registry.get_sample_value("akv_snapshot_refusals_total", {"cause": cause}) == 1
        assert registry.get_sample_value("akv_snapshot_load_seconds_count") == 0
        after = await kv.stats()
        assert (after.free, after.cached, after.prefix_cache_blocks) == (before.free, before.cached, 6)
        assert before.cached == 6
        with pytest.raises(InvalidInput):
            await kv.load_snapshot(b"\x00")
        await kv.check()


@pytest.mark.anyio
async def test_metadata_snapshot_is_foreign_to_a_pool_with_kv(tmp_path) -> None:
    async with KVCacheManager(config()) as kv:
        await fill(kv, prompts(2))
        await kv.save_snapshot(tmp_path)
    async with KVCacheManager(config(storage="tensors")) as kv:
        with pytest.raises(SnapshotError) as err:
            await kv.load_snapshot(tmp_path)
        assert err.value.cause == "foreign"
        assert (await kv.stats()).prefix_cache_blocks == 0


@pytest.mark.anyio
async def test_save_on_exit_and_load_on_enter(tmp_path) -> None:
    items = prompts(4)
    async with KVCacheManager(config(snapshot_dir=tmp_path, save_on_exit=True)) as kv:
        await fill(kv, items)
        before = [await kv.lookup(p) for p in items]
    async with KVCacheManager(config(snapshot_dir=str(tmp_path), load_on_enter=True)) as kv:
        assert [await kv.lookup(p) for p in items] == before


@pytest.mark.anyio
async def test_load_on_enter_starts_cold_on_a_refused_snapshot_unless_required(tmp_path) -> None:
    with structlog.testing.capture_logs() as logs:
        async with KVCacheManager(config(snapshot_dir=tmp_path / "none", load_on_enter=True)) as kv:
            assert (await kv.stats()).prefix_cache_blocks == 0
    events = {(e["event"], e["log_level"]) for e in logs}
    assert {("snapshot.refused", "warning"), ("snapshot.cold_start", "warning")} <= events
    manager = KVCacheManager(config(snapshot_dir=tmp_path / "none", load_on_enter=True, require_snapshot=True))
    with pytest.raises(SnapshotError):
        async with manager:
            pytest.fail("entered without the required snapshot")


def test_snapshot_config_fields_are_validated(tmp_path) -> None:
    assert config(snapshot_dir=tmp_path).snapshot_dir == str(tmp_path)
    with pytest.raises(InvalidInput, match="snapshot_dir"):
        config(snapshot_dir="")
    with pytest.raises(InvalidInput, match="snapshot_dir"):
        config(snapshot_dir=3)
    with pytest.raises(InvalidInput, match="need a snapshot_dir"):
        config(save_on_exit=True)
    with pytest.raises(InvalidInput, match="require_snapshot"):
        config(snapshot_dir=tmp_path, require_snapshot=True)
    with pytest.raises(InvalidInput, match="load_on_enter"):
        config(snapshot_dir=tmp_path, load_on_enter=1)


@pytest.mark.anyio
async def test_steps_are_served_during_a_save_and_held_blocks_are_not_evicted(tmp_path, monkeypatch) -> None:
    """The save's writer thread waits at a gate; meanwhile steps run and need room the held blocks would give."""
    import threading

    import akv.manager_snapshot as manager_snapshot

    gate, waiting = threading.Event(), threading.Event()
    real = manager_snapshot.write_snapshot

    def gated(*args):
        waiting.set()
        gate.wait(60)  # hang guard: the test opens it
        return real(*args)

    monkeypatch.setattr(manager_snapshot, "write_snapshot", gated)
    cfg = config(storage="tensors", num_blocks=40)
    items = prompts(4)
    expected = {}
    async with KVCacheManager(cfg) as kv:
        await fill(kv, items, kv_seed=5)
        for i, prompt in enumerate(items):
            await kv.add_sequence(("read", i), prompt)
            table = torch.tensor((await kv.sequence(("read", i))).block_ids)
            expected[i] = [kv.storage.gather(layer, table, 24) for layer in range(cfg.model.num_layers)]
            await kv.free(("read", i))
        before = await kv.stats()
        fit = before.free // 7  # admissions the free blocks hold; the rest would need evictions
        assert 0 < fit < 4
        async with anyio.create_task_group() as tg:
            tg.start_soon(kv.save_snapshot, tmp_path)
            await anyio.to_thread.run_sync(waiting.wait, 60)
            others = [np.arange(500 + 30 * j, 525 + 30 * j, dtype=np.int32) for j in range(4)]
            outcomes = []
            try:
                for j, prompt in enumerate(others):  # 7 blocks each; only the free blocks are room now
                    result = await kv.step(admits=[Admit(seq_id=("new", j), prompt=prompt)])
                    outcomes.append(("new", j) in result.rejected)
                assert outcomes == [False] * fit + [True] * (4 - fit)  # served, not stalled; cached blocks held
                assert (await kv.stats()).cached == before.cached
            finally:
                gate.set()
        for j in range(fit):
            await kv.free(("new", j))
        for j, prompt in enumerate(others):  # holds released: room by eviction again
            assert await kv.add_sequence(("after", j), prompt) == 0
    async with KVCacheManager(cfg) as kv:
        await kv.load_snapshot(tmp_path)
        for i, prompt in enumerate(items):
            assert await kv.add_sequence(i, prompt) == 24
            table = torch.tensor((await kv.sequence(i)).block_ids)
            for layer in range(cfg.model.num_layers):
                key, value = kv.storage.gather(layer, table, 24)
                assert torch.equal(key, expected[i][layer][0]) and torch.equal(value, expected[i][layer][1])


@pytest.mark.anyio
async def test_a_failed_save_is_typed_releases_its_holds_and_the_manager_keeps_serving(tmp_path) -> None:
    cfg = config(storage="tensors", num_blocks=40)
    items = prompts(4)
    (tmp_path / "file").write_text("not a directory")
    async with KVCacheManager(cfg) as kv:
        await fill(kv, items, kv_seed=1)
        with pytest.raises(SnapshotError) as err:
            await kv.save_snapshot(tmp_path / "file")
        assert err.value.cause == "io"
        assert (tmp_path / "file").read_text() == "not a directory"
        with pytest.raises(InvalidInput):
            await kv.save_snapshot(3)
        others = [np.arange(500 + 30 * j, 525 + 30 * j, dtype=np.int32) for j in range(4)]
        for j, prompt in enumerate(others):  # needs the cached blocks evicted: no hold is left behind
            assert await kv.add_sequence(("new", j), prompt) == 0
        await kv.check()
        assert await kv.save_snapshot(tmp_path / "ok") == 1
