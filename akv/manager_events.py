"""ManagerEvents: cache events, the cached-key snapshot and the safe prefix-cache reset of :class:`~akv.manager.KVCacheManager` (a mixin).

With ``KVCacheConfig(enable_events=True)`` every shard keeps a
:class:`~akv.events.shard_events.ShardEvents` and hands its events to one
:class:`~akv.events.shard_events.EventSink`, which publishes them through the
manager's :class:`~akv.events.hub.EventHub`: one numbered batch per step
(a step split over several shards included) or background action (an
eviction batch, ``evict``, a reset), in the order the changes happened.
Shards hand their events over while they serve a message, and handlers never
await, so the order of batches is the order in which the shards changed.

``clear_prefix_cache`` and ``bump_epoch`` work with events on or off (see
:mod:`akv.core.cache_reset` for what they do to a shard). It relies on the
manager's ``config``, ``_shards``, ``_sharded_lock``, ``_logger``,
``_check_running`` and ``_ask``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from typing import Any

import anyio
import anyio.lowlevel

from akv.actors.messages import Retire
from akv.core.cache_reset import ALL_NAMESPACES
from akv.core.ids import plain_id
from akv.errors import InvalidInput
from akv.events.hub import DEFAULT_BUFFER, EventHub, Subscription
from akv.events.shard_events import EventSink, ShardEvents
from akv.events.types import CachedKey

__all__ = ["ManagerEvents"]


class ManagerEvents:
    """Events and resets of :class:`~akv.manager.KVCacheManager` (see the module docstring)."""

    _sink: EventSink | None = None

    def _start_events(self) -> None:
        """Give every shard its key index and the manager's sink (``enable_events``); called on entry."""
        if not self.config.enable_events:
            return
        self._sink = EventSink(EventHub(window=self.config.events_window, logger=self._logger))
        for shard in self._shards:
            shard.events = ShardEvents(shard.state)
            shard.sink = self._sink

    def _stop_events(self) -> None:
        """End every subscription after what it holds (on exit, once the shards stopped)."""
        if self._sink is not None:
            self._sink.hub.close()

    def _events_batch(self) -> contextlib.AbstractContextManager:
        """One event batch for everything the shards emit inside (a no-op with events off)."""
        return self._sink.batch() if self._sink is not None else contextlib.nullcontext()

    def _hub(self) -> EventHub:
        self._check_running()
        if self._sink is None:
            raise InvalidInput("cache events are off: create the manager with KVCacheConfig(enable_events=True)")
        return self._sink.hub

    @property
    def events_last_seq(self) -> int:
        """Sequence number of the latest event batch (0 before the first, and with events off)."""
        return self._sink.hub.log.last_seq if self._sink is not None else 0

    async def stop_eviction_loop(self) -> None:
        """Stop the background eviction loop for good and wait until it has ended.

        For a final snapshot of the cache (``akv replay --events-out``): after
        it only calls change the cache. Evictions on demand inside steps and
        ``evict()`` still work.
        """
        self._check_running()
        self._eviction.stop()
        await self._stopped["eviction_loop"].wait()

    def subscribe_events(self, since: int | None = None, buffer: int = DEFAULT_BUFFER) -> Subscription:
        """Subscribe to the cache event batches (an async iterator; see docs/events.md).

        A slow subscriber never blocks a step: when its buffer is full it gets
        one ``EventsDropped`` marker for the batches it missed, then the live
        ones (resynchronize through :meth:`cached_keys`).

        Args:
            since: Last batch number the subscriber applied (0: none): the
                window's later batches are replayed first; ``None``: live only.
            buffer: Batches its stream holds (an int >= 1).

        Returns:
            A :class:`~akv.events.hub.Subscription`; it ends when the manager exits.

        Raises:
            InvalidInput: Events are off, or a bad ``since`` / ``buffer``.
            EventsGap: Batches after ``since`` fell out of the window.
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        return self._hub().subscribe(since=since, buffer=buffer)

    async def cached_keys(self) -> tuple[list[CachedKey], int]:
        """Every cached key (with parent, namespace, medium) and the batch number it is current as of.

        Exact: the shards' key indexes are read one after another with no
        await in between, outside any step (multi-shard steps and resets hold
        the same lock), so the keys are the result of batches ``1 .. as_of``
        and of no later one. Two shards may both hold a key: it is listed once
        per holder. O(cached blocks).

        Returns:
            ``(keys, as_of)``.

        Raises:
            InvalidInput: Events are off.
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        hub = self._hub()
        async with self._sharded_lock:
            self._check_running()
            keys = [k for shard in self._shards for k in shard.events.cached_keys()]
            return keys, hub.log.last_seq

    async def clear_prefix_cache(self) -> int:
        """Drop the whole prefix cache now, while requests run.

        Cached (unreferenced) blocks are freed at once; blocks that running
        sequences hold stop being matchable but stay valid for them and are
        freed, not cached, when released; those sequences publish nothing
        more. Events: one ``AllBlocksCleared`` (a ``BlockRemoved`` per key
        instead when a busy shard made the shards' parts interleave with other
        changes). Safe to call with events off.

        Returns:
            Blocks retired (removed from the prefix cache).

        Raises:
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        return await self._retire(ALL_NAMESPACES)

    async def bump_epoch(self, namespace: Hashable = None) -> int:
        """Start a new epoch (a weight update): no block cached before the call is matched after it.

        ``namespace=None`` retires every namespace (as :meth:`clear_prefix_cache`;
        its event is ``AllBlocksCleared``); a namespace value retires the
        blocks cached under it (a ``BlockRemoved`` per key). In-flight
        sequences of a retired namespace finish on the blocks they hold, and
        what they fill later is never published.

        Args:
            namespace: ``None`` (all) or a plain value (:mod:`akv.core.ids`).

        Returns:
            Blocks retired.

        Raises:
            InvalidInput: ``namespace`` is not a plain value (nothing changed).
            ActorCrashed, ManagerClosed: The manager is not running.
        """
        ns = ALL_NAMESPACES if namespace is None else plain_id(namespace, "namespace of bump_epoch()")
        return await self._retire(ns)

    async def _retire(self, namespace: Any) -> int:
        """Send every shard a :class:`Retire`; one event batch for all of them."""
        self._check_running()
        everything = namespace is ALL_NAMESPACES
        shards = self._shards
        if len(shards) == 1:
            retired, _ = await self._ask(shards[0], Retire(namespace, "cleared" if everything else "removed"))
            return retired
        total = 0
        async with self._sharded_lock:
            self._check_running()
            if all(s.can_serve_now for s in shards):  # no await between the parts: one AllBlocksCleared is exact
                with self._events_batch():
                    for i, shard in enumerate(shards):
                        event = ("silent" if i else "cleared") if everything else "removed"
                        total += shard.serve(Retire(namespace, event))[0]
                return total
            with anyio.CancelScope(shield=True), self._events_batch():
                for shard in shards:
                    total += (await shard.ask(Retire(namespace, "removed")))[0]
        await anyio.lowlevel.checkpoint_if_cancelled()
        return total
