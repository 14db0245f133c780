"""Cache events of tier moves, exactly: demotion, host drop, promotion, a host id reused within a step, failed copies.

Each test drives a shard with a host tier (:class:`~akv.testing.tier_events_machine.EventedShard`
turns every outcome into a batch, as the pool shard actor does) and checks
the events a move emits, and that the keys rebuilt from them, the JSON lines
form included, equal the tree's per medium; the router counts a host-tier
hit as a prefix hit.
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest

from akv.actors.messages import Evict, Stats, Step
from akv.actors.pool_shard import PoolShardActor
from akv.config import KVCacheConfig
from akv.core.block_key import chain_keys
from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepOutcome, StepRequest
from akv.events.hub import EventHub
from akv.events.index import InstanceIndex
from akv.events.jsonl import read_jsonl, write_jsonl
from akv.events.shard_events import EventSink, ShardEvents
from akv.events.types import BlockRemoved, BlockStored
from akv.manager import KVCacheManager
from akv.routing import CacheAwareRouter
from akv.testing.tier_events_machine import EventedShard, tree_keys

BS = 2


def _shard(num_blocks: int = 3, num_host: int = 4, *, sync_copies: bool = True) -> EventedShard:
    n = num_blocks
    return EventedShard(
        0, range(0, n), BS, null_block_id=n, host_ids=range(n + 1, n + 1 + num_host), sync_copies=sync_copies
    )


def _cache(shard: EventedShard, seq_id: str, prompt: list[int]) -> list[bytes]:
    """Admit ``prompt`` (computed at once), free it: its full blocks are cached; their chain keys."""
    shard.step(StepRequest(admits=[Admit(seq_id=seq_id, prompt=np.array(prompt, dtype=np.int32), prefill_done=True)]))
    shard.step(StepRequest(frees=[seq_id]))
    return chain_keys(prompt[: len(prompt) // BS * BS], BS)


def _kinds(batch) -> list[tuple]:
    """``(type, medium, keys)`` of each event of a batch."""
    return [(type(e).__name__, e.medium, e.block_hashes) for e in batch.events]


def _rebuilt(shard: EventedShard) -> InstanceIndex:
    index = InstanceIndex(BS)
    for batch in shard.batches:
        assert index.apply(batch)
    held = {slot: h for slot, (h, _p, _ns) in index.entries().items()}
    assert held == dict(tree_keys(shard)), "the events do not rebuild the tree's keys per medium"
    return index


def test_a_demotion_is_removed_from_device_then_stored_on_host_with_its_parent_and_tokens() -> None:
    shard = _shard(num_blocks=3)
    a, b = _cache(shard, "s0", [1, 2, 3, 4, 0])
    shard.evict(1)  # B, the device leaf, moves to the host
    assert _kinds(shard.batches[-1]) == [("BlockRemoved", "device", [b]), ("BlockStored", "host", [b])]
    stored = shard.batches[-1].events[1]
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (a, [3, 4], BS)
    assert _rebuilt(shard).keys("host") == {b}


def test_a_promotion_is_the_reverse_and_a_host_drop_is_removed_from_host() -> None:
    shard = _shard(num_blocks=4, num_host=2)
    a, b = _cache(shard, "s0", [1, 2, 3, 4, 0])
    shard.evict(2)  # B then A: the whole chain on the host
    assert _rebuilt(shard).keys("host") == {a, b}
    out = shard.step(StepRequest(admits=[Admit(seq_id="s1", prompt=np.array([1, 2, 3, 4, 5], dtype=np.int32))]))
    assert len(out.promotes) == 2 and out.cached_tokens["s1"] == 4
    removed, stored = shard.batches[-1].events
    assert (type(removed), removed.medium, set(removed.block_hashes)) == (BlockRemoved, "host", {a, b})
    assert (type(stored), stored.medium, stored.block_hashes) == (BlockStored, "device", [a, b])  # one chain: one event
    assert (stored.parent_block_hash, stored.token_ids) == (None, [1, 2, 3, 4])
    shard.step(StepRequest(frees=["s1"]))
    before = len(shard.batches)
    for i, first in enumerate((7, 5, 9)):  # other chains push B to the host, then off it (2 host slots)
        _cache(shard, f"t{i}", [first, first, first + 1, first + 1, 0])
    kinds = [k for batch in shard.batches[before:] for k in _kinds(batch)]
    dropped = {key for kind, medium, keys in kinds if (kind, medium) == ("BlockRemoved", "host") for key in keys}
    assert b in dropped
    index = _rebuilt(shard)
    assert not index.prefix_blocks([b]) and index.keys("device") >= {a}


def test_a_host_id_reused_in_one_step_leaves_the_net_change() -> None:
    shard = _shard(num_blocks=3, num_host=1)
    a, b = _cache(shard, "s0", [1, 2, 3, 4, 0])
    out = shard.step(StepRequest(admits=[Admit(seq_id="s1", prompt=np.array([7, 7, 8, 8, 0], dtype=np.int32))]))
    # B went to the one host slot, then was dropped from it for A, which took the same slot.
    (_, h1), (_, h2) = out.demotes
    assert h1 == h2 and out.removed_block_ids == [h1]
    assert _kinds(shard.batches[-1]) == [("BlockRemoved", "device", [b, a]), ("BlockStored", "host", [a])]
    assert shard.batches[-1].events[1].parent_block_hash is None
    _rebuilt(shard)


def test_failed_held_demotions_are_put_back_or_dropped() -> None:
    shard = _shard(num_blocks=4, sync_copies=False)
    a, b = _cache(shard, "s0", [1, 2, 3, 4, 0])
    first, second = StepOutcome(), StepOutcome()
    shard.evict(1, first)  # B to the host, its copy pending
    shard.transfer_done(first.transfer, ok=False)
    assert _kinds(shard.batches[-1]) == [("BlockRemoved", "host", [b]), ("BlockStored", "device", [b])]
    assert shard.batches[-1].events[1].parent_block_hash == a
    shard.evict(1, first := StepOutcome())  # B again
    shard.evict(1, second)  # then A, while B's copy is pending
    shard.transfer_done(first.transfer, ok=False)  # B has no device place: dropped
    assert _kinds(shard.batches[-1]) == [("BlockRemoved", "host", [b])]
    shard.transfer_done(second.transfer)
    assert _rebuilt(shard).keys() == {a}


def test_host_events_round_trip_through_json_lines(tmp_path) -> None:
    shard = _shard(num_blocks=3, num_host=1)
    _cache(shard, "s0", [1, 2, 3, 4, 0])
    _cache(shard, "s1", [7, 7, 8, 8, 0])
    out = io.StringIO()
    write_jsonl(out, shard.batches)
    path = tmp_path / "events.jsonl"
    path.write_text(out.getvalue())
    batches = list(read_jsonl(path))
    assert batches == shard.batches
    assert {e.medium for b in batches for e in b.events} == {"device", "host"}
    index = InstanceIndex(BS)
    for batch in batches:
        assert index.apply(batch)
    assert Counter({slot: h for slot, (h, _p, _ns) in index.entries().items()}) == tree_keys(shard)


def test_the_router_counts_a_host_tier_hit_as_a_prefix_hit() -> None:
    hot, cold = _shard(num_blocks=4), _shard(num_blocks=4)
    prompt = [1, 2, 3, 4, 5, 6, 0]
    for shard in (hot, cold):
        _cache(shard, "s0", prompt)
    cold.evict(2)  # the last two blocks of the chain move to the host; the first stays on the device
    router = CacheAwareRouter(["hot", "cold"], block_size=BS)
    for name, shard in (("hot", hot), ("cold", cold)):
        for batch in shard.batches:
            router.apply(name, batch)
    query = np.array([*prompt[:6], 9], dtype=np.int32)
    assert router.longest_prefix("cold", query) == 6 == cold.lookup(None, query) * BS
    assert router.longest_prefix("cold", query, medium="device") == 2
    assert router.longest_prefix("hot", query) == 6
    assert router.pick(query, running={"hot": 3, "cold": 1}) == "cold"  # equal prefixes: the less loaded one
    cold.evict(1)  # the whole chain on the host: still a 3-block prefix hit there
    router.apply("cold", cold.batches[-1])
    assert router.longest_prefix("cold", query) == 6 and router.longest_prefix("cold", query, medium="device") == 0


class _Ticket:
    """A copy ticket the test finishes by hand (the stream worker's interface the shard actor uses)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def exception(self) -> BaseException | None:
        return self.error

    def add_done_callback(self, callback) -> None:
        pass


class _Executor:
    """Copy-on-write copies run at once; tier copies wait for the test."""

    def __init__(self) -> None:
        self.tickets: list[_Ticket] = []

    def submit(self, src, dst) -> _Ticket:
        ticket = _Ticket()
        ticket.finished = True
        return ticket

    def submit_own(self, *phases) -> _Ticket:
        self.tickets.append(_Ticket())
        return self.tickets[-1]


def test_the_shard_actor_publishes_a_failed_demotion_put_back_when_it_settles() -> None:
    state = ShardState(0, range(0, 4), BS, null_block_id=4, host_ids=range(5, 9), sync_copies=False)
    executor = _Executor()
    actor = PoolShardActor(
        state, executor, watermarks=(0, 0), wake_eviction=lambda: None, debug_invariants=True, inbox_capacity=4
    )
    hub = EventHub()
    actor.events, actor.sink = ShardEvents(state), EventSink(hub)
    sub = hub.subscribe(since=0)
    prompt = np.array([1, 2, 3, 4, 0], dtype=np.int32)
    actor.handle(Step(StepRequest(admits=[Admit(seq_id="s", prompt=prompt, prefill_done=True)]), None))
    actor.handle(Step(StepRequest(frees=["s"]), None))
    assert actor.handle(Evict(1)) == 1  # B goes to the host; its copy is pending
    (ticket,) = executor.tickets
    ticket.finished, ticket.error = True, RuntimeError("copy failed")
    actor.handle(Stats())  # the next message settles the batch: B is put back on the device
    a, b = chain_keys([1, 2, 3, 4], BS)
    batches = [sub.receive_nowait() for _ in range(hub.log.last_seq)]
    assert [_kinds(batch) for batch in batches[-2:]] == [
        [("BlockRemoved", "device", [b]), ("BlockStored", "host", [b])],
        [("BlockRemoved", "host", [b]), ("BlockStored", "device", [b])],
    ]
    index = InstanceIndex(BS)
    for batch in batches:
        assert index.apply(batch)
    assert Counter({slot: h for slot, (h, _p, _ns) in index.entries().items()}) == tree_keys(state)
    assert index.keys("device") == {a, b}
    sub.close()


@pytest.mark.anyio
@pytest.mark.parametrize("host_blocks", [0, 16])
async def test_a_snapshot_load_is_published_as_stored_keys_on_both_tiers(tmp_path, host_blocks: int) -> None:
    cfg = KVCacheConfig(
        num_blocks=8,
        block_size=4,
        storage="none",
        host_blocks=host_blocks,
        low_watermark=0.0,
        high_watermark=0.0,
        enable_events=True,
    )
    async with KVCacheManager(cfg) as kv:
        for i in range(4):  # more than the device pool holds: with a host tier, some blocks are on the host
            prompt = np.arange(100 * i + 1, 100 * i + 14, dtype=np.int32)
            await kv.add_sequence(f"s{i}", prompt)
            await kv.commit(f"s{i}", len(prompt))
            await kv.free(f"s{i}")
        saved = Counter((k.medium, k.block_hash) for k in (await kv.cached_keys())[0])
        await kv.save_snapshot(tmp_path)
    async with KVCacheManager(cfg) as kv:
        sub = kv.subscribe_events(since=0)
        await kv.load_snapshot(tmp_path)
        await kv.evict(3)  # loaded blocks leave again: their keys must be known
        index = InstanceIndex(4)
        while (batch := sub.receive_nowait()) is not None:
            assert index.apply(batch)
        truth = sum((tree_keys(shard.state) for shard in kv._shards), Counter())
        assert Counter({slot: h for slot, (h, _p, _ns) in index.entries().items()}) == truth
        assert {key for _, key in truth} | set(index.keys()) <= {key for _, key in saved}
        assert ("host" in {m for m, _ in truth}) == bool(host_blocks)
        await kv.clear_prefix_cache()
        await kv.check()
        sub.close()
