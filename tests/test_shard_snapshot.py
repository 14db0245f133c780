"""Pool shards publish an immutable snapshot after every message; nobody outside a shard reads its state.

The readers (the manager's gauges, ``stats``, placement and lookup routing,
the eviction loop, the Prometheus scrape thread) read
``PoolShardActor.snapshot``, a tuple replaced by one attribute assignment;
``block_refcounts()`` goes through each shard's own audit call, which also
works once the manager has crashed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from akv import Admit, KVCacheManager
from akv.actors.messages import Check, Stats
from akv.actors.pool_shard import PoolShardActor
from akv.actors.shard_snapshot import ShardSnapshot
from akv.errors import ActorCrashed

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


def adds_up(snap: ShardSnapshot) -> bool:
    """Every block of the shard is in exactly one state, and reservations hold free blocks only."""
    return snap.free + snap.active + snap.cached + snap.in_flight == snap.num_blocks and 0 <= snap.reserved <= snap.free


@pytest.mark.parametrize("num_shards", [1, 2])
async def test_every_message_publishes_a_snapshot_equal_to_a_fresh_stats_reply(tiny_config, num_shards: int) -> None:
    """After each call, each shard's snapshot is a newer one when it served a message, adds up, and is
    what a ``Stats`` ask (served after it, once every copy has run) publishes but for the version; the
    gauges sum the snapshots."""
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=num_shards)) as kv:
        calls = [
            lambda: kv.add_sequence("a", list(range(10))),
            lambda: kv.add_sequence("b", [1, 2, 3], max_new_tokens=6),
            lambda: kv.commit("a", 10),
            lambda: kv.fork("a", ["a1"]),
            lambda: kv.append("a1", [5]),
            lambda: kv.lookup(list(range(12))),
            lambda: kv.free("a"),
            lambda: kv.evict(1),
        ]
        for call in calls:
            versions = [(s.snapshot.version, s.messages_handled) for s in kv._shards]
            await call()
            for shard, (version, handled) in zip(kv._shards, versions, strict=True):
                snap = shard.snapshot
                assert isinstance(snap, ShardSnapshot) and adds_up(snap)
                assert (snap.version > version) == (shard.messages_handled > handled)
            await kv.wait_copies()  # a copy finishing later would change what Stats settles
            gauges = (kv.usage, kv.blocks_in_use, kv.blocks_available)
            published = [s.snapshot for s in kv._shards]
            replies = [await shard.ask(Stats()) for shard in kv._shards]
            assert [r._replace(version=0) for r in replies] == [p._replace(version=0) for p in published]
            stats = await kv.stats()
            assert gauges == (
                stats.usage,
                stats.active + stats.in_flight,
                stats.free - stats.reserved_blocks + stats.cached,
            )
            assert stats.num_sequences == sum(r.num_sequences for r in replies)
        await kv.check()


def test_no_reader_outside_a_shard_reads_its_state() -> None:
    """The manager, its mixins, the eviction loop and akv.obs name no ``shard.state``: they read snapshots."""
    files = [*ROOT.glob("akv/manager*.py"), ROOT / "akv/actors/eviction_loop.py", *ROOT.glob("akv/obs/*.py")]
    assert len(files) >= 8
    reads = [
        f"{f.name}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1) if ".state." in line
    ]
    assert reads == []


async def test_a_scrape_thread_reads_whole_snapshots_while_steps_run(tiny_config) -> None:
    """A thread reading the metrics snapshot in a loop while two shards admit, commit and free: every
    read adds up to the pool (a shard's counts are one tuple, never half of one step and half of the next)."""
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=2)) as kv:
        stop, reads, bad = threading.Event(), [0], []

        def scrape() -> None:
            while not stop.wait(0.0005):
                snap = kv._metrics_snapshot()
                if sum(snap.blocks.values()) != 32:
                    bad.append(snap.blocks)
                reads[0] += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, scrape)
            try:
                for round_ in range(100):
                    ids = [f"r{round_}-{i}" for i in range(3)]
                    admits = [Admit(seq_id=s, prompt=[round_ % 7, i, 1, 2, 3, 4]) for i, s in enumerate(ids)]
                    cached = (await kv.step(admits=admits, want_metadata=False)).cached_tokens
                    await kv.step(commits={s: 6 - cached[s] for s in ids}, want_metadata=False)
                    await kv.step(frees=ids, want_metadata=False)
                    if round_ % 10 == 0:
                        await anyio.sleep(0.002)  # let the thread in now and then
            finally:
                stop.set()
        assert reads[0] > 0 and bad == []
        await kv.check()


async def test_block_refcounts_while_running_and_after_a_crash(tiny_config, monkeypatch) -> None:
    """``block_refcounts()`` equals the refcounts the block tables imply, both while the manager runs and
    after shard 1 crashed (the shards' audit call reads what they left behind; no message is served then)."""
    real_handle = PoolShardActor.handle

    def handle(self: PoolShardActor, msg):
        if isinstance(msg, Check) and self.index == 1:
            raise RuntimeError("boom")
        return real_handle(self, msg)

    with pytest.raises(ActorCrashed):
        async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
            await kv.step(admits=[Admit(seq_id=s, prompt=[i, 1, 2]) for i, s in enumerate("ab")])
            await kv.fork("a", ["a1", "a2"])
            tables = [(await kv.sequence(s)).block_ids for s in ("a", "a1", "a2", "b")]
            want: dict[int, int] = {}
            for table in tables:
                for block in table:
                    want[block] = want.get(block, 0) + 1
            assert len(want) == 2 and kv.block_refcounts() == want
            monkeypatch.setattr(PoolShardActor, "handle", handle)
            with pytest.raises(ActorCrashed):
                await kv.check()
    monkeypatch.undo()
    assert kv.block_refcounts() == want
