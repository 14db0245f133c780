"""Cache events of a real manager against its trees: a state machine with steps, evictions, clears, epochs, gaps.

The ground truth is read from each shard's prefix tree (every block keyed
from its chain, as ``block_info`` keys it, with its medium), never from the
key indexes that produce the events. A router fed by a subscription with a
tiny buffer (so it drops and resynchronizes through ``cached_keys()``) must
hold exactly those ``(medium, key)`` pairs, and with one shard answer exactly
what ``lookup()`` answers. Half the runs have a host tier behind a small
device pool: admissions and ``evict()`` demote, admissions promote host hits,
the host tier drops its own blocks.
"""

from __future__ import annotations

from collections import Counter

import anyio
import anyio.from_thread
import numpy as np
import pytest
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from akv.config import KVCacheConfig
from akv.core.step import Admit
from akv.errors import InvalidInput
from akv.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from akv.manager import KVCacheManager
from akv.routing import CacheAwareRouter
from akv.testing.tier_events_machine import tree_keys

BLOCK_SIZE = 4
# Prompts from a few shared prefixes, so prompts hit, share and diverge.
STEMS = [list(range(1, 13)), [*range(1, 9), 50, 51, 52, 53], [7] * 12]


def _prompt(stem: int, tail: list[int]) -> np.ndarray:
    return np.array(STEMS[stem] + tail, dtype=np.int32)


async def _tree_keys(kv: KVCacheManager) -> Counter:
    """``{(medium, key): holders}`` of every block in every shard's tree, keyed from the tree itself."""
    keys: Counter = Counter()
    for shard in kv._shards:
        keys += tree_keys(shard.state)
    return keys


class EventsMachine(RuleBasedStateMachine):
    """A manager with events on, a lagging subscriber and a router (see the module docstring)."""

    @initialize(
        num_shards=st.integers(1, 2),
        buffer=st.sampled_from([2, 64]),
        host_blocks=st.sampled_from([0, 6, 12]),
        storage=st.sampled_from(["none", "tensors"]),
    )
    def start(self, num_shards: int, buffer: int, host_blocks: int, storage: str) -> None:
        self.portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        # The eviction loop never wakes (watermarks 0): every eviction is a rule's, so reads are exact.
        cfg = KVCacheConfig(
            num_blocks=10 if host_blocks else 24,
            host_blocks=host_blocks,
            block_size=BLOCK_SIZE,
            storage=storage,  # tensors: the tiny model's CPU pool, copies (demotions, promotions) pending
            num_shards=num_shards,
            low_watermark=0.0,
            high_watermark=0.0,
            enable_events=True,
            events_window=4,
        )
        self.kv = KVCacheManager(cfg)
        self.kv_cm = self.portal.wrap_async_context_manager(self.kv)
        self.kv_cm.__enter__()
        self.sub = self.portal.call(lambda: self.kv.subscribe_events(since=0, buffer=buffer))
        self.router = CacheAwareRouter(["kv"], block_size=BLOCK_SIZE)
        self.live: list[str] = []
        self.counter = 0
        self.resyncs = 0

    def teardown(self) -> None:
        if hasattr(self, "portal_cm"):
            try:
                if hasattr(self, "kv_cm"):
                    self.kv_cm.__exit__(None, None, None)
            finally:
                self.portal_cm.__exit__(None, None, None)

    @rule(
        stem=st.integers(0, 2),
        tail=st.lists(st.integers(100, 101), max_size=5),  # few tails: prompts come back (hits, promotions)
        ns=st.sampled_from([None, "a"]),
        keep=st.booleans(),
    )
    def admit(self, stem: int, tail: list[int], ns, keep: bool) -> None:
        """Admit a prompt and commit it whole (its full blocks are published), then keep it live or free it (cached)."""
        seq_id = f"s{self.counter}"
        self.counter += 1
        prompt = _prompt(stem, tail)
        note(f"admit {seq_id} stem={stem} tail={tail} ns={ns} keep={keep}")

        async def go():
            result = await self.kv.step(admits=[Admit(seq_id=seq_id, prompt=prompt, namespace=ns)], want_metadata=False)
            if seq_id in result.rejected:
                return False
            await self.kv.commit(seq_id, len(prompt) - result.cached_tokens[seq_id])
            if not keep:
                await self.kv.free(seq_id)
            return keep

        if self.portal.call(go):
            self.live.append(seq_id)
        if self.kv.config.host_blocks:
            stats = self.portal.call(self.kv.stats)
            for name in ("demoted_blocks", "promoted_blocks", "host_evicted_blocks"):
                if getattr(stats, name):
                    event(f"host tier, storage {self.kv.config.storage}: {name} > 0")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.live))
        note(f"free {seq_id}")
        self.live.remove(seq_id)
        self.portal.call(self.kv.free, seq_id)

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        note(f"evict {n}")
        self.portal.call(self.kv.evict, n)

    @rule()
    def clear(self) -> None:
        note("clear_prefix_cache")
        self.portal.call(self.kv.clear_prefix_cache)

    @rule(ns=st.sampled_from([None, "a", "b"]))
    def bump(self, ns) -> None:
        note(f"bump_epoch {ns}")
        self.portal.call(self.kv.bump_epoch, ns)

    def _catch_up(self) -> None:
        """Apply every batch the subscription holds; resync through ``cached_keys()`` after a gap."""
        while (batch := self.portal.call(self.sub.receive_nowait)) is not None:
            self.router.apply("kv", batch)
        if self.router.index("kv").stale:
            keys, as_of = self.portal.call(self.kv.cached_keys)
            self.router.resync("kv", keys, as_of)
            self.resyncs += 1
            note(f"resync as of {as_of}")

    @invariant()
    def index_equals_trees(self) -> None:
        if not hasattr(self, "portal"):
            return
        self._catch_up()
        index = self.router.index("kv")
        assert not index.stale
        assert index.applied_seq == self.kv.events_last_seq
        truth = self.portal.call(_tree_keys, self.kv)
        holders = {slot: h for slot, (h, _p, _ns) in index.entries().items()}
        assert holders == dict(truth)
        keys, as_of = self.portal.call(self.kv.cached_keys)
        assert as_of == self.kv.events_last_seq
        assert Counter((k.medium, k.block_hash) for k in keys) == truth
        self.portal.call(self.kv.check)

    @invariant()
    def router_answers_lookup(self) -> None:
        if not hasattr(self, "portal") or len(self.kv._shards) != 1:
            return
        for stem in range(3):
            for ns in (None, "a"):
                prompt = _prompt(stem, [100, 101, 102, 103, 100])
                want = self.portal.call(lambda p=prompt, n=ns: self.kv.lookup(p, namespace=n))
                assert self.router.longest_prefix("kv", prompt, namespace=ns) == want


EventsMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEventsMachine = EventsMachine.TestCase


@pytest.mark.anyio
async def test_clear_while_running_keeps_held_blocks_valid_and_frees_them_on_release():
    cfg = KVCacheConfig(num_blocks=32, block_size=4, storage="none", enable_events=True)
    async with KVCacheManager(cfg) as kv:
        sub = kv.subscribe_events(since=0)
        prompt = np.arange(1, 18, dtype=np.int32)  # 4 full blocks + 1 token
        await kv.add_sequence("held", prompt)
        await kv.commit("held", len(prompt))
        await kv.add_sequence("done", np.arange(40, 49, dtype=np.int32))
        await kv.commit("done", 9)
        await kv.free("done")  # its 2 full blocks are cached, unreferenced
        before = await kv.stats()
        assert await kv.clear_prefix_cache() == 6
        after = await kv.stats()
        assert after.free == before.free + 2  # the cached ones at once
        assert await kv.lookup(prompt) == 0
        info = await kv.sequence("held")
        assert info.token_ids == tuple(prompt.tolist())  # still valid for its holder
        await kv.append("held", [5, 6, 7])  # fills block 5: never published after the reset
        await kv.commit("held", 3)
        assert await kv.lookup(np.concatenate([prompt, [5, 6, 7, 9]]).astype(np.int32)) == 0
        await kv.free("held")
        final = await kv.stats()
        assert final.cached == 0 and final.free == 32  # freed, not cached
        await kv.check()
        batches = [sub.receive_nowait() for _ in range(kv.events_last_seq)]
        kinds = [[type(e) for e in b.events] for b in batches]
        assert kinds == [[BlockStored], [BlockStored], [AllBlocksCleared]]


@pytest.mark.anyio
async def test_bump_epoch_of_one_namespace_removes_only_its_keys():
    cfg = KVCacheConfig(num_blocks=32, block_size=4, storage="none", enable_events=True)
    async with KVCacheManager(cfg) as kv:
        prompt = np.arange(1, 10, dtype=np.int32)
        for seq_id, ns in (("x", "old"), ("y", None)):
            await kv.add_sequence(seq_id, prompt, namespace=ns)
            await kv.commit(seq_id, len(prompt))
        seq = kv.events_last_seq
        sub = kv.subscribe_events(since=seq)
        assert await kv.bump_epoch("old") == 2
        assert await kv.lookup(prompt, namespace="old") == 0
        assert await kv.lookup(prompt) == 8
        batch = sub.receive_nowait()
        assert [type(e) for e in batch.events] == [BlockRemoved]
        assert len(batch.events[0].block_hashes) == 2
        keys, as_of = await kv.cached_keys()
        assert as_of == batch.seq and len(keys) == 2 and {k.namespace for k in keys} == {None}
        with pytest.raises(InvalidInput):
            await kv.bump_epoch([1])  # not a plain value: nothing changed
        assert kv.events_last_seq == batch.seq
        await kv.check()


@pytest.mark.anyio
async def test_events_off_refuses_subscriptions_and_resets_still_work():
    async with KVCacheManager(KVCacheConfig(num_blocks=16, block_size=4, storage="none")) as kv:
        with pytest.raises(InvalidInput):
            kv.subscribe_events()
        with pytest.raises(InvalidInput):
            await kv.cached_keys()
        await kv.add_sequence("a", np.arange(1, 10, dtype=np.int32))
        await kv.commit("a", 9)
        assert await kv.clear_prefix_cache() == 2
        assert kv.events_last_seq == 0
        await kv.check()


@pytest.mark.anyio
async def test_a_step_over_two_shards_is_one_batch() -> None:
    cfg = KVCacheConfig(num_blocks=64, block_size=4, storage="none", num_shards=2, enable_events=True)
    async with KVCacheManager(cfg) as kv:
        prompts = {f"p{i}": np.arange(10 * i + 1, 10 * i + 10, dtype=np.int32) for i in range(8)}
        await kv.step(admits=[Admit(seq_id=s, prompt=p) for s, p in prompts.items()], want_metadata=False)
        shards = {s: (await kv.sequence(s)).shard for s in prompts}
        assert set(shards.values()) == {0, 1}  # placement spread them
        seq = kv.events_last_seq
        sub = kv.subscribe_events(since=seq)
        await kv.step(commits={s: 9 for s in prompts}, want_metadata=False)
        assert kv.events_last_seq == seq + 1
        batch = sub.receive_nowait()
        assert sum(len(e.block_hashes) for e in batch.events) == 16  # 2 full blocks of each of 8 prompts
        keys, as_of = await kv.cached_keys()
        assert as_of == batch.seq and len(keys) == 16
