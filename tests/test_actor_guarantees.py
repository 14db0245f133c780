"""Each guarantee stated in :mod:`akv.actors.runtime`'s docstring, checked on a real actor.

FIFO under contention, cancellation before and after a message is served
(unshielded and shielded), a crash failing the queued asks, close, stop and a
cancelled ``run`` failing or draining them. Every test runs on asyncio and
trio (``AKV_TEST_BACKENDS`` replaces the list, e.g. with uvloop). Tasks are
lined up with ``anyio.wait_all_tasks_blocked`` (every other task is parked on
something), never with sleeps.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import anyio
import pytest
from test_cancellation import TRIO_OK

from akv.actors.runtime import Actor
from akv.errors import ActorCrashed, AkvError, InvalidInput, ManagerClosed

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", pytest.param("trio", marks=TRIO_OK)])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Both backends (overridden by ``AKV_TEST_BACKENDS``)."""
    return request.param


class Probe(Actor):
    """Records what it served; ``"bad"`` is a typed error, ``"boom"`` a crash, a cancel scope is cancelled."""

    def __init__(self, *, direct: bool = False, inbox_capacity: int = 16) -> None:
        super().__init__("probe", inbox_capacity, direct=direct)
        self.seen: list[Any] = []

    def handle(self, msg: Any) -> Any:
        if msg == "bad":
            raise InvalidInput("bad message")
        if msg == "boom":
            raise RuntimeError("boom")
        if isinstance(msg, anyio.CancelScope):
            msg.cancel()  # the asker's scope: cancelled while its message is being served
        self.seen.append(msg)
        return ("reply", msg)


async def _ask(actor: Actor, msg: Any, out: dict[Any, Any], **kwargs: Any) -> None:
    """``out[msg]`` = the reply, or the ``AkvError`` the ask raised."""
    try:
        out[msg] = await actor.ask(msg, **kwargs)
    except AkvError as exc:
        out[msg] = exc


async def _spawn(tg: anyio.abc.TaskGroup, fn: Any, *args: Any) -> None:
    """Start ``fn(*args)`` and return once it (and every other task) is parked."""
    tg.start_soon(fn, *args)
    await anyio.wait_all_tasks_blocked()


class _SendLog(deque):
    """An inbox that logs each message as it enters (white box: the moment a queued ask is sent)."""

    def __init__(self, sent: list[Any]) -> None:
        super().__init__()
        self.sent = sent

    def append(self, item: tuple[Any, Any]) -> None:
        self.sent.append(item[0])
        super().append(item)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "queued"])
async def test_fifo_under_contention(direct: bool) -> None:
    """8 tasks x 25 asks into a 3-message inbox: served one by one, in the order they were sent."""
    actor = Probe(direct=direct, inbox_capacity=3)
    sent: list[Any] = []
    actor._inbox = _SendLog(sent)
    served_direct: list[Any] = []
    handle = actor.handle

    def handle_and_log(msg: Any) -> Any:
        if msg not in sent:  # not queued: a direct ask is sent when it is served
            sent.append(msg)
            served_direct.append(msg)
        return handle(msg)

    actor.handle = handle_and_log
    out: dict[Any, Any] = {}

    async def sender(task: int) -> None:
        rng = random.Random(task)
        for i in range(25):
            for _ in range(rng.randrange(3)):
                await anyio.lowlevel.checkpoint()
            await _ask(actor, (task, i), out)

    with anyio.fail_after(30):  # a hang guard
        async with anyio.create_task_group() as tg:
            for task in range(8):
                tg.start_soon(sender, task)
            await anyio.wait_all_tasks_blocked()  # 3 queued, 5 waiting for room: contention
            assert actor.inbox_depth == 3 and not actor.seen
            tg.start_soon(actor.run)
            await anyio.wait_all_tasks_blocked()
            actor.close()
    assert actor.seen == sent
    assert sorted(actor.seen) == [(t, i) for t in range(8) for i in range(25)]
    for task in range(8):
        assert [i for t, i in actor.seen if t == task] == list(range(25))
    assert out == {msg: ("reply", msg) for msg in actor.seen}
    assert actor.max_inbox_depth == 3 and actor.messages_direct == len(served_direct)
    assert bool(served_direct) == direct


async def test_cancelled_before_served_is_withdrawn_and_never_served() -> None:
    """An unshielded ask cancelled while queued sends nothing: its message leaves the inbox and frees its room."""
    actor = Probe(inbox_capacity=1)
    out: dict[Any, Any] = {}
    replies: list[Any] = []
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def cancelled_ask() -> None:
            with scope:
                await actor.ask("a", on_reply=replies.append)

        await _spawn(tg, cancelled_ask)  # queued: the actor is not started
        await _spawn(tg, _ask, actor, "b", out)  # waits for room
        assert actor.inbox_depth == 1
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert scope.cancelled_caught and actor.inbox_depth == 1  # "a" withdrawn, "b" took its room
        tg.start_soon(actor.run)
        await anyio.wait_all_tasks_blocked()
        actor.close()
    assert actor.seen == ["b"] and out == {"b": ("reply", "b")}
    assert replies == [] and actor.messages_handled == 1


