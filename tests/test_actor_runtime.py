"""The actor runtime's direct hand-off: an idle actor serves an ask on the asking task.

Checked behaviourally, on asyncio and trio (``AKV_TEST_BACKENDS`` replaces the
list, e.g. with uvloop): which task ran the handler, that direct asks let other
tasks run, message order when asks queue, typed errors and crashes on either
path, and that a cancelled call through the manager applied exactly what its
caller observed. The other guarantees are in ``tests/test_actor_guarantees.py``.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from test_cancellation import TRIO_OK

from akv.actors.runtime import Actor
from akv.config import KVCacheConfig
from akv.errors import ActorCrashed, InvalidInput, ManagerClosed, UnknownSequence
from akv.manager import KVCacheManager


@pytest.fixture(params=["asyncio", pytest.param("trio", marks=TRIO_OK)])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on asyncio and on trio (overridden by ``AKV_TEST_BACKENDS``)."""
    return request.param


class Recorder(Actor):
    """Records each message and the task that served it; ``"bad"`` is a typed error, ``"boom"`` a crash."""

    def __init__(self, *, direct: bool = True, inbox_capacity: int = 16) -> None:
        super().__init__("recorder", inbox_capacity, direct=direct)
        self.seen: list[Any] = []
        self.task_ids: list[int] = []

    def handle(self, msg: Any) -> Any:
        if msg == "bad":
            raise InvalidInput("bad message")
        if msg == "boom":
            raise RuntimeError("boom")
        self.seen.append(msg)
        self.task_ids.append(anyio.get_current_task().id)
        return msg


async def _started(tg: anyio.abc.TaskGroup, actor: Actor) -> None:
    """Start ``actor.run`` and return once it waits for messages."""
    tg.start_soon(actor.run)
    await anyio.wait_all_tasks_blocked()


@pytest.mark.anyio
async def test_idle_actor_serves_on_the_askers_task() -> None:
    actor = Recorder()
    me = anyio.get_current_task().id
    async with anyio.create_task_group() as tg:
        await _started(tg, actor)
        assert actor.can_serve_now
        assert [await actor.ask(i) for i in range(5)] == [0, 1, 2, 3, 4]
        assert actor.task_ids == [me] * 5
        assert (actor.messages_handled, actor.messages_direct, actor.max_inbox_depth) == (5, 5, 0)
        assert actor.serve("sync") == "sync" and actor.task_ids[-1] == me
        actor.close()
    assert not actor.can_serve_now


@pytest.mark.anyio
async def test_direct_asks_let_other_tasks_run() -> None:
    """The direct path's checkpoint yields: a task that only asks an idle actor does not starve the others."""
    actor = Recorder()
    ran = anyio.Event()

    async def other() -> None:
        ran.set()

    async with anyio.create_task_group() as tg:
        await _started(tg, actor)
        tg.start_soon(other)
        for i in range(10):  # trio may run the other task one scheduling batch later
            await actor.ask(i)
            if ran.is_set():
                break
        assert ran.is_set() and actor.messages_direct == actor.messages_handled <= 10
        actor.close()


@pytest.mark.anyio
async def test_direct_false_queues_every_ask_for_the_actors_task() -> None:
    actor = Recorder(direct=False)
    me = anyio.get_current_task().id
    async with anyio.create_task_group() as tg:
        await _started(tg, actor)
        assert not actor.can_serve_now
        with pytest.raises(RuntimeError, match="cannot serve"):
            actor.serve(1)
        assert [await actor.ask(i) for i in range(3)] == [0, 1, 2]
        assert me not in actor.task_ids and len(set(actor.task_ids)) == 1
        assert (actor.messages_handled, actor.messages_direct, actor.max_inbox_depth) == (3, 0, 1)
        actor.close()


@pytest.mark.anyio
async def test_asks_queued_before_the_actor_starts_are_served_first_in_order() -> None:
    """The fallback: asks queue until ``run`` starts; a later ask comes after them, direct or queued."""
    actor = Recorder(inbox_capacity=4)
    replies: dict[Any, Any] = {}

    async def ask(i: Any) -> None:
        replies[i] = await actor.ask(i)

    async with anyio.create_task_group() as tg:
        for i in range(6):  # one at a time, so the inbox order is known; 4 fit, 2 wait for room
            tg.start_soon(ask, i)
            await anyio.wait_all_tasks_blocked()
        assert actor.inbox_depth == 4 and actor.max_inbox_depth == 4 and not actor.seen
        assert not actor.can_serve_now  # not started
        tg.start_soon(actor.run)
        await ask("late")  # queued behind the four, or served after they drained
        await anyio.wait_all_tasks_blocked()
        assert len(replies) == 7
        actor.close()
    assert actor.seen[:4] == [0, 1, 2, 3]  # 4 and 5 were not sent yet (no room): no order among them and "late"
    assert sorted(map(str, actor.seen[4:])) == ["4", "5", "late"]
    assert replies == {**{i: i for i in range(6)}, "late": "late"}
    assert actor.messages_handled == 7


