"""The sequenced event log of one manager: numbering, and a replay window for resumption.

Synchronous and single-owner (the manager's step path owns it; see
:class:`~akv.events.hub.EventHub` for subscriptions). Sequence numbers start
at **1** and are consecutive: batch ``n`` is the ``n``-th non-empty batch the
manager published. ``0`` names the empty state before the first batch, so a
snapshot taken before anything was cached is "as of 0", and
``batches_since(0)`` replays everything still in the window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice

from akv.core.ids import describe
from akv.errors import EventsGap, InvalidInput

from .types import EventBatch, check_cache_events

__all__ = ["DEFAULT_WINDOW", "EventLog"]

#: Batches kept for ``since=`` resumption unless configured otherwise.
DEFAULT_WINDOW = 1024


class EventLog:
    """Numbers event batches and keeps the last ``window`` of them.

    Memory is O(``window`` batches). Publishing is O(events in the batch)
    (validation of their types); :meth:`batches_since` is O(batches returned).

    Args:
        window: Batches kept for :meth:`batches_since` (an int >= 0; 0 keeps none).
        clock: Returns the wall-clock time in seconds for each batch's ``ts``
            (``time.time`` unless injected, e.g. by a deterministic test).

    Raises:
        InvalidInput: ``window`` is not an int >= 0.
    """

    __slots__ = ("_batches", "_clock", "_last_seq")

    def __init__(self, window: int = DEFAULT_WINDOW, *, clock: Callable[[], float] = time.time) -> None:
        if type(window) is not int or window < 0:
            raise InvalidInput(f"window of EventLog must be an int >= 0 (batches), got {describe(window)}")
        self._batches: deque[EventBatch] = deque(maxlen=window)
        self._clock = clock
        self._last_seq = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the latest batch, 0 before the first."""
        return self._last_seq

    @property
    def window(self) -> int:
        """Batches kept for resumption."""
        return self._batches.maxlen or 0

    @property
    def oldest_seq(self) -> int:
        """Sequence number of the oldest batch in the window (``last_seq + 1`` when it is empty)."""
        return self._batches[0].seq if self._batches else self._last_seq + 1

    def publish(self, events: Iterable) -> EventBatch | None:
        """Number the events of one step or background action as the next batch and keep it.

        Args:
            events: :data:`~akv.events.types.CacheEvent` objects in the order
                they happened (a list or tuple).

        Returns:
            The new batch, or ``None`` when ``events`` is empty (nothing is
            emitted and no number is taken).

        Raises:
            InvalidInput: An element is not a cache event (nothing is published).
        """
        events = tuple(events)
        if not events:
            return None
        check_cache_events(events, "EventLog.publish")
        batch = EventBatch(seq=self._last_seq + 1, ts=float(self._clock()), events=events)
        self._last_seq = batch.seq
        if self._batches.maxlen:
            self._batches.append(batch)
        return batch

    def batches_since(self, seq: int) -> list[EventBatch]:
        """The batches after ``seq``, oldest first, for a consumer resuming from ``seq``.

        Args:
            seq: The last sequence number the consumer applied (0: none),
                ``0 <= seq <= last_seq``.

        Returns:
            Every batch numbered ``seq + 1 .. last_seq`` (empty when ``seq ==
            last_seq``).

        Raises:
            EventsGap: Batches after ``seq`` fell out of the window; the
                consumer must resynchronize from a snapshot.
            InvalidInput: ``seq`` is not an int in ``[0, last_seq]``.
        """
        if type(seq) is not int or not 0 <= seq <= self._last_seq:
            raise InvalidInput(f"since must be an int in [0, {self._last_seq}] (the last seq), got {describe(seq)}")
        oldest = self.oldest_seq
        if seq + 1 < oldest:
            raise EventsGap(seq + 1, oldest - 1, f"the replay window keeps batches {oldest}..{self._last_seq} only")
        return list(islice(self._batches, seq + 1 - oldest, None))
