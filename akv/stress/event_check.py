"""The stress harness's event subscriber: order and consistency of the cache events under load.

With ``StressOptions(events=True)`` the run's manager has events on and an
:class:`EventCheck` task reads its subscription while the workers run. It
checks, batch by batch:

- sequence numbers go up by one (a gap marker's range counted; a gap is
  followed by a resync through ``cached_keys()``, counted in ``resyncs``);
- every removed key was stored before and not removed since (per medium,
  counting holders: two shards may hold one key);
- at the end, the keys rebuilt from the events equal ``cached_keys()``.

Violations are strings in ``errors`` (the runner adds them to the outcome's).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import anyio.lowlevel

from akv.core.block_key import chain_keys_raw, chain_suffix
from akv.events.types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["EVENTS_BUFFER", "EventCheck"]

#: Batches the checker's subscription holds before it gets a gap marker.
EVENTS_BUFFER = 4096


class EventCheck:
    """Reads one manager's event batches and checks them (see the module docstring).

    Args:
        kv: A running manager with ``enable_events``.
    """

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.sub = kv.subscribe_events(since=0, buffer=EVENTS_BUFFER)
        self.held: Counter = Counter()  # (medium, key) -> holders
        self.last_seq = 0
        self.batches = 0
        self.events = 0
        self.resyncs = 0
        self.errors: list[str] = []
        self._target: int | None = None
        self._caught_up = anyio.Event()

    def _error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)

    def apply(self, batch: Any) -> None:
        """Check and apply one batch (a gap marker only moves the number on; :meth:`run` resyncs)."""
        if batch.seq != self.last_seq + 1 and batch.dropped is None:
            self._error(f"events: batch {batch.seq} after batch {self.last_seq}")
        self.last_seq = batch.seq
        self.batches += 1
        held = self.held
        for event in batch.events:
            self.events += 1
            kind = type(event)
            if kind is BlockStored:
                for key in event.block_hashes:
                    held[event.medium, key] += 1
            elif kind is BlockRemoved:
                for key in event.block_hashes:
                    if held[event.medium, key] <= 0:
                        self._error(f"events: batch {batch.seq} removes {key.hex()} not stored since its removal")
                    held[event.medium, key] -= 1
                    if not held[event.medium, key]:
                        del held[event.medium, key]
            elif kind is AllBlocksCleared:
                held.clear()

    async def resync(self) -> None:
        """Reload the held keys from ``cached_keys()`` and skip the batches it covers."""
        keys, as_of = await self.kv.cached_keys()
        self.resyncs += 1
        self.held = Counter((k.medium, k.block_hash) for k in keys)
        while self.last_seq < as_of:
            batch = self.sub.receive_nowait()
            if batch is None:
                self._error(f"events: batches up to {as_of} were not delivered after a resync")
                return
            self.last_seq = batch.seq
        if self.last_seq > as_of:
            self._error(f"events: a resync as of {as_of} found batch {self.last_seq} applied already")

    async def run(self) -> None:
        """Read and check batches until the subscription ends (:meth:`finish` ends it)."""
        async for batch in self.sub:
            self.apply(batch)
            if batch.dropped is not None:
                await self.resync()
            if self._target is not None and self.last_seq >= self._target:
                self._caught_up.set()

    async def finish(self, timeout_s: float = 10.0) -> None:
        """Wait until :meth:`run` applied every batch up to a final snapshot; compare the rebuilt keys with it.

        Call it while :meth:`run` runs, once nothing changes the cache any
        more (the workers are done and the manager is quiet).
        """
        keys, as_of = await self.kv.cached_keys()
        self._target = as_of
        if self.last_seq < as_of:
            with anyio.move_on_after(timeout_s):
                await self._caught_up.wait()
        if self.last_seq != as_of:
            self._error(f"events: {self.last_seq} batches applied for a snapshot as of {as_of}")
            return
        want = Counter((k.medium, k.block_hash) for k in keys)
        if +self.held != want:
            missing, extra = len(want - self.held), len(self.held - want)
            self._error(f"events: rebuilt keys differ from cached_keys(): {missing} missing, {extra} extra")
        truth = await self._tree_keys()
        if want != truth:
            missing, extra = len(truth - want), len(want - truth)
            self._error(f"events: cached_keys() differs from the prefix trees: {missing} missing, {extra} extra")

    async def _tree_keys(self) -> Counter:
        """``(medium, key) -> holders`` keyed from the shards' prefix trees (as ``block_info`` keys), not the key indexes.

        A block's medium is its tier (``"host"`` for a host-tier id, see
        :mod:`akv.core.tiers`). O(blocks x depth).
        """
        truth: Counter = Counter()
        for shard in self.kv._shards:  # the harness audits the shards' own state (as akv.stress.audit does)
            tree, bs = shard.state.tree, shard.state.block_size
            for block_id in tree.block_ids():
                (_, namespace), raw = tree.chain(block_id)  # tree namespaces are (shard index, namespace)
                key = chain_keys_raw(raw, bs, chain_suffix(namespace))[-1]
                truth["host" if tree.is_host(block_id) else "device", key] += 1
            await anyio.lowlevel.checkpoint()
        return truth
