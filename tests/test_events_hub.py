"""EventLog numbering and window, EventHub subscriptions: replay seam, gap markers, removal; asyncio and trio."""

from __future__ import annotations

import gc

import anyio
import pytest

from akv.errors import EventsGap, InvalidInput, ManagerClosed
from akv.events import AllBlocksCleared, BlockRemoved, EventBatch, EventHub, EventLog, EventsDropped


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


KEY = bytes(range(16))


def removed(i: int) -> list:
    """One event naming key ``i`` (the content is irrelevant to numbering)."""
    return [BlockRemoved(block_hashes=[i.to_bytes(16, "big")], medium="device")]


def seqs(batches: list[EventBatch]) -> list:
    """Sequence numbers, with a gap marker shown as ``(from, to)``."""
    return [(b.dropped.from_seq, b.dropped.to_seq) if b.dropped else b.seq for b in batches]


def drain(sub) -> list[EventBatch]:
    out = []
    while (batch := sub.receive_nowait()) is not None:
        out.append(batch)
    return out


def test_numbering_is_consecutive_from_one_and_empty_batches_take_no_number() -> None:
    log = EventLog(window=8, clock=lambda: 5.0)
    assert log.last_seq == 0 and log.batches_since(0) == []
    assert log.publish([]) is None
    first = log.publish(removed(1))
    assert log.publish(()) is None
    second = log.publish([AllBlocksCleared(), *removed(2)])
    assert (first.seq, second.seq, log.last_seq) == (1, 2, 2)
    assert second.ts == 5.0 and type(second.ts) is float
    assert second.events == (AllBlocksCleared(), *removed(2))
    assert log.batches_since(0) == [first, second] and log.batches_since(1) == [second]


def test_window_keeps_the_last_batches_and_an_older_since_is_a_gap() -> None:
    log = EventLog(window=3)
    for i in range(7):
        log.publish(removed(i))
    assert [b.seq for b in log.batches_since(4)] == [5, 6, 7]
    assert log.batches_since(7) == []
    with pytest.raises(EventsGap) as info:
        log.batches_since(3)
    assert (info.value.from_seq, info.value.to_seq) == (4, 4)
    with pytest.raises(EventsGap) as info:
        log.batches_since(0)
    assert (info.value.from_seq, info.value.to_seq) == (1, 4)
    for bad in (-1, 8, 2.0, True, None):
        with pytest.raises(InvalidInput):
            log.batches_since(bad)


def test_publish_refuses_what_is_not_a_cache_event_and_takes_no_number() -> None:
    log = EventLog()
    for bad in ([EventsDropped(from_seq=1, to_seq=2)], ["BlockRemoved"], [None]):
        with pytest.raises(InvalidInput):
            log.publish(bad)
    assert log.last_seq == 0 and log.batches_since(0) == []
    with pytest.raises(InvalidInput):
        EventLog(window=-1)


@pytest.mark.anyio
async def test_since_replays_the_window_then_live_batches_without_duplicate_or_gap() -> None:
    hub = EventHub(window=4)
    for i in range(6):
        hub.publish(removed(i))
    sub = hub.subscribe(since=3, buffer=2)
    for i in range(6, 9):  # live batches while the replay is still unread; the third overflows
        hub.publish(removed(i))
    got = []
    with anyio.fail_after(10):  # hang guard
        async for batch in sub:
            got.append(batch)
            if len(got) == 6:
                break
    assert seqs(got) == [4, 5, 6, 7, 8, (9, 9)]
    with pytest.raises(EventsGap):
        hub.subscribe(since=1)
    sub.close()


@pytest.mark.anyio
async def test_slow_subscriber_gets_one_marker_with_the_exact_range_and_never_blocks_the_publisher() -> None:
    hub = EventHub()
    fast, slow = hub.subscribe(buffer=64), hub.subscribe(buffer=2)
    for i in range(10):  # synchronous: publish cannot await a reader
        assert hub.publish(removed(i)).seq == i + 1
    assert seqs(drain(fast)) == list(range(1, 11))
    first = await slow.__anext__()
    hub.publish(removed(10))  # seq 11: room for the marker but not for 11 itself
    rest = [first, *drain(slow)]
    assert seqs(rest) == [1, 2, (3, 10), (11, 11)]
    marker = rest[2]
    assert marker.seq == 10 and marker.events == (EventsDropped(from_seq=3, to_seq=10),)
    hub.publish(removed(11))
    assert seqs(drain(slow)) == [12]
    fast.close()
    slow.close()


@pytest.mark.anyio
async def test_a_gap_is_delivered_when_the_buffer_drains_even_if_nothing_more_is_published() -> None:
    hub = EventHub()
    sub = hub.subscribe(buffer=1)
    for i in range(3):
        hub.publish(removed(i))
    with anyio.fail_after(10):
        assert seqs([await sub.__anext__(), await sub.__anext__()]) == [1, (2, 3)]
        hub.close()
        assert [b async for b in sub] == []
    assert sub.ended


@pytest.mark.anyio
async def test_closing_the_hub_ends_every_iterator_after_what_it_holds() -> None:
    hub = EventHub()
    got: dict[int, list] = {0: [], 1: []}
    subs = [hub.subscribe(buffer=8), hub.subscribe(buffer=1)]

    async def read(n: int) -> None:
        async for batch in subs[n]:
            got[n].append(batch)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, 0)
            tg.start_soon(read, 1)
            await anyio.wait_all_tasks_blocked()
            hub.publish(removed(0))
            hub.publish(removed(1))
            hub.close()
    assert seqs(got[0]) == [1, 2]
    assert seqs(got[1]) == [1, 2]  # a waiting reader takes each batch as it is published
    assert hub.num_subscribers == 0
    with pytest.raises(ManagerClosed):
        hub.publish(removed(2))
    late = hub.subscribe(since=0)
    assert seqs([b async for b in late]) == [1, 2]


@pytest.mark.anyio
async def test_cancellation_and_break_remove_the_subscriber() -> None:
    hub = EventHub()
    cancelled = hub.subscribe()

    async def wait_forever() -> None:
        async for _ in cancelled:
            pass

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_forever)
            await anyio.wait_all_tasks_blocked()
            assert hub.num_subscribers == 1
            tg.cancel_scope.cancel()
    assert hub.num_subscribers == 0 and cancelled.ended

    async with hub.subscribe() as sub:
        hub.publish(removed(0))
        async for _ in sub:
            break
    assert hub.num_subscribers == 0

    sub = hub.subscribe()
    hub.publish(removed(1))
    async for _ in sub:
        break
    assert hub.num_subscribers == 1
    del sub  # a subscription dropped after a break is forgotten, its streams closed
    gc.collect()
    assert hub.num_subscribers == 0
    hub.publish(removed(2))


def test_subscribe_refuses_bad_arguments() -> None:
    hub = EventHub()
    for buffer in (0, -1, 1.5, True):
        with pytest.raises(InvalidInput):
            hub.subscribe(buffer=buffer)
    for since in (-1, 1, "0"):
        with pytest.raises(InvalidInput):
            hub.subscribe(since=since)
    assert hub.num_subscribers == 0
