"""Copy completion under load: async waiters of a copy ticket hold no thread (asyncio, uvloop, trio).

Regression (issue 13, "Copy waits under load"): each ``CopyTicket.wait_async``
parked an anyio worker thread, so 512 concurrent waits exhausted the default
thread limiter (40 tokens) and `akv stress --sequences 512` reported copy waits
past the 10 s hung threshold. Completion is now signalled into the event loop,
one thread-safe call per loop and batch; every test checks that no waiter
borrows a worker thread while it waits.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import anyio
import anyio.to_thread
import pytest
import torch
from anyio import wait_all_tasks_blocked

from akv.errors import ActorCrashed, ManagerClosed
from akv.manager import KVCacheManager
from akv.storage import CopyExecutor, CopyTicket, KVStorage
from akv.stress.fault import FaultInjector

pytestmark = pytest.mark.anyio


NO_UVLOOP = pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build")


@pytest.fixture(
    params=["asyncio", pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop", marks=NO_UVLOOP), "trio"]
)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    """Every test here runs on asyncio, on asyncio with uvloop's loop, and on trio."""
    return request.param


def make_storage(num_blocks: int = 8) -> KVStorage:
    storage = KVStorage(
        num_blocks=num_blocks, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"
    )
    for cache in storage.kv_caches:
        cache.normal_()
    return storage


def borrowed_worker_threads() -> int:
    """Tokens of anyio's default thread limiter in use: one per ``to_thread.run_sync`` call running."""
    return anyio.to_thread.current_default_thread_limiter().borrowed_tokens


async def start_waiters(tg: anyio.abc.TaskGroup, ticket: CopyTicket, n: int, outcomes: list) -> None:
    """Start ``n`` tasks awaiting ``ticket``; each appends ``"done"`` or its exception's class to ``outcomes``."""

    async def waiter() -> None:
        try:
            await ticket.wait_async()
        except Exception as exc:
            outcomes.append(type(exc))
        else:
            outcomes.append("done")

    for _ in range(n):
        tg.start_soon(waiter)
    await wait_all_tasks_blocked()


async def test_thousand_waiters_on_one_ticket_hold_no_thread() -> None:
    storage = make_storage()
    executor = CopyExecutor(storage)
    ticket = executor.submit([1], [2])  # no worker yet: stays pending
    threads_before = set(threading.enumerate())
    outcomes: list = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await start_waiters(tg, ticket, 1000, outcomes)
            assert borrowed_worker_threads() == 0
            assert set(threading.enumerate()) <= threads_before  # no new thread (others may have ended)
            assert [w.count for w in ticket._loop_waiters] == [1000]  # one shared event for the loop
            assert outcomes == []
            executor.start()  # the worker thread runs the batch and wakes all 1000 with one call
    assert outcomes == ["done"] * 1000
    assert ticket._loop_waiters == []
    assert torch.equal(storage.kv_caches[0][:, 2], storage.kv_caches[0][:, 1])
    await ticket.wait_async()  # already done: returns at once
    executor.close()


async def test_cancelled_waiters_leave_nothing_and_later_waiters_are_woken() -> None:
    executor = CopyExecutor(make_storage())
    first, second = executor.submit([1], [2]), executor.submit([3], [4])
    kept: list = []
    cancelled: list = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as doomed:
                    await start_waiters(doomed, first, 50, cancelled)
                    await start_waiters(doomed, second, 50, cancelled)
                    await start_waiters(tg, first, 50, kept)
                    assert borrowed_worker_threads() == 0
                    scope.cancel()
            assert scope.cancelled_caught and cancelled == []
            # The 50 cancelled waiters of `first` left its shared event; all of `second` unregistered it.
            assert [w.count for w in first._loop_waiters] == [50]
            assert second._loop_waiters == []
            await start_waiters(tg, second, 10, kept)  # a later waiter registers afresh
            assert [w.count for w in second._loop_waiters] == [10]
            assert borrowed_worker_threads() == 0
            executor.start()
    assert kept == ["done"] * 60
    assert first._loop_waiters == [] and second._loop_waiters == []
    executor.close()