@pytest.mark.anyio
async def test_concurrent_asks_from_a_task_group_are_served_in_inbox_order() -> None:
    """Asks from many tasks at once: served exactly in the order they entered the inbox, then a later one."""
    actor = Recorder()

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(actor.ask, i)
        await anyio.wait_all_tasks_blocked()
        assert actor.inbox_depth == 10
        arrival = [msg for msg, _reply in actor._inbox]  # white box: the queue order the scheduler produced
        tg.start_soon(actor.run)
        assert await actor.ask("late") == "late"
        actor.close()
    assert sorted(arrival) == list(range(10))
    assert actor.seen == [*arrival, "late"]
    assert actor.messages_handled == 11


@pytest.mark.anyio
async def test_typed_error_on_the_direct_path_fails_only_that_ask() -> None:
    actor = Recorder()
    async with anyio.create_task_group() as tg:
        await _started(tg, actor)
        with pytest.raises(InvalidInput, match="bad message"):
            await actor.ask("bad")
        assert actor.can_serve_now and await actor.ask(1) == 1
        assert (actor.messages_handled, actor.messages_direct) == (2, 2)
        actor.close()


@pytest.mark.anyio
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "queued"])
async def test_crash_gives_actor_crashed_and_stops_the_actor(direct: bool) -> None:
    """A crash on the direct path looks to every caller exactly like one on the queued path."""
    actor = Recorder(direct=direct)
    crashes: list[tuple[Actor, BaseException]] = []
    actor.on_crash = lambda a, err: crashes.append((a, err))
    with anyio.fail_after(30):  # a hang guard: the task group exits only once run() returned
        async with anyio.create_task_group() as tg:
            await _started(tg, actor)
            with pytest.raises(ActorCrashed) as info:
                await actor.ask("boom")
            err = info.value
            assert err.actor == "recorder" and isinstance(err.__cause__, RuntimeError)
            assert crashes == [(actor, err)]
            with pytest.raises(ActorCrashed) as later:
                await actor.ask(1)
            assert later.value is err
            assert not actor.can_serve_now and not actor.seen


@pytest.mark.anyio
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "queued"])
@pytest.mark.parametrize("shield", [False, True])
async def test_ask_cancelled_at_its_checkpoint_sends_nothing(direct: bool, shield: bool) -> None:
    actor = Recorder(direct=direct)
    async with anyio.create_task_group() as tg:
        await _started(tg, actor)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await actor.ask(1, shield=shield)
        assert scope.cancelled_caught
        assert await actor.ask(2) == 2
        assert actor.seen == [2] and actor.messages_handled == 1
        actor.close()


@pytest.mark.anyio
async def test_ask_after_close_raises_manager_closed() -> None:
    actor = Recorder()
    async with anyio.create_task_group() as tg:
        await _started(tg, actor)
        actor.close()
        with pytest.raises(ManagerClosed):
            await actor.ask(1)


def test_async_handler_is_refused_at_class_definition() -> None:
    with pytest.raises(TypeError, match="plain def"):

        class Bad(Actor):
            async def handle(self, msg: Any) -> Any:  # pragma: no cover - never called
                return msg


# ------------------------------------------------------------------ through the manager
def _config(**overrides: Any) -> KVCacheConfig:
    fields = {"num_blocks": 16, "block_size": 4, "vocab_size": 1000, "debug_invariants": True, "storage": "none"}
    fields.update(overrides)
    return KVCacheConfig(**fields)


@pytest.mark.anyio
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_cancelled_call_applied_exactly_what_its_caller_saw(num_shards: int) -> None:
    """With idle shards a call either returns (applied) or is cancelled (nothing applied): never both."""
    async with KVCacheManager(_config(num_shards=num_shards)) as kv:
        outcomes = []
        for k in range(8):
            seq_id = f"s{k}"
            scope = anyio.CancelScope()
            if k == 0:
                scope.cancel()

            async def cancel_after(n: int, scope: anyio.CancelScope = scope) -> None:
                for _ in range(n):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()

            cached = None
            async with anyio.create_task_group() as tg:
                if k:
                    tg.start_soon(cancel_after, k - 1)
                with scope:
                    cached = await kv.add_sequence(seq_id, [1, 2, 3, 4, 5])
            try:
                info = await kv.sequence(seq_id)
            except UnknownSequence:
                info = None
            if scope.cancelled_caught:
                assert cached is None and info is None, f"k={k}: cancelled, yet applied"
            else:
                assert cached is not None and info is not None and info.num_tokens == 5
            outcomes.append(scope.cancelled_caught)
        assert outcomes[0] and not outcomes[-1]
        await kv.check()


@pytest.mark.anyio
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "queued"])
async def test_shard_crash_fails_the_manager_on_either_path(direct: bool) -> None:
    kv = KVCacheManager(_config())
    with pytest.raises(ActorCrashed):
        async with kv:
            await kv.add_sequence("a", [1, 2, 3])
            shard = kv._shards[0]  # reaching in on purpose, as akv.stress.fault does
            shard.direct = direct
            original = shard.handle

            def handle(msg: Any) -> Any:
                if type(msg).__name__ == "Step":
                    raise RuntimeError("injected")
                return original(msg)

            shard.handle = handle
            with pytest.raises(ActorCrashed) as info:
                await kv.step(want_metadata=False)
            assert isinstance(info.value.__cause__, RuntimeError)
            with pytest.raises(ActorCrashed):
                await kv.stats()
            with pytest.raises(ActorCrashed):
                await kv.step(want_metadata=False)
    assert kv._phase == "failed"
