"""Stateful test of a shard's cache events with a host tier: the keys rebuilt from the events equal the tree's, per medium.

:class:`TierEventsMachine` runs every rule of
:class:`~akv.testing.tier_machine.TierMachine` (admissions that demote on
demand and promote host hits, decodes, forks, frees, background evictions
whose held demotions wait for their copies, swaps, copies that complete late)
on a shard whose every outcome is turned into events as the pool shard actor
turns them (:class:`~akv.events.shard_events.ShardEvents`), and adds:

- a **failed copy**: a background eviction's batch (held demotions only)
  fails instead of running, and the shard puts its blocks back on the device
  when it settles (:meth:`~akv.core.tiers.ShardTiers.transfer_done` with
  ``ok=False``), which is a batch of events too;
- **resets**: every namespace, or one.

After every rule an :class:`~akv.events.index.InstanceIndex` fed with the
batches holds exactly ``(medium, key)`` of every block in the tree (keyed
from the tree's chains, :func:`tree_keys`, never from the key indexes), the
shard's ``cached_keys`` hold the same, and a router over that index answers
what the shard's ``lookup`` answers for prompts of every stem.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import numpy as np
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from akv.core.block_key import chain_keys_raw, chain_suffix
from akv.core.cache_reset import ALL_NAMESPACES, retire_blocks
from akv.core.shard_state import ShardState
from akv.core.step import StepOutcome, StepRequest
from akv.events.shard_events import ShardEvents
from akv.events.types import EventBatch
from akv.routing import CacheAwareRouter
from akv.testing.tier_machine import STEMS, TierMachine

__all__ = ["EventedShard", "TierEventsMachine", "tree_keys"]


def tree_keys(state: ShardState) -> Counter:
    """``(medium, key) -> 1`` for every block in ``state``'s prefix tree, keyed from its chain (``O(blocks * depth)``).

    The ground truth for cache events: computed from the tree's tokens and
    namespaces as ``block_info`` computes a key, never from a key index.
    Medium ``"host"`` for a host-tier id (:meth:`~akv.core.radix_tree.RadixTree.is_host`),
    else ``"device"``.
    """
    tree, bs, out = state.tree, state.block_size, Counter()
    for b in tree.block_ids():
        (_, namespace), raw = tree.chain(b)  # tree namespaces are (shard index, namespace)
        key = chain_keys_raw(raw, bs, chain_suffix(namespace))[-1]
        out["host" if tree.is_host(b) else "device", key] += 1
    return out


class EventedShard(ShardState):
    """A :class:`ShardState` that turns each outcome into a batch of events, as the pool shard actor does."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events = ShardEvents(self)
        self.batches: list[EventBatch] = []

    def _emit(self, events: list) -> None:
        if events:
            self.batches.append(EventBatch(seq=len(self.batches) + 1, ts=0.0, events=tuple(events)))

    def step(self, req: StepRequest) -> StepOutcome:
        out = super().step(req)
        self._emit(self.events.step_events(out))
        return out

    def evict(self, max_blocks: int, out: StepOutcome | None = None) -> int:
        out = StepOutcome() if out is None else out
        evicted = super().evict(max_blocks, out)
        self._emit(self.events.step_events(out))
        return evicted

    def swap_out(self, seq_id: Hashable, out: StepOutcome) -> int:
        try:
            return super().swap_out(seq_id, out)
        finally:  # refused, but room made by evicting stays made (as the actor emits it)
            self._emit(self.events.step_events(out))

    def swap_in(self, seq_id: Hashable, out: StepOutcome) -> int:
        try:
            return super().swap_in(seq_id, out)
        finally:
            self._emit(self.events.step_events(out))

    def transfer_done(self, tid: int, ok: bool = True) -> tuple[list[tuple[int, int]], list[int]]:
        put_back, dropped = super().transfer_done(tid, ok)
        self._emit(self.events.put_back(put_back, dropped))
        return put_back, dropped

    def retire(self, namespace: Hashable) -> int:
        """Retire the prefix cache (:func:`~akv.core.cache_reset.retire_blocks`) with its events; blocks retired."""
        retired, _ = retire_blocks(self, namespace)
        self._emit(self.events.retired(retired, "cleared" if namespace is ALL_NAMESPACES else "removed"))
        return len(retired)


class TierEventsMachine(TierMachine):
    """:class:`~akv.testing.tier_machine.TierMachine` with cache events checked (see the module docstring)."""

    shard_class = EventedShard

    def __init__(self) -> None:
        super().__init__()
        self.router = CacheAwareRouter(["shard"], block_size=self.block_size)
        self.applied = 0
        self.failing: list[StepOutcome] = []  # batches that failed, reported at the next settle

    def _settle(self) -> None:
        for out in self.failing:
            put_back, dropped = self.shard.transfer_done(out.transfer, ok=False)
            note(f"failed copies settled: {len(put_back)} blocks put back on the device, {len(dropped)} dropped")
            if put_back:
                event("held demotion put back")
            if dropped:
                event("held demotion dropped (its parent moved to the host)")
        self.failing.clear()
        super()._settle()

    def _held_only(self) -> list[int]:
        """Queued batches not run yet whose copies are all held demotions (a background eviction's)."""
        transfers = self.shard._transfers if self.shard is not None else {}
        return [
            i
            for i, (out, ran) in enumerate(self.queue)
            if not ran
            and out.transfer in transfers
            and not (out.copies or out.promoted or out.swap_outs or out.swap_ins)
            and len(transfers[out.transfer].held) == len(out.demoted)
        ]

    @precondition(lambda self: self._held_only())
    @rule(data=st.data())
    def fail(self, data) -> None:
        """A background eviction's copies fail (the stream worker reports an error) instead of running."""
        held = self._held_only()
        i = data.draw(st.sampled_from(held), label="batch")
        out, _ = self.queue.pop(i)
        self.failing.append(out)
        note(f"copies of batch {i} failed ({len(out.demoted)} held demotions)")

    @rule(namespace=st.sampled_from([ALL_NAMESPACES, None]))
    def reset(self, namespace) -> None:
        self._settle()
        retired = self.shard.retire(namespace)
        note(f"reset {'all' if namespace is ALL_NAMESPACES else namespace!r}: {retired} blocks retired")

    @invariant()
    def events_rebuild_the_tree(self) -> None:
        shard = self.shard
        if shard is None:
            return
        for batch in shard.batches[self.applied :]:
            assert self.router.apply("shard", batch)
        self.applied = len(shard.batches)
        truth = tree_keys(shard)
        index = self.router.index("shard")
        assert {slot: h for slot, (h, _p, _ns) in index.entries().items()} == dict(truth)
        assert Counter((k.medium, k.block_hash) for k in shard.events.cached_keys()) == truth
        for stem in STEMS:
            for cut in (len(stem), len(stem) // 2 + 1):
                prompt = np.asarray((*stem[:cut], 0), dtype=np.int32)
                want = shard.lookup(None, prompt) * self.block_size
                assert self.router.longest_prefix("shard", prompt) == want, f"{prompt.tolist()}: lookup {want}"


class SyncTierEventsMachine(TierEventsMachine):
    """:class:`TierEventsMachine` in metadata mode (copies complete where they are made; nothing fails)."""

    sync_copies = True


TierEventsMachine.TestCase.settings = settings(TierMachine.TestCase.settings, max_examples=100)
SyncTierEventsMachine.TestCase.settings = settings(TierMachine.TestCase.settings, max_examples=50)
