"""A shard's cache events: its block-id changes (a step's, an eviction's, a reset's) turned into keyed events.

:class:`ShardEvents` owns one shard's :class:`~akv.events.key_index.KeyIndex`
and reads the shard's tree and block tokens to key the blocks a change
stored. The pool shard actor calls it after each message that changed the
set of cached keys and hands the events to the manager's event sink
(:class:`EventSink`), which numbers them as one batch per step or
background action (:class:`~akv.events.hub.EventHub`).

Order inside a shard's part of a batch: removals first, then stores. A step
can evict a block and reuse it for a block it publishes in the same step, and
a block published in a step is referenced, so the same step cannot evict it.

With a host tier a second key index covers the shard's host ids, and tier
moves carry a block's key from one index to the other
(:mod:`akv.events.tier_events`): a demotion is a removal from ``"device"``
and a store in ``"host"`` of the same key, a promotion the reverse.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from akv.errors import InvalidInput

from .hub import EventHub
from .key_index import KeyIndex
from .tier_events import HOST, loaded_events, put_back_events, tier_step_events
from .types import AllBlocksCleared, CachedKey

if TYPE_CHECKING:
    from akv.core.shard_state import ShardState
    from akv.core.step import StepOutcome

__all__ = ["EventSink", "ShardEvents"]


class ShardEvents:
    """Keys and events of one shard's prefix cache: medium ``"device"``, and ``"host"`` for its host tier.

    Args:
        state: The shard (read: its tree and block tokens; never changed).
        medium: The tier its device blocks are in.
    """

    __slots__ = ("host_keys", "keys", "medium", "state")

    def __init__(self, state: ShardState, *, medium: str = "device") -> None:
        self.state = state
        self.medium = medium
        pool, host = state.pool, state.host
        #: The shard's cached device blocks' keys, by block id (mirrors its tree).
        self.keys = KeyIndex(pool.num_blocks, state.block_size, first_block_id=pool.first_block_id)
        #: The keys of its cached host blocks, by host id (None: no host tier).
        self.host_keys = (
            None if host is None else KeyIndex(host.num_blocks, state.block_size, first_block_id=host.first_block_id)
        )

    def changed(self, removed_block_ids: list[int], stored_block_ids: list[int]) -> list:
        """The events of blocks that left the tree, then of blocks that entered it (in insertion order).

        O(blocks) (one key hash per stored block).

        Args:
            removed_block_ids: Blocks removed from the tree (indexed before), distinct.
            stored_block_ids: Blocks inserted in the tree since, each after its parent.

        Returns:
            ``BlockRemoved`` then ``BlockStored`` events (empty when nothing changed).

        Raises:
            RuntimeError: The key index disagrees with the tree (an akv bug;
                it crashes the shard's actor).
        """
        events: list = []
        try:
            if removed_block_ids:
                events += self.keys.removed_events(removed_block_ids, medium=self.medium)
            if stored_block_ids:
                events += self._stored(stored_block_ids)
        except InvalidInput as exc:  # akv's own bug, not the caller's: the actor must crash, not reply an error
            raise RuntimeError(f"shard {self.state.shard_index}: key index out of step with the tree: {exc}") from exc
        return events

    def step_events(self, outcome: StepOutcome) -> list:
        """:meth:`changed` for one step's :class:`~akv.core.step.StepOutcome` (an eviction's, a swap's).

        With a host tier, an outcome that moved blocks between tiers or
        dropped host blocks takes :func:`~akv.events.tier_events.tier_step_events`.

        Raises:
            RuntimeError: The key indexes disagree with the tree (an akv bug).
        """
        removed = outcome.removed_block_ids
        if self.host_keys is not None and (
            outcome.demoted or outcome.promoted or (removed and max(removed) >= self.state.host_base)
        ):
            try:
                return tier_step_events(self, outcome)
            except InvalidInput as exc:
                raise RuntimeError(
                    f"shard {self.state.shard_index}: key indexes out of step with the tree: {exc}"
                ) from exc
        return self.changed(removed, outcome.stored_block_ids)

    def put_back(self, pairs: list[tuple[int, int]], dropped: list[int]) -> list:
        """Events of held demotions whose copy failed (:meth:`~akv.core.tiers.ShardTiers.transfer_done`).

        Args:
            pairs: ``(host id, device block)`` put back on the device.
            dropped: Host ids that left the tree instead.

        Raises:
            RuntimeError: The key indexes disagree with the tree (an akv bug).
        """
        try:
            return put_back_events(self, pairs, dropped)
        except InvalidInput as exc:
            raise RuntimeError(f"shard {self.state.shard_index}: key indexes out of step with the tree: {exc}") from exc

    def loaded(self, block_ids: list[int]) -> list:
        """``BlockStored`` events of the blocks a snapshot load published (those of ``block_ids`` now in the tree).

        Args:
            block_ids: The blocks the load reserved, each after its parent.

        Raises:
            RuntimeError: The key indexes disagree with the tree (an akv bug).
        """
        tree = self.state.tree
        try:
            return loaded_events(self, [b for b in block_ids if b in tree])
        except InvalidInput as exc:
            raise RuntimeError(f"shard {self.state.shard_index}: key indexes out of step with the tree: {exc}") from exc

    def _stored(self, block_ids: list[int]) -> list:
        """``BlockStored`` events of blocks now in the tree: parents and namespaces read from it. O(blocks)."""
        state = self.state
        parent_of, first = state.tree.parent_of, state.pool.first_block_id
        indexed = self.keys.namespace
        parents: list[int | None] = []
        namespaces: list = []
        earlier: dict[int, object] = {}  # block -> namespace, for this call's blocks
        for b in block_ids:
            parent, root_ns = parent_of(b)
            if parent is None:
                ns = root_ns[1]  # tree namespaces are (shard index, namespace)
            elif parent in earlier:
                ns = earlier[parent]
            else:
                ns = indexed(parent)
            parents.append(parent)
            namespaces.append(ns)
            earlier[b] = ns
        rows = state.block_tokens[np.asarray(block_ids, dtype=np.intp) - first]
        if all(p is not None and p not in earlier for p in parents):  # one-block runs below cached blocks
            return self.keys.stored_below(block_ids, parents, rows, namespaces, self.medium)
        return self.keys.stored_events(block_ids, parents, rows, namespaces, medium=self.medium)

    def retired(self, block_ids: list[int], event: str) -> list:
        """Forget the retired blocks; their events (see :class:`~akv.actors.messages.Retire`).

        Args:
            block_ids: The blocks that left the tree.
            event: ``"removed"``: a ``BlockRemoved`` per key; ``"cleared"``:
                ``AllBlocksCleared`` (every block was retired); ``"silent"``: none.
        """
        hb, host_ids = self.state.host_base, []
        if self.host_keys is not None and block_ids and max(block_ids) >= hb:
            host_ids = [b for b in block_ids if b >= hb]
            block_ids = [b for b in block_ids if b < hb]
        if event == "removed":
            out = self.keys.removed_events(block_ids, medium=self.medium) if block_ids else []
            return out + (self.host_keys.removed_events(host_ids, medium=HOST) if host_ids else [])
        self.keys.removed(block_ids)
        if host_ids:
            self.host_keys.removed(host_ids)
        return [AllBlocksCleared()] if event == "cleared" else []

    def cached_keys(self) -> list[CachedKey]:
        """Every key the shard holds now, with its parent, namespace and medium (device blocks, then host blocks)."""
        keys = self.keys.cached_keys(self.medium)
        return keys if self.host_keys is None else keys + self.host_keys.cached_keys(HOST)


class EventSink:
    """Collects the shards' events into batches and publishes them through one :class:`EventHub`.

    Outside a :meth:`batch` block, each shard message's events are published
    at once as one batch; inside, everything emitted until the outermost block
    ends is one batch (a multi-shard step, a reset or eviction over every
    shard), in the order it was emitted. Single-owner (the event loop's thread).

    Args:
        hub: The manager's hub.
    """

    __slots__ = ("_depth", "_pending", "hub")

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self._depth = 0
        self._pending: list = []

    def emit(self, events: list) -> None:
        """Publish ``events`` (or add them to the open batch); nothing for no events."""
        if not events:
            return
        if self._depth:
            self._pending += events
        elif not self.hub.closed:
            self.hub.publish(events)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make everything emitted inside one batch (nests; the outermost block publishes)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending:
                events, self._pending = self._pending, []
                self.emit(events)
