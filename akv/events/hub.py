"""Subscriptions to a manager's event batches: bounded, never blocking the publisher, never silently lossy.

An :class:`EventHub` wraps an :class:`~akv.events.log.EventLog`. Each
:meth:`EventHub.subscribe` gets its own bounded anyio memory object stream.
:meth:`EventHub.publish` is synchronous: it numbers the batch and offers it to
every subscriber with ``send_nowait``, so a step never waits for a reader.
When a subscriber's buffer is full, the batches it cannot take are not queued
anywhere: the subscriber is marked as having a gap ``from_seq..to_seq``, and
the next thing it reads after the batches already buffered is exactly one
:class:`~akv.events.types.EventsDropped` covering every batch it missed (in a
batch of its own, ``seq == to_seq``), then the live batches after it. The
marker goes into the stream at the first publish that finds room, or is
handed out by the subscription itself once its buffer is drained (so it is
never held back by a quiet manager, nor by the hub closing).

``subscribe(since=s)`` replays the log's window after ``s`` first, then the
live batches: the replay list is taken and the subscriber registered in one
synchronous call, so no batch is duplicated or skipped at the seam.

A subscription ends when the hub closes (after the batches it still holds),
when it is closed (``async with``, :meth:`Subscription.aclose`), when its
wait is cancelled (as an async generator would end), or when it is garbage
collected after a ``break``. In every case the hub forgets it.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from akv.core.ids import describe
from akv.errors import InvalidInput, ManagerClosed

from .log import DEFAULT_WINDOW, EventLog
from .types import EventBatch, EventsDropped

__all__ = ["DEFAULT_BUFFER", "EventHub", "Subscription"]

#: Batches a subscriber's stream buffers unless it asks otherwise.
DEFAULT_BUFFER = 256


class _Subscriber:
    """The hub's side of one subscription: its stream and its pending gap (no reference to the Subscription)."""

    __slots__ = ("closed", "gap_from", "gap_to", "gap_ts", "log", "number", "receive", "send")

    def __init__(
        self, number: int, send: MemoryObjectSendStream, receive: MemoryObjectReceiveStream, logger: Any
    ) -> None:
        self.number = number
        self.log = logger.bind(subscriber=number)
        self.send = send
        self.receive = receive
        self.gap_from = 0  # 0: no gap; else the first missed seq
        self.gap_to = 0
        self.gap_ts = 0.0  # ts of the last missed batch, the marker's ts
        self.closed = False  # no more batches will be sent

    def marker(self) -> EventBatch:
        """The pending gap as a marker batch (the gap stays pending until :meth:`clear_gap`)."""
        marker = EventsDropped(from_seq=self.gap_from, to_seq=self.gap_to)
        return EventBatch(seq=marker.to_seq, ts=self.gap_ts, events=(marker,))

    def clear_gap(self) -> None:
        """The marker was handed over: log the gap once, with its range, and clear it."""
        self.log.warning("events.dropped", from_seq=self.gap_from, to_seq=self.gap_to)
        self.gap_from = self.gap_to = 0

    def take_marker(self) -> EventBatch:
        """The pending gap as a marker batch, cleared."""
        batch = self.marker()
        self.clear_gap()
        return batch


def _release(subscribers: dict, state: _Subscriber) -> None:
    """Forget a subscriber and close both ends of its stream (idempotent)."""
    subscribers.pop(state.number, None)
    state.closed = True
    state.gap_from = state.gap_to = 0
    state.send.close()
    state.receive.close()


