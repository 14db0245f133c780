"""CacheAwareRouter: picking by cached prefix and load, applying removals and clears, gaps and resync, refusals."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

from akv.core.block_key import chain_keys
from akv.errors import EventsGap, InvalidInput, InvalidTokens
from akv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedKey,
    EventBatch,
    EventHub,
    EventLog,
    EventsDropped,
    KeyIndex,
    write_jsonl,
)
from akv.routing import CacheAwareRouter

BS = 4
A = list(range(1, 17))  # 4 blocks
B = [*range(1, 9), *range(90, 98)]  # shares A's first 2 blocks


def stored(prompt: list[int], namespace=None, medium: str = "device", blocks: int | None = None) -> BlockStored:
    keys = chain_keys(prompt, BS, namespace)[:blocks]
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=None,
        token_ids=prompt[: len(keys) * BS],
        block_size=BS,
        medium=medium,
        namespace=namespace,
    )


def batch(seq: int, *events) -> EventBatch:
    return EventBatch(seq=seq, ts=0.0, events=events)


def probe(prompt: list[int]) -> list[int]:
    """``prompt`` and one more token, so every one of its blocks can hit."""
    return [*prompt, 0]


def test_longest_prefix_counts_like_lookup_and_pick_takes_the_longest() -> None:
    router = CacheAwareRouter(["x", "y"], block_size=BS)
    router.apply("x", batch(1, stored(A, blocks=2)))
    router.apply("y", batch(1, stored(B)))
    assert router.longest_prefix("x", probe(A)) == 8
    assert router.longest_prefix("y", probe(B)) == 16
    assert router.longest_prefix("y", B) == 12  # the block holding the last token is always computed
    assert router.longest_prefix("y", probe(A)) == 8
    assert router.longest_prefix("y", probe(B), "other-namespace") == 0
    assert router.longest_prefix("y", [1, 2]) == 0
    assert router.pick(probe(B)) == "y"
    assert router.pick(probe(A), running={"y": 5}) == "x"  # both hold 8 tokens: fewer running wins
    assert router.pick(probe(A)) == "x"  # a full tie: the first registered
    assert router.pick([5, 5, 5, 5, 5]) == "x"
    with pytest.raises(InvalidTokens):
        router.pick([-1, 2])


def test_the_load_cap_skips_busy_instances_unless_all_are_busy() -> None:
    router = CacheAwareRouter(["x", "y", "z"], block_size=BS, max_running=4)
    router.apply("y", batch(1, stored(A)))
    router.apply("z", batch(1, stored(A, blocks=1)))
    assert router.pick(probe(A), running={"x": 0, "y": 4, "z": 0}) == "y"  # at the cap is not above it
    assert router.pick(probe(A), running={"x": 0, "y": 5, "z": 1}) == "z"
    assert router.pick(probe(A), running={"x": 9, "y": 5, "z": 6}) == "y"  # all above: cache wins again
    for bad in ({"w": 1}, {"x": -1}, {"x": 1.0}, [("x", 1)]):
        with pytest.raises(InvalidInput):
            router.pick(probe(A), running=bad)


def test_removals_clears_media_and_holders_are_applied() -> None:
    router = CacheAwareRouter(["x"], block_size=BS)
    keys = chain_keys(A, BS)
    router.apply("x", batch(1, stored(A), stored(A, blocks=2)))  # two shards hold the first two blocks
    router.apply("x", batch(2, BlockRemoved(block_hashes=[keys[3], keys[2], keys[1]], medium="device")))
    assert router.longest_prefix("x", probe(A)) == 8  # the other shard still holds block 1
    router.apply("x", batch(3, BlockRemoved(block_hashes=[keys[1]], medium="device"), stored(A, medium="host")))
    assert router.longest_prefix("x", probe(A)) == 16
    assert router.longest_prefix("x", probe(A), medium="device") == 4
    assert router.index("x").keys("device") == {keys[0]}
    router.apply("x", batch(4, AllBlocksCleared()))
    assert router.longest_prefix("x", probe(A)) == 0 and router.index("x").keys() == set()


def test_duplicate_out_of_order_and_unfitting_batches_are_refused_with_the_index_unchanged() -> None:
    router = CacheAwareRouter(["x"], block_size=BS)
    keys = chain_keys(A, BS)
    router.apply("x", batch(1, stored(A, blocks=2)))
    router.apply("x", batch(2, stored(B)))
    before = router.index("x").entries()
    for bad in (
        batch(2, AllBlocksCleared()),  # a duplicate
        batch(1, AllBlocksCleared()),  # out of order
        batch(3, AllBlocksCleared(), BlockRemoved(block_hashes=[keys[3]], medium="device")),  # not held
        batch(3, stored(A), BlockRemoved(block_hashes=[keys[0]], medium="host")),  # not held in that medium
        batch(
            3,
            BlockStored(
                block_hashes=[keys[0]], parent_block_hash=None, token_ids=[1] * 8, block_size=8, medium="device"
            ),
        ),
    ):
        with pytest.raises(InvalidInput):
            router.apply("x", bad)
        assert router.index("x").entries() == before
        assert (router.index("x").applied_seq, router.index("x").stale) == (2, False)
    with pytest.raises(InvalidInput):
        router.apply("x", "not a batch")
    assert router.apply("x", batch(3, AllBlocksCleared()))


def test_a_gap_makes_the_instance_stale_until_a_resync_then_kept_batches_apply() -> None:
    log, index = EventLog(), KeyIndex(32, BS)
    router = CacheAwareRouter(["x"], block_size=BS)
    rows = np.array(A, dtype=np.int32).reshape(-1, BS)
    router.apply("x", log.publish(index.stored_events([0, 1], [None, 0], rows[:2], [None, None])))
    log.publish(index.stored_events([2], [1], rows[2:3], [None]))  # seq 2: missed by the router
    snapshot, as_of = index.cached_keys(), log.last_seq
    third = log.publish(index.stored_events([3], [2], rows[3:4], [None]))
    assert not router.apply("x", batch(2, EventsDropped(from_seq=2, to_seq=2)))
    assert router.index("x").stale and router.longest_prefix("x", probe(A)) == 0
    assert not router.apply("x", third)  # kept while stale
    with pytest.raises(EventsGap):
        router.resync("x", snapshot[:1], 0)  # older than what the index had applied
    assert router.index("x").stale
    router.resync("x", snapshot, as_of)
    index_x = router.index("x")
    assert (index_x.stale, index_x.applied_seq) == (False, 3)
    assert router.longest_prefix("x", probe(A)) == 16
    fourth = log.publish(index.removed_events([3]))
    assert router.apply("x", fourth) and router.longest_prefix("x", probe(A)) == 12


def test_a_snapshot_older_than_a_kept_gap_is_refused_and_a_skipped_number_is_a_gap() -> None:
    router = CacheAwareRouter(["x"], block_size=BS)
    router.apply("x", batch(1, stored(A, blocks=1)))
    assert not router.apply("x", batch(3, stored(B)))  # seq 2 never came
    with pytest.raises(EventsGap) as info:
        router.resync("x", [], 1)
    assert (info.value.from_seq, info.value.to_seq) == (2, 2)
    assert not router.apply("x", batch(6, EventsDropped(from_seq=4, to_seq=6)))
    with pytest.raises(EventsGap):
        router.resync("x", [], 5)
    with pytest.raises(InvalidInput):
        router.resync("x", [("device", bytes(16))], 6)
    keys = chain_keys(A, BS)
    router.resync("x", [CachedKey(block_hash=keys[0], parent_block_hash=None, namespace=None, medium="device")], 6)
    assert router.longest_prefix("x", probe(A)) == 4
    with pytest.raises(InvalidInput):
        router.apply("x", batch(5, AllBlocksCleared()))  # seq 6 came already (the marker)
    assert router.apply("x", batch(7, AllBlocksCleared())) and router.longest_prefix("x", probe(A)) == 0


def test_a_lagging_stream_skips_what_the_snapshot_covers() -> None:
    router = CacheAwareRouter(["x"], block_size=BS)
    keys = chain_keys(A, BS)
    snapshot = [
        CachedKey(block_hash=k, parent_block_hash=p, namespace=None, medium="device")
        for k, p in zip(keys, [None, *keys])
    ]
    router.resync("x", snapshot, 5)
    assert router.apply("x", batch(4, AllBlocksCleared()))  # covered: skipped
    assert router.longest_prefix("x", probe(A)) == 16
    assert router.apply("x", batch(6, BlockRemoved(block_hashes=[keys[3]], medium="device")))
    assert router.longest_prefix("x", probe(A)) == 12


def test_a_router_fed_from_a_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        write_jsonl(
            out,
            [
                batch(1, stored(A, "ns")),
                batch(2, BlockRemoved(block_hashes=chain_keys(A, BS, "ns")[3:], medium="device")),
            ],
        )
    router = CacheAwareRouter(["x"], block_size=BS)
    assert router.apply_jsonl("x", path)
    assert router.longest_prefix("x", probe(A), "ns") == 12


def test_bad_router_arguments_are_refused() -> None:
    with pytest.raises(InvalidInput):
        CacheAwareRouter(["x", "x"], block_size=BS)
    for kwargs in ({"block_size": 0}, {"block_size": BS, "max_running": -1}, {"block_size": BS, "max_pending": -1}):
        with pytest.raises(InvalidInput):
            CacheAwareRouter(["x"], **kwargs)
    router = CacheAwareRouter(block_size=BS)
    with pytest.raises(InvalidInput):
        router.pick(A)
    router.add_instance(("host", 1))
    for call in (
        lambda: router.longest_prefix("nope", A),
        lambda: router.apply(["unhashable"], batch(1, AllBlocksCleared())),
        lambda: router.longest_prefix(("host", 1), A, namespace=1.5),
        lambda: router.longest_prefix(("host", 1), [1], namespace=[1]),
        lambda: router.remove_instance("nope"),
    ):
        with pytest.raises(InvalidInput):
            call()
    router.remove_instance(("host", 1))
    assert router.instances == ()


@pytest.mark.parametrize("max_pending", [0, 2])
def test_a_stale_index_keeps_at_most_max_pending_batches_and_refuses_a_snapshot_older_than_what_it_forgot(
    max_pending: int,
) -> None:
    router = CacheAwareRouter(["x"], block_size=BS, max_pending=max_pending)
    keys = chain_keys(A, BS)
    router.apply("x", batch(1, stored(A, blocks=1)))
    assert not router.apply("x", batch(2, EventsDropped(from_seq=2, to_seq=2)))
    router.apply("x", batch(3, stored(B, blocks=2)))
    router.apply("x", batch(4, BlockRemoved(block_hashes=[keys[1]], medium="device")))
    forgot = 4 if max_pending == 0 else 2  # the newest batch it could not keep
    with pytest.raises(EventsGap) as info:
        router.resync("x", [], forgot - 1)
    assert info.value.to_seq == forgot
    snapshot = [CachedKey(block_hash=keys[0], parent_block_hash=None, namespace=None, medium="device")]
    router.resync("x", snapshot, forgot)
    assert router.index("x").applied_seq == 4
    assert router.longest_prefix("x", probe(A)) == 4  # stored by 3, its second block removed by 4
    holders = router.index("x").entries()[("device", keys[0])][0]
    assert holders == (1 if max_pending == 0 else 2)  # the snapshot's, and batch 3's when it was kept


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.anyio
async def test_a_router_task_fed_by_a_subscription_follows_the_cache() -> None:
    """In process: one task applies a subscription's batches while steps publish; a gap is resynced."""
    hub, index = EventHub(), KeyIndex(32, BS)
    router = CacheAwareRouter(["x"], block_size=BS)
    rows = np.array(A + B[8:], dtype=np.int32).reshape(-1, BS)
    resynced_at: list[int] = []

    async def follow() -> None:
        async with hub.subscribe(buffer=1) as sub:
            async for got in sub:
                if not router.apply("x", got):  # a gap: a snapshot as of now, then what comes after it
                    router.resync("x", index.cached_keys(), hub.log.last_seq)
                    resynced_at.append(got.seq)

    with anyio.fail_after(10):  # hang guard
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await anyio.wait_all_tasks_blocked()
            hub.publish(index.stored_events([0, 1], [None, 0], rows[:2], [None, None]))
            await anyio.wait_all_tasks_blocked()
            assert router.longest_prefix("x", probe(A)) == 8
            for block in (
                2,
                3,
            ):  # three batches while the follower does not run: one to its waiting receive, one buffered, a gap
                hub.publish(index.stored_events([block], [block - 1], rows[block : block + 1], [None]))
            hub.publish(index.stored_events([4, 5], [1, 4], rows[4:6], [None, None]))
            await anyio.wait_all_tasks_blocked()
            assert router.longest_prefix("x", probe(A)) == 16 and router.longest_prefix("x", probe(B)) == 16
            hub.publish(index.removed_events([5, 3]))
            await anyio.wait_all_tasks_blocked()
            assert (router.longest_prefix("x", probe(A)), router.longest_prefix("x", probe(B))) == (12, 12)
            hub.close()
    assert resynced_at == [4]  # the marker for batch 4
    assert router.index("x").applied_seq == hub.log.last_seq == 5 and not router.index("x").stale