@pytest.mark.parametrize("shield", [False, True])
async def test_cancelled_after_served_still_delivers_to_on_reply(shield: bool) -> None:
    """The asker is cancelled while its message is served: the result reaches ``on_reply``, then the cancellation."""
    actor = Probe()
    replies: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await anyio.wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            await actor.ask(scope, shield=shield, on_reply=replies.append)  # the handler cancels `scope`
            pytest.fail("the ask returned in a cancelled scope")
        actor.close()
    assert scope.cancelled_caught
    assert actor.seen == [scope] and replies == [("reply", scope)]


async def test_shielded_ask_is_served_although_cancelled_while_queued() -> None:
    """``shield=True``: a queued message is served, ``on_reply`` gets it, then the cancellation is re-raised."""
    actor = Probe()
    replies: list[Any] = []
    events: list[str] = []
    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def shielded_ask() -> None:
            with scope:
                await actor.ask("a", shield=True, on_reply=replies.append)
                events.append("returned")  # never: the cancellation is re-raised after the reply
            events.append("cancelled" if scope.cancelled_caught else "not cancelled")

        await _spawn(tg, shielded_ask)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert actor.inbox_depth == 1 and not events  # still queued, the asker still waits
        tg.start_soon(actor.run)
        await anyio.wait_all_tasks_blocked()
        actor.close()
    assert actor.seen == ["a"] and replies == [("reply", "a")] and events == ["cancelled"]


async def test_crash_fails_queued_and_waiting_asks_with_actor_crashed() -> None:
    actor = Probe(inbox_capacity=3)
    crashes: list[BaseException] = []
    actor.on_crash = lambda a, err: crashes.append(err)
    out: dict[Any, Any] = {}
    async with anyio.create_task_group() as tg:
        for msg in ("boom", 1, 2, 3):  # one at a time, so the inbox order is known; 3 waits for room
            await _spawn(tg, _ask, actor, msg, out)
        assert actor.inbox_depth == 3
        tg.start_soon(actor.run)
    (err,) = crashes
    assert isinstance(err, ActorCrashed) and isinstance(err.__cause__, RuntimeError)
    assert all(out[msg] is err for msg in ("boom", 1, 2, 3)) and actor.seen == []
    assert actor.messages_handled == 1 and actor.inbox_depth == 0


async def test_close_serves_queued_asks_and_refuses_the_rest_with_manager_closed() -> None:
    actor = Probe(inbox_capacity=2)
    out: dict[Any, Any] = {}
    async with anyio.create_task_group() as tg:
        for msg in (1, 2, 3):  # 3 waits for room
            await _spawn(tg, _ask, actor, msg, out)
        actor.close()
        await anyio.wait_all_tasks_blocked()
        assert isinstance(out.pop(3), ManagerClosed) and actor.inbox_depth == 2  # woken, nothing queued
        with pytest.raises(ManagerClosed):
            await actor.ask(4)
        tg.start_soon(actor.run)  # drains the two queued, then returns
    assert actor.seen == [1, 2] and out == {1: ("reply", 1), 2: ("reply", 2)}
    with pytest.raises(ManagerClosed):
        await actor.ask(5)


async def test_stop_fails_queued_asks_with_its_error() -> None:
    actor = Probe()
    out: dict[Any, Any] = {}
    error = ActorCrashed("elsewhere", RuntimeError("another actor"))

    async def stop() -> None:
        actor.stop(error)

    async with anyio.create_task_group() as tg:
        await _spawn(tg, _ask, actor, 1, out)  # queued before the actor starts
        tg.start_soon(actor.run)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(_ask, actor, 2, out)  # queued, waking the actor...
        tg.start_soon(stop)  # ...which is stopped before it runs again
    assert out == {1: ("reply", 1), 2: error} and actor.seen == [1]
    with pytest.raises(ActorCrashed) as info:
        await actor.ask(3)
    assert info.value is error


async def test_cancelled_run_fails_queued_asks_with_manager_closed() -> None:
    """The owner's task group is cancelled with a message queued: the ask fails instead of hanging."""
    actor = Probe()
    out: dict[Any, Any] = {}
    async with anyio.create_task_group() as tg:
        run_scope = anyio.CancelScope()

        async def run() -> None:
            with run_scope:
                await actor.run()

        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()

        async def cancel_run_then_ask() -> None:
            run_scope.cancel()  # lands before the actor's task runs again
            await _ask(actor, 1, out)

        tg.start_soon(cancel_run_then_ask)
    assert isinstance(out[1], ManagerClosed) and actor.seen == []
    assert not actor.can_serve_now


async def test_on_reply_on_the_direct_path_and_not_on_an_error() -> None:
    actor = Probe(direct=True)
    replies: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await anyio.wait_all_tasks_blocked()
        assert await actor.ask(1, on_reply=replies.append) == ("reply", 1)
        with pytest.raises(InvalidInput):
            await actor.ask("bad", on_reply=replies.append)
        actor.close()
    assert replies == [("reply", 1)] and actor.messages_direct == 2