async def test_failed_copy_raises_in_every_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = make_storage()

    def device_lost(src: torch.Tensor, dst: torch.Tensor) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(storage, "_copy_unchecked", device_lost)
    executor = CopyExecutor(storage)
    failed, after = executor.submit([1], [2]), executor.submit([3], [4])
    outcomes: dict[str, list] = {"failed": [], "after": []}
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await start_waiters(tg, failed, 200, outcomes["failed"])
            await start_waiters(tg, after, 200, outcomes["after"])
            assert borrowed_worker_threads() == 0
            executor.start()
    # The failing batch's error is ActorCrashed caused by the device error; the
    # executor is then broken, so the next batch fails too (unordered data).
    assert outcomes == {"failed": [ActorCrashed] * 200, "after": [ActorCrashed] * 200}
    assert isinstance(failed.exception().__cause__, RuntimeError)
    with pytest.raises(ActorCrashed):
        await failed.wait_async()  # a waiter after the failure raises at once
    executor.close()


async def test_closing_executor_without_drain_fails_pending_waiters() -> None:
    executor = CopyExecutor(make_storage())
    tickets = [executor.submit([i], [i + 4]) for i in range(4)]
    outcomes: list = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for ticket in tickets:
                await start_waiters(tg, ticket, 100, outcomes)
            assert borrowed_worker_threads() == 0
            await anyio.to_thread.run_sync(lambda: executor.close(drain=False))  # from another thread
    assert outcomes == [ManagerClosed] * 400


async def test_manager_crash_fails_pending_copy_waits_and_none_hangs(tiny_config, monkeypatch) -> None:
    """A copy in flight completes, one queued behind it fails with ManagerClosed, both wake every waiter."""
    gate, entered = threading.Event(), threading.Event()
    real_copy = KVStorage._copy_unchecked

    def gated_copy(self: KVStorage, src: torch.Tensor, dst: torch.Tensor) -> None:
        entered.set()
        if not gate.wait(timeout=60):
            raise RuntimeError("test gate never opened")
        real_copy(self, src, dst)

    monkeypatch.setattr(KVStorage, "_copy_unchecked", gated_copy)
    outcomes: dict[str, list] = {"running": [], "queued": [], "wait_copies": []}
    with anyio.fail_after(60), pytest.raises(ActorCrashed):
        async with KVCacheManager(tiny_config()) as kv:
            try:
                await kv.add_sequence("a", [1, 2, 3, 4, 5])  # a partial tail block, shared by the forks
                await kv.fork("a", ["b", "c"])
                running = (await kv.append("b", [6])).copies  # copy-on-write of the tail: enters the gate
                await anyio.to_thread.run_sync(entered.wait, 60)
                queued = (await kv.append("c", [7])).copies  # queued behind the running copy
                async with anyio.create_task_group() as tg:
                    for name, ticket in (("running", running.tickets[0]), ("queued", queued.tickets[0])):
                        await start_waiters(tg, ticket, 100, outcomes[name])

                    async def wait_all() -> None:
                        try:
                            await kv.wait_copies()
                        except Exception as exc:
                            outcomes["wait_copies"].append(type(exc))

                    tg.start_soon(wait_all)
                    await wait_all_tasks_blocked()
                    assert borrowed_worker_threads() == 0
                    FaultInjector(kv, "crash").arm()
                    with pytest.raises(ActorCrashed):
                        await kv.stats()  # the shard crashes; the manager closes its executor
                    gate.set()  # the running copy completes, then the queued one fails
            finally:
                gate.set()
    assert outcomes == {"running": ["done"] * 100, "queued": [ManagerClosed] * 100, "wait_copies": [ManagerClosed]}
    with pytest.raises(ManagerClosed):
        await queued.wait()  # after exit: raises at once, never hangs


def test_batch_finishing_after_its_waiters_loop_closed_still_settles() -> None:
    """The waiters' loop is closed with a waiter still registered: the wake-up is dropped, nothing raises."""
    executor = CopyExecutor(make_storage())
    ticket = executor.submit([1], [2])
    loop = asyncio.new_event_loop()

    async def park() -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(ticket.wait_async())
        await wait_all_tasks_blocked()
        return task

    try:
        task = loop.run_until_complete(park())
        assert [w.count for w in ticket._loop_waiters] == [1]
    finally:
        loop.close()  # the parked task is never resumed
    executor.close()  # runs the batch here; call_soon_threadsafe on the closed loop raises, and is dropped
    assert ticket.done() and ticket.exception() is None and ticket._loop_waiters == []
    assert not task.done()
    anyio.run(ticket.wait_async)  # a waiter in another loop returns at once
