"""Stateful test: a router index fed by a lagging subscriber always answers as the plain cache model did.

A plain model of one instance's prefix cache (random stores of chains that
share prefixes, removals of leaves, clears) publishes its changes through a
:class:`KeyIndex` (block ids to keys) and an :class:`EventHub`. A router is
fed by one subscription with a small buffer that the machine reads only now
and then, so it lags, gets gap markers and resynchronizes: from a snapshot
taken now, from an older snapshot (which may be refused), or by resuming
``since=`` what it saw (falling back to a snapshot when the window has moved
on). Whenever the router's index is current, it answers ``longest_prefix``
exactly as the model did at the sequence number it is current as of, and
holds exactly that moment's keys; while stale it answers 0.
"""

from __future__ import annotations

import numpy as np
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from akv.core.block_key import chain_keys
from akv.errors import EventsGap
from akv.events import AllBlocksCleared, EventHub, KeyIndex
from akv.routing import CacheAwareRouter

BS = 2
NUM_BLOCKS = 24
WINDOW = 6
BUFFER = 3
NAMESPACES = [None, "a"]
prompts = st.lists(st.integers(1, 2), min_size=BS, max_size=4 * BS)


class EventsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cached: dict[tuple, int] = {}  # (namespace, prefix tokens) -> block id; prefix-closed
        self.free = list(range(NUM_BLOCKS))
        self.keys = KeyIndex(NUM_BLOCKS, BS)
        self.hub = EventHub(window=WINDOW)
        self.history: dict[int, frozenset] = {0: frozenset()}  # seq -> the model's cached prefixes after it
        self.router = CacheAwareRouter(["m"], block_size=BS)
        self.sub = self.hub.subscribe(buffer=BUFFER)
        self.delivered = 0  # the last seq the subscription handed out (a marker's to_seq)
        self.kept: list = []  # batches the router received while stale (what a resync builds on)
        self.saved: tuple | None = None
        self.probes: list[tuple] = [(None, (1, 1, 1))]

    def teardown(self) -> None:
        self.sub.close()
        self.hub.close()

    @property
    def index(self):
        return self.router.index("m")

    def _publish(self, events: list) -> None:
        batch = self.hub.publish(events)
        if batch is None:
            assert not events
            return
        assert batch.seq == max(self.history) + 1, "sequence numbers are consecutive"
        self.history[batch.seq] = frozenset(self.cached)
        note(f"published batch {batch.seq}: {[type(e).__name__ for e in events]}")

    @rule(namespace=st.sampled_from(NAMESPACES), prompt=prompts)
    def store(self, namespace, prompt: list[int]) -> None:
        n = len(prompt) // BS
        ids, parents, positions, parent = [], [], [], None
        for i in range(n):
            prefix = (namespace, tuple(prompt[: (i + 1) * BS]))
            if prefix not in self.cached:
                if not self.free:
                    break
                self.cached[prefix] = self.free.pop()
                ids.append(self.cached[prefix])
                parents.append(parent)
                positions.append(i)
            parent = self.cached[prefix]
        rows = np.array(prompt[: n * BS], dtype=np.int32).reshape(n, BS)[positions]
        events = self.keys.stored_events(ids, parents, rows, [namespace] * len(ids))
        expected = chain_keys(prompt, BS, namespace)
        assert [k for e in events for k in e.block_hashes] == [expected[i] for i in positions]
        self.probes.append((namespace, (*prompt, 1)))
        self._publish(events)

    def _leaves(self) -> list[int]:
        parents = {(ns, prefix[:-BS]) for ns, prefix in self.cached}
        return sorted(b for (ns, prefix), b in self.cached.items() if (ns, prefix) not in parents)

    @precondition(lambda self: self.cached)
    @rule(data=st.data(), count=st.integers(1, 3))
    def remove_leaves(self, data, count: int) -> None:
        removed: list[int] = []
        for _ in range(count):
            if not self.cached:
                break
            block = data.draw(st.sampled_from(self._leaves()))
            removed.append(block)
            del self.cached[next(k for k, v in self.cached.items() if v == block)]
            self.free.append(block)
        self._publish(self.keys.removed_events(removed))

    @rule()
    def clear(self) -> None:
        self.keys.clear()
        self.free.extend(self.cached.values())
        self.cached.clear()
        self._publish([AllBlocksCleared()])

    @rule(n=st.integers(1, 4))
    def deliver(self, n: int) -> None:
        for _ in range(n):
            batch = self.sub.receive_nowait()
            if batch is None:
                break
            note(f"router applies {batch.dropped or batch.seq}")
            first = batch.dropped.from_seq if batch.dropped else batch.seq
            assert first == self.delivered + 1, f"the stream skipped from {self.delivered} to {first}"
            self.delivered = batch.seq
            if not self.router.apply("m", batch):
                self.kept.append(batch)

    @precondition(lambda self: self.router.index("m").stale)
    @rule()
    def resync_now(self) -> None:
        self.router.resync("m", self.keys.cached_keys(), self.hub.log.last_seq)
        assert self.index.applied_seq == self.hub.log.last_seq and not self.index.stale
        self.kept.clear()

    def _resync_works(self, as_of: int) -> bool:
        """Whether a snapshot as of ``as_of`` leaves no hole before the batches the router received."""
        index = self.index
        if not index.stale:
            return as_of >= index.last_seq_seen
        after = [b for b in self.kept if b.seq > as_of]
        return as_of >= index.applied_seq and all(not b.dropped and b.seq == as_of + 1 + i for i, b in enumerate(after))

    @rule()
    def take_snapshot(self) -> None:
        self.saved = (self.keys.cached_keys(), self.hub.log.last_seq)

    @precondition(lambda self: self.saved is not None)
    @rule()
    def resync_from_saved(self) -> None:
        before = (self.index.entries(), self.index.stale, self.index.applied_seq)
        works = self._resync_works(self.saved[1])
        try:
            self.router.resync("m", *self.saved)
        except EventsGap as gap:
            note(f"saved snapshot as of {self.saved[1]} refused: {gap}")
            assert not works, "a snapshot that leaves no hole was refused"
            assert (self.index.entries(), self.index.stale, self.index.applied_seq) == before
            return
        assert works, "a snapshot that leaves a hole was accepted"
        self.kept.clear()
        # current as of the snapshot, or of the last batch it had received if that is later
        assert self.index.applied_seq == max(self.saved[1], self.index.last_seq_seen)

    @rule()
    def resubscribe(self) -> None:
        self.sub.close()
        try:
            self.sub = self.hub.subscribe(since=self.index.last_seq_seen, buffer=BUFFER)
            self.delivered = self.index.last_seq_seen
        except EventsGap:  # the window moved on: live batches from now, and a snapshot as of now
            self.sub = self.hub.subscribe(buffer=BUFFER)
            self.delivered = self.hub.log.last_seq
            self.router.resync("m", self.keys.cached_keys(), self.hub.log.last_seq)
            self.kept.clear()

    def _answer(self, cached: frozenset, namespace, prompt: tuple) -> int:
        blocks = 0
        while blocks < (len(prompt) - 1) // BS and (namespace, prompt[: (blocks + 1) * BS]) in cached:
            blocks += 1
        return blocks * BS

    @invariant()
    def router_answers_as_the_model_did(self) -> None:
        index = self.index
        if index.stale:
            assert all(self.router.longest_prefix("m", list(p), ns) == 0 for ns, p in self.probes)
            return
        then = self.history[index.applied_seq]
        for namespace, prompt in self.probes:
            assert self.router.longest_prefix("m", list(prompt), namespace) == self._answer(then, namespace, prompt)
        assert index.keys() == {chain_keys(list(p), BS, ns)[-1] for ns, p in then}

    @invariant()
    def key_index_holds_the_model_keys(self) -> None:
        held = {key: ns for key, _, ns, _ in self.keys.cached()}
        assert held == {chain_keys(list(p), BS, ns)[-1]: ns for ns, p in self.cached}
        assert self.hub.log.last_seq == max(self.history)


TestEventsMachine = EventsMachine.TestCase
TestEventsMachine.settings = settings(max_examples=80, stateful_step_count=40)
