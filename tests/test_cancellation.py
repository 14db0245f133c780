"""Cancellation at any await point of any public call leaks nothing (issue 3).

For every public call, the call runs under a cancel scope that a helper task
cancels after it has passed ``k`` scheduler checkpoints, for k = 0 (cancelled
before the call starts), 1, 2, ... until the call finishes before the
cancellation lands. After each try the
test cleans up by id (``free`` is idempotent) and asserts the full
consistency check passes, no block is active or in flight, and no sequence is
left.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from akv.core.step import Admit
from akv.errors import PoolExhausted
from akv.manager import KVCacheManager
from akv.stress.kv_io import prefill

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


async def _cancel_after(scope: anyio.CancelScope, k: int) -> None:
    for _ in range(k):
        await anyio.lowlevel.checkpoint()
    if k > K_MAX // 2:
        # Past every pure event-loop checkpoint, a call waits on the copy thread:
        # give the thread real time so that some k lands after the copy ran.
        await anyio.sleep(0.001 * (k - K_MAX // 2))
    scope.cancel()


async def _run_cancelled(kv: KVCacheManager, call: Call, k: int) -> bool:
    """Run ``call`` under a scope cancelled after ``k`` checkpoints (0: before it starts); True if it finished first."""
    scope = anyio.CancelScope()
    if k == 0:
        scope.cancel()
    async with anyio.create_task_group() as tg:
        if k:
            tg.start_soon(_cancel_after, scope, k)
        with scope:
            await call(kv)
    return not scope.cancelled_caught


async def _assert_clean(kv: KVCacheManager) -> None:
    with anyio.CancelScope(shield=True):
        for seq_id in IDS:
            await kv.free(seq_id)
    await kv.wait_copies()
    await kv.check()
    s = await kv.stats()
    assert (s.active, s.num_sequences) == (0, 0)
    # A step whose caller was cancelled after the shard replied never records its copy
    # ticket before a fix (see test_stress.py), so wait_copies() did not wait for that copy;
    # its source block stays in flight until the copy has run and the shard settles it.
    with anyio.fail_after(5):
        while s.in_flight:
            await anyio.sleep(0.001)
            s = await kv.stats()
    assert s.free + s.cached == s.num_blocks


@pytest.mark.parametrize("anyio_backend", ["asyncio", pytest.param("trio", marks=TRIO_OK)])
@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_cancel_at_every_checkpoint_leaks_nothing(tiny_config, name: str) -> None:
    setup, call = SCENARIOS[name]
    cancelled_at: list[int] = []
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
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

        async def request(seq_id: str) -> None:
            nonlocal started
            try:
                await kv.add_sequence(seq_id, list(range(1, 10)))
                started += 1
                await anyio.sleep_forever()
            finally:
                assert await kv.free(seq_id) is True

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(request, f"r{i}")
            with anyio.fail_after(5):
                while started < 4:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        await kv.check()
        s = await kv.stats()
        assert (s.num_sequences, s.active) == (0, 0)
        assert s.free + s.cached == s.num_blocks
