"""A ZeroMQ publisher of a manager's event batches, for consumers in other processes (``pip install 'akv[zmq]'``).

Modelled on vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``);
the wire format is the same, the payload is akv's (docs/events.md, "ZeroMQ"):

- live socket (XPUB, which a SUB reads exactly as vLLM's PUB): one multipart
  message per batch, ``[topic, seq as 8-byte big-endian, msgpack payload]``;
- replay socket (ROUTER, optional): a DEALER sends ``[b"", start_seq]`` (8-byte
  big-endian) and gets ``[b"", seq, payload]`` for every batch still in the
  window with ``seq >= start_seq``, then ``[b"", END_SEQ, b""]``;
- payload: msgpack of :func:`akv.events.jsonl.to_json` (keys as hex strings,
  namespaces tagged), so a consumer in any language decodes it.

A gap in the subscription (:class:`~akv.events.types.EventsDropped`) is
published as its own message (``seq == to_seq``), never skipped. Differences
from vLLM: an anyio task instead of a thread; the sequence numbers are the
manager's (from 1); endpoints are always bound; a malformed replay request is
answered with ``END_SEQ`` instead of being ignored; :meth:`ZmqEventPublisher.wait_subscribed`
lets a consumer that must see the first batch wait for its subscription.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

from akv.core.ids import describe
from akv.errors import InvalidInput

from .hub import Subscription
from .jsonl import from_json, to_json
from .types import EventBatch

try:
    import msgpack
    import zmq
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(f"akv.events.zmq_publisher needs pyzmq and msgpack: pip install 'akv[zmq]' ({error})") from error

__all__ = ["DEFAULT_BUFFER_STEPS", "END_SEQ", "ZmqEventPublisher", "decode_message"]

#: The seq frame that ends a replay (as vLLM's).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Batches the replay window keeps unless asked otherwise (as vLLM's ``buffer_steps``).
DEFAULT_BUFFER_STEPS = 10_000


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """The batch of a live message or of a replay reply (its last two frames are seq and payload).

    Args:
        frames: ``[topic, seq, payload]`` from a SUB socket, or ``[b"", seq, payload]`` from the replay socket.

    Returns:
        The batch, validated as on construction.

    Raises:
        InvalidInput: Not a batch message (fewer than 2 frames, a seq frame not of 8 bytes, a
            payload that is not msgpack of a batch, or a seq frame that differs from the batch's).
    """
    if not isinstance(frames, Sequence) or len(frames) < 2 or not all(type(f) is bytes for f in frames[-2:]):
        raise InvalidInput(f"a batch message ends with a seq frame and a payload frame (bytes); got {describe(frames)}")
    seq_frame, payload = frames[-2], frames[-1]
    if len(seq_frame) != 8 or seq_frame == END_SEQ:
        raise InvalidInput(f"the seq frame of a batch message is 8 bytes and not END_SEQ, got {seq_frame!r}")
    try:
        obj = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise InvalidInput(f"the payload of a batch message is not msgpack: {error}") from error
    batch = from_json(obj)
    if batch.seq != int.from_bytes(seq_frame, "big"):
        raise InvalidInput(f"the seq frame says {int.from_bytes(seq_frame, 'big')}, the payload {batch.seq}")
    return batch


class ZmqEventPublisher:
    """Drains a subscription and publishes each batch on a ZeroMQ socket (see the module docstring).

    Use ``async with ZmqEventPublisher(kv, "tcp://*:5557") as pub: ...`` (bound when entered,
    stopped at once on exit), or ``await pub.run()`` (returns when the subscription ends, i.e.
    when the manager exits, after publishing every batch). It runs once.

    Args:
        source: A manager with events on (its live batches are subscribed to at start) or a
            :class:`~akv.events.hub.Subscription` (e.g. ``kv.subscribe_events(since=0)``),
            which the publisher drains and closes.
        endpoint: Address the live socket binds (``tcp://*:5557``, ``tcp://127.0.0.1:*``, ``ipc://...``).
        topic: First frame of every live message (bytes).
        replay_endpoint: Address the replay socket binds, or ``None`` for none.
        buffer_steps: Batches the replay window keeps (an int >= 1).
        hwm: Send high-water mark of the live socket (messages per subscriber; 0: unlimited).
        logger: structlog logger (``structlog.get_logger("akv")`` unless given).

    Raises:
        InvalidInput: A bad argument (the endpoints are checked when binding, in :meth:`run`).
    """

    def __init__(
        self,
        source: Any,
        endpoint: str = "tcp://*:5557",
        topic: bytes = b"kv-events",
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = 100_000,
        logger: Any = None,
    ) -> None:
        if not isinstance(source, Subscription) and not callable(getattr(source, "subscribe_events", None)):
            raise InvalidInput(f"source must be a manager or a Subscription, got {describe(source)}")
        if type(endpoint) is not str or not (replay_endpoint is None or type(replay_endpoint) is str):
            raise InvalidInput(f"endpoints are str, got {describe(endpoint)} and {describe(replay_endpoint)}")
        if type(topic) is not bytes:
            raise InvalidInput(f"topic must be bytes, got {describe(topic)}")
        for name, value, low in (("buffer_steps", buffer_steps, 1), ("hwm", hwm, 0)):
            if type(value) is not int or value < low:
                raise InvalidInput(f"{name} must be an int >= {low}, got {describe(value)}")
        self._source, self._endpoints, self._topic, self._hwm = source, (endpoint, replay_endpoint), topic, hwm
        self._window: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._addresses: tuple[str | None, str | None] = (None, None)
        self._subscribed: anyio.Event | None = None
        self._num_published = 0
        self._started = False
        self._task_group: Any = None
        self._log = (logger or structlog.get_logger("akv")).bind(component="zmq_publisher", endpoint=endpoint)

    @property
    def address(self) -> str | None:
        """The address the live socket is bound to (``tcp://127.0.0.1:41234``), ``None`` before start."""
        return self._addresses[0]

    @property
    def replay_address(self) -> str | None:
        """The address the replay socket is bound to, ``None`` before start or without one."""
        return self._addresses[1]

    @property
    def num_published(self) -> int:
        """Batches (gap markers included) sent on the live socket so far."""
        return self._num_published

    async def wait_subscribed(self) -> None:
        """Wait until a SUB socket subscribed to a prefix of the topic (messages before that are not seen).

        Raises:
            InvalidInput: The publisher was not started.
        """
        if self._subscribed is None:
            raise InvalidInput("wait_subscribed() needs a started publisher (async with, or after run() started)")
        await self._subscribed.wait()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, then publish every batch of the subscription until it ends (or this task is cancelled).

        Raises:
            InvalidInput: Run twice, an endpoint cannot be bound (named), or the manager has events off
                (nothing is left open; a subscription passed in stays as it was).
        """
        await self._publish_all(*self._start(), task_status=task_status)

    def _start(self) -> tuple[Any, tuple[Any, Any], Subscription]:
        """The publisher's own context, its bound sockets and the subscription it drains."""
        if self._started:
            raise InvalidInput("a ZmqEventPublisher runs once")
        self._started = True
        self._subscribed = anyio.Event()
        context = zmq.Context()  # its own: no process-wide state
        try:
            sockets = self._bind(context)
            source = self._source
            return context, sockets, source if isinstance(source, Subscription) else source.subscribe_events()
        except BaseException:
            context.destroy(linger=0)
            raise

    async def _publish_all(
        self, context: Any, sockets: tuple[Any, Any], subscription: Subscription, *, task_status: TaskStatus[None]
    ) -> None:
        """Serve the sockets and publish the subscription's batches; close everything at the end."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._serve, sockets[0], self._on_subscription)
                if sockets[1] is not None:
                    tg.start_soon(self._serve, sockets[1], self._answer_replay)
                task_status.started()
                async for batch in subscription:
                    self._publish(sockets[0], batch)
                tg.cancel_scope.cancel()
        finally:
            subscription.close()
            context.destroy(linger=0)
            self._log.debug("zmq.closed", num_published=self._num_published)

    def _bind(self, context: Any) -> tuple[Any, Any]:
        """The live (XPUB) and replay (ROUTER or ``None``) sockets, bound; their addresses recorded."""
        sockets = []
        for kind, endpoint in ((zmq.XPUB, self._endpoints[0]), (zmq.ROUTER, self._endpoints[1])):
            if endpoint is None:
                sockets.append(None)
                continue
            sock = context.socket(kind)
            sock.linger = 0
            if kind == zmq.XPUB:
                sock.sndhwm = self._hwm
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as error:
                raise InvalidInput(f"cannot bind the ZeroMQ endpoint {endpoint!r}: {error}") from error
            sockets.append(sock)
        self._addresses = tuple(None if s is None else s.last_endpoint.decode() for s in sockets)
        self._log.info("zmq.bound", address=self._addresses[0], replay_address=self._addresses[1])
        return sockets[0], sockets[1]

    def _publish(self, sock: Any, batch: EventBatch) -> None:
        """Send one batch on the live socket (never blocks: over the high-water mark it drops) and window it."""
        payload = msgpack.packb(to_json(batch))
        sock.send_multipart([self._topic, batch.seq.to_bytes(8, "big"), payload])
        self._window.append((batch.seq, payload))
        self._num_published += 1
        if batch.dropped is not None:
            self._log.warning("zmq.gap_published", from_seq=batch.dropped.from_seq, to_seq=batch.dropped.to_seq)

    @staticmethod
    async def _serve(sock: Any, handle: Any) -> None:
        """Hand every incoming message of ``sock`` to ``handle``; the fd is edge-triggered, so drain before waiting."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await anyio.wait_readable(sock.fd)
                continue
            handle(sock, frames)

    def _on_subscription(self, sock: Any, frames: list[bytes]) -> None:
        """An XPUB subscription message: ``b"\\x01" + prefix`` subscribes, ``b"\\x00" + prefix`` unsubscribes."""
        message = frames[0]
        if message[:1] == b"\x01" and self._topic.startswith(message[1:]):
            self._log.debug("zmq.subscribed", prefix=message[1:])
            self._subscribed.set()

    def _answer_replay(self, sock: Any, frames: list[bytes]) -> None:
        """Answer ``[identity, b"", start_seq]`` with the window from ``start_seq``, then ``END_SEQ``."""
        identity = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._log.warning("zmq.bad_replay_request", num_frames=len(frames))
        else:
            start_seq = int.from_bytes(frames[2], "big")
            for seq, payload in self._window:
                if seq >= start_seq:
                    sock.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        sock.send_multipart([identity, b"", END_SEQ, b""])

    async def __aenter__(self) -> ZmqEventPublisher:
        started = self._start()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(partial(self._publish_all, *started, task_status=anyio.TASK_STATUS_IGNORED))
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self._task_group.cancel_scope.cancel()
        return await self._task_group.__aexit__(*exc_info)
