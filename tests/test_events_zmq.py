"""The ZeroMQ publisher: a real manager and hub, real sockets on 127.0.0.1, a real SUB and DEALER reading."""

from __future__ import annotations

import subprocess
import sys

import anyio
import anyio.to_thread
import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from akv.config import KVCacheConfig  # noqa: E402
from akv.errors import InvalidInput  # noqa: E402
from akv.events import AllBlocksCleared, EventHub, EventsDropped  # noqa: E402
from akv.events.zmq_publisher import END_SEQ, ZmqEventPublisher, decode_message  # noqa: E402
from akv.manager import KVCacheManager  # noqa: E402

pytestmark = pytest.mark.anyio
ENDPOINT = "tcp://127.0.0.1:*"  # a free port; the publisher's address says which


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _socket(context, kind: int, address: str):
    sock = context.socket(kind)
    sock.linger = 0
    sock.rcvtimeo = 20_000  # a hang guard: a missing message fails the test with zmq.Again
    if kind == zmq.SUB:
        sock.subscribe(b"kv-events")
    sock.connect(address)
    return sock


async def _recv(sock) -> list[bytes]:
    return await anyio.to_thread.run_sync(sock.recv_multipart)


async def _replay(context, address: str, start_seq: int) -> list:
    with _socket(context, zmq.DEALER, address) as dealer:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        while (frames := await _recv(dealer))[1] != END_SEQ:
            replies.append(decode_message(frames))
        return replies


async def _workload(kv: KVCacheManager) -> None:
    """Two publishes, a free (cached, no event) and a clear: three batches."""
    await kv.add_sequence("a", np.arange(1, 10, dtype=np.int32))
    await kv.commit("a", 9)
    await kv.add_sequence("b", np.arange(40, 49, dtype=np.int32))
    await kv.commit("b", 9)
    await kv.free("b")
    await kv.clear_prefix_cache()


async def test_batches_arrive_in_order_decode_equal_and_replay_returns_the_window(context) -> None:
    cfg = KVCacheConfig(num_blocks=32, block_size=4, storage="none", enable_events=True)
    async with KVCacheManager(cfg) as kv:
        truth = kv.subscribe_events()
        async with ZmqEventPublisher(kv, ENDPOINT, replay_endpoint=ENDPOINT) as pub:
            with _socket(context, zmq.SUB, pub.address) as sub:
                with anyio.fail_after(20):
                    await pub.wait_subscribed()
                await _workload(kv)
                expected = [truth.receive_nowait() for _ in range(kv.events_last_seq)]
                frames = [await _recv(sub) for _ in expected]
            assert [f[0] for f in frames] == [b"kv-events"] * 3
            assert [int.from_bytes(f[1], "big") for f in frames] == [1, 2, 3]
            assert [decode_message(f) for f in frames] == expected
            assert await _replay(context, pub.replay_address, 2) == expected[1:]
            assert await _replay(context, pub.replay_address, 0) == expected
            assert await _replay(context, pub.replay_address, 4) == []
        assert pub.num_published == 3


async def test_a_gap_is_published_as_its_own_message_and_run_ends_with_the_hub(context) -> None:
    hub = EventHub()
    pub = ZmqEventPublisher(hub.subscribe(buffer=1), ENDPOINT, topic=b"kv-events-7")
    before = {task.id for task in anyio.get_running_tasks()}
    async with anyio.create_task_group() as tg:
        await tg.start(pub.run)
        with _socket(context, zmq.SUB, pub.address) as sub:
            with anyio.fail_after(20):
                await pub.wait_subscribed()
            hub.publish([AllBlocksCleared()])
            assert decode_message(await _recv(sub)).seq == 1  # so the publisher waits on its subscription again
            for _ in range(4):  # no await between them: 2 goes to the waiting publisher, 3 fills the buffer
                hub.publish([AllBlocksCleared()])
            received = [decode_message(await _recv(sub)) for _ in range(3)]
        hub.close()  # the subscription ends, so run() returns by itself
    assert [(b.seq, b.events) for b in received] == [
        (2, (AllBlocksCleared(),)),
        (3, (AllBlocksCleared(),)),
        (5, (EventsDropped(from_seq=4, to_seq=5),)),
    ]
    assert pub.num_published == 4 and hub.num_subscribers == 0
    assert {task.id for task in anyio.get_running_tasks()} == before


async def test_closing_the_publisher_stops_it_and_leaves_no_task(context) -> None:
    hub = EventHub()
    before = {task.id for task in anyio.get_running_tasks()}
    async with ZmqEventPublisher(hub.subscribe(), ENDPOINT, replay_endpoint=ENDPOINT) as pub:
        hub.publish([AllBlocksCleared()])
        with _socket(context, zmq.DEALER, pub.replay_address) as dealer:
            dealer.send_multipart([b"", b"not 8 bytes"])  # malformed: answered with END_SEQ, not silence
            assert await _recv(dealer) == [b"", END_SEQ, b""]
    assert {task.id for task in anyio.get_running_tasks()} == before
    assert hub.num_subscribers == 0  # its subscription was closed
    with pytest.raises(InvalidInput, match="runs once"):
        await pub.run()


async def test_bad_arguments_and_endpoints_are_invalid_input_and_the_manager_keeps_running() -> None:
    hub = EventHub()
    with pytest.raises(InvalidInput, match="manager or a Subscription"):
        ZmqEventPublisher(object())
    with pytest.raises(InvalidInput, match="topic"):
        ZmqEventPublisher(hub.subscribe(), topic="kv")
    with pytest.raises(InvalidInput, match="buffer_steps"):
        ZmqEventPublisher(hub.subscribe(), buffer_steps=0)
    with pytest.raises(InvalidInput, match="nonsense://x"):
        async with ZmqEventPublisher(hub.subscribe(), "nonsense://x"):
            pass
    cfg = KVCacheConfig(num_blocks=16, block_size=4, storage="none")  # events off
    async with KVCacheManager(cfg) as kv:
        with pytest.raises(InvalidInput):
            async with ZmqEventPublisher(kv, ENDPOINT):
                pass
        await kv.add_sequence("a", np.arange(1, 6, dtype=np.int32))
        await kv.check()


def test_decode_message_refuses_what_is_not_a_batch() -> None:
    import msgpack

    good = msgpack.packb({"seq": 5, "ts": 1.0, "events": [{"type": "AllBlocksCleared"}]})
    assert decode_message([b"t", (5).to_bytes(8, "big"), good]).seq == 5
    for frames in (
        [good],
        [b"t", b"\x00" * 4, good],
        [b"t", END_SEQ, b""],
        [b"t", (5).to_bytes(8, "big"), b"\xc1"],
        [b"t", (6).to_bytes(8, "big"), good],
        [b"t", (5).to_bytes(8, "big"), msgpack.packb({"seq": 5})],
        "not frames",
    ):
        with pytest.raises(InvalidInput):
            decode_message(frames)


def test_akv_imports_without_pyzmq_and_the_publisher_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['zmq'] = None\n"
        "import akv, akv.events, akv.manager\n"
        "try:\n    import akv.events.zmq_publisher\n"
        "except ImportError as error:\n    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'akv[zmq]'" in out