class Subscription:
    """An async iterator of :class:`~akv.events.types.EventBatch` from an :class:`EventHub`.

    Use ``async with hub.subscribe() as sub: async for batch in sub: ...``.
    Batches arrive in sequence order; a gap arrives as one marker batch
    (``batch.dropped`` is the :class:`~akv.events.types.EventsDropped`).
    Not for concurrent readers (one task iterates it).
    """

    __slots__ = ("__weakref__", "_finalizer", "_replay", "_state")

    def __init__(self, state: _Subscriber, replay: Iterable[EventBatch], subscribers: dict) -> None:
        self._state = state
        self._replay = deque(replay)
        self._finalizer = weakref.finalize(self, _release, subscribers, state)

    @property
    def number(self) -> int:
        """This subscription's number in its hub (from 1), as in the hub's log lines."""
        return self._state.number

    @property
    def ended(self) -> bool:
        """Whether nothing more will come: closed, or the hub closed and every batch was read."""
        state = self._state
        return (
            state.closed
            and not self._replay
            and not state.gap_from
            and state.receive.statistics().current_buffer_used == 0
        )

    def receive_nowait(self) -> EventBatch | None:
        """The next batch if one is ready, without waiting (for a router that polls once per step).

        Returns:
            The next batch (a replayed one, a buffered one, or the pending gap
            marker once the buffer is drained), or ``None`` when nothing is
            ready now (see :attr:`ended` for whether more can come).
        """
        if self._replay:
            return self._replay.popleft()
        state = self._state
        try:
            return state.receive.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return state.take_marker() if state.gap_from else None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> EventBatch:
        """Wait for the next batch.

        Raises:
            StopAsyncIteration: The subscription ended (every batch and marker was read).
        """
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            batch = self.receive_nowait()
            if batch is not None:
                await anyio.lowlevel.cancel_shielded_checkpoint()  # the batch is taken: it must not be lost
                return batch
            return await self._state.receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self.close()
            raise StopAsyncIteration from None
        except BaseException:  # cancelled while waiting: the subscription ends, as an async generator would
            self.close()
            raise

    def close(self) -> None:
        """End the subscription now: the hub forgets it, buffered batches are dropped (idempotent)."""
        self._replay.clear()
        self._finalizer()

    async def aclose(self) -> None:
        """:meth:`close`, as an awaitable (for ``contextlib.aclosing`` and symmetry with async generators)."""
        self.close()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class EventHub:
    """Publishes a manager's event batches to bounded subscriptions (see the module docstring).

    Single-owner like the manager's step path: call :meth:`publish`,
    :meth:`subscribe` and :meth:`close` from the event loop's thread.

    Args:
        log: The event log to number and keep batches in (a new one of
            ``window`` batches when omitted).
        window: Replay window of the new log (ignored when ``log`` is given).
        logger: structlog logger (``structlog.get_logger("akv")`` unless given).

    Raises:
        InvalidInput: ``window`` is not an int >= 0.
    """

    __slots__ = ("_closed", "_hub_log", "_log", "_numbers", "_subscribers")

    def __init__(self, log: EventLog | None = None, *, window: int = DEFAULT_WINDOW, logger: Any = None) -> None:
        self._log = log if log is not None else EventLog(window)
        self._subscribers: dict[int, _Subscriber] = {}
        self._numbers = itertools.count(1)
        self._closed = False
        self._hub_log = (logger or structlog.get_logger("akv")).bind(component="event_hub")

    @property
    def log(self) -> EventLog:
        """The event log (numbering and replay window)."""
        return self._log

    @property
    def num_subscribers(self) -> int:
        """Live subscriptions."""
        return len(self._subscribers)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def publish(self, events: Iterable) -> EventBatch | None:
        """Number ``events`` as the next batch and offer it to every subscriber; never blocks or awaits.

        O(events + subscribers).

        Args:
            events: Cache events of one step or background action.

        Returns:
            The batch, or ``None`` for no events (no number taken, nothing sent).

        Raises:
            InvalidInput: An element is not a cache event (nothing is published).
            ManagerClosed: The hub is closed.
        """
        if self._closed:
            raise ManagerClosed("the event hub is closed; no more batches are published")
        batch = self._log.publish(events)
        if batch is not None:
            for state in list(self._subscribers.values()):
                self._offer(state, batch)
        return batch

    def _offer(self, state: _Subscriber, batch: EventBatch) -> None:
        """Send ``batch`` (after a pending gap marker) or widen the subscriber's gap; drop a closed reader."""
        try:
            if state.gap_from:
                state.send.send_nowait(state.marker())  # WouldBlock leaves the gap pending
                state.clear_gap()
            state.send.send_nowait(batch)
        except anyio.WouldBlock:
            if not state.gap_from:
                state.gap_from = batch.seq
                state.log.debug("events.gap_opened", from_seq=batch.seq)
            state.gap_to, state.gap_ts = batch.seq, batch.ts
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):  # its reader is gone
            _release(self._subscribers, state)

    def subscribe(self, since: int | None = None, buffer: int = DEFAULT_BUFFER) -> Subscription:
        """A new subscription: the window's batches after ``since`` (if given), then every live batch.

        Args:
            since: Last sequence number the subscriber has applied (0: none),
                or ``None`` for live batches only.
            buffer: Live batches its stream holds before it gets a gap (an int >= 1).

        Returns:
            The subscription (an async iterator and async context manager).
            On a closed hub it yields the replay, then ends.

        Raises:
            EventsGap: Batches after ``since`` fell out of the window
                (resynchronize from a snapshot instead).
            InvalidInput: ``since`` is not ``None`` or an int in
                ``[0, last_seq]``, or ``buffer`` is not an int >= 1.
        """
        if type(buffer) is not int or buffer < 1:
            raise InvalidInput(f"buffer of subscribe() must be an int >= 1 (batches), got {describe(buffer)}")
        replay = [] if since is None else self._log.batches_since(since)
        send, receive = anyio.create_memory_object_stream[EventBatch](buffer)
        state = _Subscriber(next(self._numbers), send, receive, self._hub_log)
        if self._closed:
            state.closed = True
            send.close()
        else:
            self._subscribers[state.number] = state
        self._hub_log.debug("events.subscribed", subscriber=state.number, since=since, buffer=buffer)
        return Subscription(state, replay, self._subscribers)

    def close(self) -> None:
        """End every subscription after the batches (and gap markers) it holds; later publishes raise."""
        self._closed = True
        for state in list(self._subscribers.values()):
            state.closed = True
            state.send.close()
        self._subscribers.clear()
