"""Cancellation at any await point of any public call leaks nothing (issue 3).

For every public call, the call runs under a cancel scope that a helper task
cancels after it has passed ``k`` scheduler checkpoints (:mod:`tests.checkpoints`),
for k = 0 (cancelled before the call starts), 1, 2, ... until the call
finishes before the cancellation lands; past ``K_MAX // 2`` checkpoints the
helper first waits for the copies submitted so far (``kv.wait_copies()``), so
the cancellation lands after the copy thread ran. The sweep runs with the
shards serving on the caller's task (``direct``) and through their inboxes
(``queued``). After each try the test cleans up by id (``free`` is
idempotent) and asserts the full consistency check passes, no block is active
or in flight, and no sequence is left.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import pytest

from akv.actors.messages import Step
from akv.actors.pool_shard import PoolShardActor
from akv.core.step import Admit
from akv.errors import PoolExhausted
from akv.manager import KVCacheManager
from akv.storage import KVStorage
from akv.stress.kv_io import prefill
from tests.checkpoints import run_cancelled

pytestmark = pytest.mark.anyio


#: anyio 4 passes ``abandon_on_cancel`` to ``trio.to_thread.run_sync``, which trio added in 0.23;
#: with an older trio every thread call (the manager's stream worker) raises TypeError.
def _trio_usable() -> bool:
    try:
        major, minor = (int(x) for x in importlib.metadata.version("trio").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (0, 23)


TRIO_OK = pytest.mark.skipif(
    not _trio_usable(), reason="needs trio >= 0.23 (anyio 4 passes to_thread.run_sync(abandon_on_cancel=...))"
)

K_MAX = 80
IDS = ("s0", "s1", "s2", "c1", "c2", "new", "a", "b")
PROMPT = [1, 2, 3, 4, 5, 6]

Setup = Callable[[KVCacheManager], Awaitable[None]]
Call = Callable[[KVCacheManager], Awaitable[object]]


async def _nothing(kv: KVCacheManager) -> None:
    return None


async def _one(kv: KVCacheManager) -> None:
    await prefill(kv, "s0", PROMPT)


async def _forked(kv: KVCacheManager) -> None:
    await prefill(kv, "s0", PROMPT)
    await kv.fork("s0", ["s1"])


_pending: dict[str, int] = {}


async def _uncommitted(kv: KVCacheManager) -> None:
    cached = await kv.add_sequence("s0", PROMPT)  # a hit after the first try: commit only the rest
    _pending["s0"] = len(PROMPT) - cached


async def _cached(kv: KVCacheManager) -> None:
    await prefill(kv, "a", list(range(100, 121)))  # 5 full blocks + 1 token, then cached
    await kv.free("a")


async def _mixed(kv: KVCacheManager) -> None:
    await prefill(kv, "s0", PROMPT)
    await kv.add_sequence("s1", [7, 8, 9])
    await prefill(kv, "s2", [1, 2, 3, 4, 50])


async def _full(kv: KVCacheManager) -> None:
    await prefill(kv, "s0", list(range(200, 260)))  # 15 of 16 blocks


async def _append_and_wait(kv: KVCacheManager) -> None:
    result = await kv.append("s1", [9])  # copy-on-write of the shared tail
    await result.copies.wait()


async def _admit_exhausted(kv: KVCacheManager) -> None:
    with contextlib.suppress(PoolExhausted):
        await kv.add_sequence("new", list(range(300, 312)))


async def _step_mixed(kv: KVCacheManager) -> None:
    await kv.step(
        frees=["s2"],
        commits={"s1": 3},
        forks=[("s0", ["c1"])],
        appends={"c1": [9], "s0": [10, 11]},
        admits=[Admit(seq_id="new", prompt=[1, 2, 3, 4, 60])],
    )


SCENARIOS: dict[str, tuple[Setup, Call]] = {
    "add_sequence": (_nothing, lambda kv: kv.add_sequence("new", PROMPT)),
    "add_sequence_prefix_hit": (_cached, lambda kv: kv.add_sequence("new", list(range(100, 115)))),
    "add_sequence_evicting": (_cached, lambda kv: kv.add_sequence("new", list(range(400, 460)))),
    "add_sequence_exhausted": (_full, _admit_exhausted),
    "step_admit": (_nothing, lambda kv: kv.step(admits=[Admit(seq_id="new", prompt=PROMPT)])),
    "step_mixed": (_mixed, _step_mixed),
    "append": (_one, lambda kv: kv.append("s0", [9, 10, 11])),
    "append_cow_and_wait": (_forked, _append_and_wait),
    "commit": (_uncommitted, lambda kv: kv.commit("s0", _pending["s0"])),
    "fork": (_one, lambda kv: kv.fork("s0", ["c1", "c2"])),
    "free": (_forked, lambda kv: kv.free("s0")),
    "sequence": (_one, lambda kv: kv.sequence("s0")),
    "lookup": (_cached, lambda kv: kv.lookup(list(range(100, 121)))),
    "stats": (_one, lambda kv: kv.stats()),
    "check": (_one, lambda kv: kv.check()),
    "wait_copies": (_forked, lambda kv: _append_then_wait_copies(kv)),
}

#: Calls shielded from cancellation: they complete whatever the checkpoint (free() is cleanup).
UNCANCELLABLE = frozenset({"free"})


async def _append_then_wait_copies(kv: KVCacheManager) -> None:
    await kv.append("s1", [9])
    await kv.wait_copies()


async def _run_cancelled(kv: KVCacheManager, call: Call, k: int) -> bool:
    """Run ``call`` under a scope cancelled after ``k`` checkpoints (0: before it starts); True if it finished first.

    Past ``K_MAX // 2`` pure event-loop checkpoints a call waits on the copy
    thread: the canceller then first waits for every copy submitted so far to
    have run, so the later cancellation points land after the copy.
    """
    return await run_cancelled(lambda: call(kv), k, wait=kv.wait_copies, wait_at=K_MAX // 2)


async def _assert_clean(kv: KVCacheManager) -> None:
    with anyio.CancelScope(shield=True):
        for seq_id in IDS:
            await kv.free(seq_id)
    await kv.wait_copies()
    await kv.check()
    # A step whose caller was cancelled after the shard replied still records its copy ticket,
    # so wait_copies() waited for that copy too and the shard settles it on the next message.
    s = await kv.stats()
    assert (s.active, s.in_flight, s.num_sequences) == (0, 0, 0)
    assert s.free + s.cached == s.num_blocks


@pytest.mark.parametrize("anyio_backend", ["asyncio", pytest.param("trio", marks=TRIO_OK)])
@pytest.mark.parametrize("path", ["direct", "queued"])
@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_cancel_at_every_checkpoint_leaks_nothing(tiny_config, name: str, path: str) -> None:
    """``direct``: an idle shard serves each message on the caller's task (one cancellation point per
    ask); ``queued``: every message goes through the shard's inbox and task (more await points)."""
    setup, call = SCENARIOS[name]
    cancelled_at: list[int] = []
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        for shard in kv._shards:
            shard.direct = path == "direct"
        for k in range(K_MAX + 1):
            await setup(kv)
            finished = await _run_cancelled(kv, call, k)
            await _assert_clean(kv)
            if finished:
                break
            cancelled_at.append(k)
        else:
            pytest.fail(f"{name}: still cancelled after {K_MAX} checkpoints")
    if name in UNCANCELLABLE:
        assert not cancelled_at, f"{name}: cancelled at checkpoints {cancelled_at}; it is shielded"
    else:
        assert cancelled_at, f"{name}: never cancelled; the sweep did not reach the call's await points"


@pytest.mark.parametrize("anyio_backend", ["asyncio", pytest.param("trio", marks=TRIO_OK)])
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_free_in_finally_of_a_cancelled_request_releases_its_blocks(tiny_config, num_shards: int) -> None:
    """The natural cleanup pattern: ``try: ... finally: await kv.free(id)`` in a request task that
    gets cancelled. free() is shielded, so the blocks come back (fresh-eyes report: they leaked)."""
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=num_shards)) as kv:
        started = 0
        all_started = anyio.Event()

        async def request(seq_id: str) -> None:
            nonlocal started
            try:
                await kv.add_sequence(seq_id, list(range(1, 10)))
                started += 1
                if started == 4:
                    all_started.set()
                await anyio.sleep_forever()
            finally:
                assert await kv.free(seq_id) is True

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(request, f"r{i}")
            with anyio.fail_after(60):  # a hang guard
                await all_started.wait()
            tg.cancel_scope.cancel()
        await kv.check()
        s = await kv.stats()
        assert (s.num_sequences, s.active) == (0, 0)
        assert s.free + s.cached == s.num_blocks


@pytest.mark.parametrize("anyio_backend", ["asyncio", pytest.param("trio", marks=TRIO_OK)])
async def test_wait_copies_waits_for_the_copy_of_a_step_whose_caller_was_cancelled(tiny_config, monkeypatch) -> None:
    """The caller of a copy-on-write append is cancelled while its queued step is served: the step is
    applied and its copy submitted, and ``wait_copies()`` still waits for that copy (the copy is made
    slow so that it has not run by the next message unless waited for)."""
    real_copy = KVStorage._copy_unchecked
    copy_started = threading.Event()

    def slow_copy(self: KVStorage, src, dst) -> None:
        copy_started.set()
        time.sleep(0.2)  # on the copy thread: widens the window in which the blocks are in flight
        real_copy(self, src, dst)

    monkeypatch.setattr(KVStorage, "_copy_unchecked", slow_copy)
    scope = anyio.CancelScope()
    real_handle = PoolShardActor.handle

    def handle_then_cancel(self: PoolShardActor, msg):
        result = real_handle(self, msg)
        if isinstance(msg, Step):
            scope.cancel()  # on the shard's task, before the reply: the caller is cancelled mid-wait
        return result

    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        await _forked(kv)
        kv._shards[0].direct = False  # the append is queued: the caller waits for the reply
        monkeypatch.setattr(PoolShardActor, "handle", handle_then_cancel)
        with scope:
            await kv.append("s1", [9])
        assert scope.cancelled_caught
        monkeypatch.setattr(PoolShardActor, "handle", real_handle)
        assert (await kv.sequence("s1")).token_ids == (*PROMPT, 9)  # applied although cancelled
        await kv.wait_copies()
        assert copy_started.is_set()
        s = await kv.stats()
        assert (s.in_flight, s.cow_copies) == (0, 1)
        await _assert_clean(kv)
