"""KVCacheManager bad input and lifecycle: typed errors that change nothing, closed and crashed managers.

Each test runs a real manager (actors on anyio, tiny model, block_size 4) and
ends with ``await kv.check()`` wherever the manager is still running. Hangs
are turned into failures with ``anyio.fail_after`` (a hang guard, never the
thing asserted); a module watchdog dumps the stacks and exits should a
shielded wait ever hang beyond it.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from akv import Admit, KVCacheManager
from akv.core.shard_state import ShardState
from akv.errors import (
    ActorCrashed,
    DuplicateSequence,
    InvalidInput,
    InvalidTokens,
    ManagerClosed,
    PoolExhausted,
    RequestTooLarge,
    UnknownSequence,
)
from akv.storage import KVStorage
from tests.checkpoints import run_cancelled
from tests.manager_helpers import (  # noqa: F401 - anyio_backend and watchdog are this module's fixtures
    BS,
    VOCAB,
    anyio_backend,
    messages_handled,
    publish,
    snapshot,
    watchdog,
)

pytestmark = pytest.mark.anyio


# ------------------------------------------------------------ typed errors
VOCAB_ERRORS = [
    ("empty", []),
    ("negative", [1, -1]),
    ("floats", [1.0, 2.0]),
    ("bools", [True, 1]),
    ("string", "abc"),
    ("out_of_vocab", [1, VOCAB]),
    ("float_array", np.array([1.5, 2.0])),
    ("two_dims", [[1, 2], [3, 4]]),
    ("none", None),
]


async def _error_fixture(kv: KVCacheManager) -> list[str]:
    """a (10 tokens, committed, 2 blocks published), b (fork of a), c (published and freed: cached)."""
    await publish(kv, "a", list(range(10)), free=False)
    await kv.fork("a", ["b"])
    await publish(kv, "c", list(range(100, 106)))
    stats = await kv.stats()
    assert (stats.free, stats.active, stats.cached) == (12, 3, 1)
    return ["a", "b"]


ERROR_CALLS = [
    *[(f"add_{name}", lambda kv, t=tokens: kv.add_sequence("n", t), InvalidTokens) for name, tokens in VOCAB_ERRORS],
    *[(f"append_{name}", lambda kv, t=tokens: kv.append("a", t), InvalidTokens) for name, tokens in VOCAB_ERRORS],
    *[(f"lookup_{name}", lambda kv, t=tokens: kv.lookup(t), InvalidTokens) for name, tokens in VOCAB_ERRORS],
    ("append_int_negative", lambda kv: kv.append("a", -1), InvalidTokens),
    ("append_int_out_of_vocab", lambda kv: kv.append("a", VOCAB), InvalidTokens),
    ("append_bool", lambda kv: kv.append("a", True), InvalidTokens),
    ("append_float", lambda kv: kv.append("a", 1.0), InvalidTokens),
    (
        "step_one_bad_admit_applies_none",
        lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1, 2]), Admit(seq_id="m", prompt=[-1])]),
        InvalidTokens,
    ),
    ("step_not_an_admit", lambda kv: kv.step(admits=[("n", [1, 2])]), InvalidInput),
    (
        "admit_prefill_done_str",
        lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1, 2], prefill_done="yes")]),
        InvalidInput,
    ),
    ("admit_resumed_int", lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1, 2], resumed=1)]), InvalidInput),
    ("append_unknown", lambda kv: kv.append("ghost", [1]), UnknownSequence),
    ("commit_unknown", lambda kv: kv.commit("ghost", 1), UnknownSequence),
    ("fork_unknown", lambda kv: kv.fork("ghost", ["x"]), UnknownSequence),
    ("sequence_unknown", lambda kv: kv.sequence("ghost"), UnknownSequence),
    ("step_commit_then_unknown_append", lambda kv: kv.step(commits={"a": 0}, appends={"ghost": [1]}), UnknownSequence),
    ("add_duplicate", lambda kv: kv.add_sequence("a", [1, 2]), DuplicateSequence),
    ("fork_to_live_child", lambda kv: kv.fork("a", ["b"]), DuplicateSequence),
    ("fork_to_itself", lambda kv: kv.fork("a", ["a"]), DuplicateSequence),
    ("fork_repeated_child", lambda kv: kv.fork("a", ["x", "x"]), DuplicateSequence),
    ("fork_child_ids_string", lambda kv: kv.fork("a", "xy"), InvalidInput),
    (
        "step_admit_twice",
        lambda kv: kv.step(admits=[Admit(seq_id="n", prompt=[1]), Admit(seq_id="n", prompt=[2])]),
        DuplicateSequence,
    ),
    ("commit_negative", lambda kv: kv.commit("a", -1), InvalidInput),
    ("commit_too_many", lambda kv: kv.commit("a", 1), InvalidInput),
    ("commit_float", lambda kv: kv.commit("a", 1.0), InvalidInput),
    ("commit_bool", lambda kv: kv.commit("a", True), InvalidInput),
    ("append_too_large", lambda kv: kv.append("a", [1] * (16 * BS)), RequestTooLarge),
    ("add_too_large", lambda kv: kv.add_sequence("n", [1] * (16 * BS + 1)), RequestTooLarge),
]


@pytest.mark.parametrize(("call", "error"), [(c, e) for _, c, e in ERROR_CALLS], ids=[n for n, _, _ in ERROR_CALLS])
async def test_typed_error_leaves_state_unchanged(tiny_config, call, error) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        ids = await _error_fixture(kv)
        before = await snapshot(kv, ids)
        exhausted = (await kv.stats()).pool_exhausted
        with pytest.raises(error):
            await call(kv)
        assert await snapshot(kv, ids) == before
        assert (await kv.stats()).pool_exhausted == exhausted
        for ghost in ("n", "m", "x", "ghost"):
            with pytest.raises(UnknownSequence):
                await kv.sequence(ghost)
        await kv.check()


async def test_pool_exhausted_carries_the_numbers_and_changes_nothing(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        ids = await _error_fixture(kv)
        await kv.add_sequence("big", [7] * (11 * BS))  # 11 blocks: 1 free and 1 cached left
        ids.append("big")
        before = await snapshot(kv, ids)
        exhausted = (await kv.stats()).pool_exhausted

        with pytest.raises(PoolExhausted) as info:
            await kv.add_sequence("x", list(range(500, 520)))  # 5 blocks, no hit
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (5, 1, 1)
        assert "requested 5 blocks, 1 free, 1 evictable" in str(info.value)

        with pytest.raises(PoolExhausted) as info:  # 5 blocks of which 2 are hits on a's published blocks
            await kv.add_sequence("y", [*range(10), *([50] * 10)])
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (3, 1, 1)

        # 11 more tokens: 3 new blocks plus a copy of the partial tail a shares with b.
        with pytest.raises(PoolExhausted) as info:
            await kv.append("a", [1] * 11)
        assert (info.value.requested_blocks, info.value.free_blocks, info.value.evictable_blocks) == (4, 1, 1)

        assert await snapshot(kv, ids) == before
        assert (await kv.stats()).pool_exhausted == exhausted + 3
        # The same shortage in a batched step is a rejection, not an exception, and also leaves no trace.
        result = await kv.step(admits=[Admit(seq_id="x", prompt=list(range(500, 520)))])
        assert set(result.rejected) == {"x"} and isinstance(result.rejected["x"], PoolExhausted)
        assert result.seq_ids == () and result.cached_tokens == {}
        assert await snapshot(kv, ids) == before
        await kv.check()


async def test_request_too_large_fails_at_once_when_the_pool_is_busy(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        for i in range(4):
            await kv.add_sequence(f"s{i}", [i] * (4 * BS))  # every block active
        stats = await kv.stats()
        assert (stats.free, stats.active) == (0, 16)
        before = await snapshot(kv, [f"s{i}" for i in range(4)])
        # "At once": each refusal is one message to the shard (no waiting for room, no retry).
        handled = messages_handled(kv)
        with pytest.raises(RequestTooLarge) as info:
            await kv.add_sequence("huge", [1] * (16 * BS + 1))
        assert (info.value.requested_blocks, info.value.num_blocks) == (17, 16)
        assert messages_handled(kv) == handled + 1
        with pytest.raises(RequestTooLarge):
            await kv.append("s0", [1] * (12 * BS + 1))
        assert messages_handled(kv) == handled + 2
        with pytest.raises(PoolExhausted):  # fits the pool, just not now
            await kv.add_sequence("later", [1])
        assert messages_handled(kv) == handled + 3
        assert await snapshot(kv, [f"s{i}" for i in range(4)]) == before
        await kv.check()


# ------------------------------------------------------------ lifecycle
async def test_calls_outside_async_with_raise_manager_closed(tiny_config) -> None:
    kv = KVCacheManager(tiny_config())
    with pytest.raises(ManagerClosed):
        await kv.add_sequence("a", [1])
    with pytest.raises(ManagerClosed):
        await kv.step()
    async with kv:
        await kv.add_sequence("a", [1, 2, 3])
        await kv.check()
    for call in (kv.stats, kv.check, lambda: kv.free("a"), lambda: kv.lookup([1]), lambda: kv.sequence("a")):
        with pytest.raises(ManagerClosed):
            await call()
    with pytest.raises(ManagerClosed, match="only be entered once"):
        async with kv:
            pass
    with pytest.raises(InvalidInput):
        KVCacheManager({"num_blocks": 8})


@pytest.mark.parametrize("name", ["stats", "lookup", "sequence", "check", "wait_copies"])
async def test_query_calls_before_enter_raise_manager_closed(tiny_config, name: str) -> None:
    # Regression: these raised AttributeError (no shards/tree before __aenter__), fixed in 6e1dc5a.
    kv = KVCacheManager(tiny_config())
    calls = {
        "stats": kv.stats,
        "lookup": lambda: kv.lookup([1, 2]),
        "sequence": lambda: kv.sequence("a"),
        "check": kv.check,
        "wait_copies": kv.wait_copies,
    }
    with pytest.raises(ManagerClosed, match="is new"):
        await calls[name]()


async def test_two_managers_coexist(tiny_config) -> None:
    async with KVCacheManager(tiny_config()) as one, KVCacheManager(tiny_config(num_blocks=8)) as two:
        await publish(one, "a", list(range(9)))
        assert await one.lookup(list(range(9))) == 8
        assert await two.lookup(list(range(9))) == 0
        assert (await two.stats()).free == 8
        await one.check()
        await two.check()


async def test_shutdown_with_calls_in_flight_raises_instead_of_hanging(tiny_config) -> None:
    outcomes: list[str] = []
    completed = 0
    warmed_up = anyio.Event()

    async def caller(kv: KVCacheManager, i: int) -> None:
        nonlocal completed
        try:
            for n in range(10_000):
                await kv.add_sequence(f"s{i}-{n}", [1, 2, 3, 4, 5])
                await kv.free(f"s{i}-{n}")
                completed += 1
                if completed == 24:
                    warmed_up.set()
        except (ManagerClosed, ActorCrashed) as exc:
            outcomes.append(type(exc).__name__)
        else:
            outcomes.append("finished")

    with anyio.fail_after(60):
        # The callers' task group outlives the manager: they are still calling when it shuts down.
        async with anyio.create_task_group() as tg, KVCacheManager(tiny_config(num_blocks=64, inbox_capacity=2)) as kv:
            for i in range(12):
                tg.start_soon(caller, kv, i)
            await warmed_up.wait()
            await kv.check()
    assert len(outcomes) == 12
    assert set(outcomes) <= {"ManagerClosed", "ActorCrashed"}, outcomes
    with pytest.raises(ManagerClosed):
        await kv.add_sequence("late", [1])


async def test_crashed_actor_fails_every_call_and_exit(tiny_config, monkeypatch) -> None:
    real_step = ShardState.step

    boom_served = anyio.Event()

    def exploding_step(self, request):
        if any("boom" in str(adm.seq_id) for adm in request.admits):
            boom_served.set()
            raise RuntimeError("boom")
        return real_step(self, request)

    monkeypatch.setattr(ShardState, "step", exploding_step)
    outcomes: dict[object, BaseException | None] = {}

    async def pending(kv: KVCacheManager, i: object, after_boom: bool = True) -> None:
        if after_boom:
            await boom_served.wait()
        try:
            await kv.add_sequence(f"p{i}", [1, 2, 3])
            outcomes[i] = None
        except BaseException as exc:
            outcomes[i] = exc

    with anyio.fail_after(60):
        with pytest.raises(ActorCrashed) as at_exit:
            async with KVCacheManager(tiny_config()) as kv:
                await kv.add_sequence("fine", [1, 2, 3])
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pending, kv, -1, False)  # races the crash: served or refused
                    for i in range(8):  # these wait for the crash
                        tg.start_soon(pending, kv, i)
                    tg.start_soon(pending, kv, "boom", False)
                with pytest.raises(ActorCrashed) as crashed:
                    await kv.add_sequence("boom", [1, 2, 3])
                assert isinstance(crashed.value.__cause__, RuntimeError)
                for call in (
                    kv.stats,
                    kv.check,
                    lambda: kv.lookup([1, 2]),
                    lambda: kv.sequence("fine"),
                    lambda: kv.free("fine"),
                    lambda: kv.append("fine", [4]),
                ):
                    with pytest.raises(ActorCrashed):
                        await call()
    assert at_exit.value.actor == "pool_shard_0"
    assert isinstance(at_exit.value.cause, RuntimeError)
    # p-1 may have been served before the crash; boom and every later call saw the crash.
    assert outcomes.keys() == {-1, "boom", *range(8)}
    assert outcomes[-1] is None or isinstance(outcomes[-1], ActorCrashed), outcomes[-1]
    assert all(isinstance(outcomes[i], ActorCrashed) for i in ("boom", *range(8))), outcomes

    monkeypatch.undo()
    async with KVCacheManager(tiny_config()) as fresh:
        assert await fresh.add_sequence("fine", [1, 2, 3]) == 0
        assert await fresh.free("fine") is True
        await fresh.check()


async def test_failed_copy_fails_the_manager(tiny_config, monkeypatch) -> None:
    def broken_copy(self, src, dst):
        raise RuntimeError("device error")

    with anyio.fail_after(60), pytest.raises(ActorCrashed):
        async with KVCacheManager(tiny_config()) as kv:
            await kv.add_sequence("a", [1, 2, 3, 4, 5])
            await kv.fork("a", ["b"])
            monkeypatch.setattr(KVStorage, "_copy_unchecked", broken_copy)
            result = await kv.append("b", [6])  # copy-on-write of the shared tail: the copy fails
            with pytest.raises(ActorCrashed):
                await result.copies.wait()
            with pytest.raises(ActorCrashed):
                await kv.stats()


async def test_cancelled_caller_then_free_leaks_nothing(tiny_config) -> None:
    """12 callers run add, commit, append while cancelled after 0, 1, 2, ... checkpoints (0: before
    the add). Whatever was applied, ``free`` says exactly whether the sequence was live, and every
    block comes back: the committed prompts' full blocks cached, nothing else held."""
    async with KVCacheManager(tiny_config(num_blocks=48)) as kv:
        prompts = [[i, *range(20, 28), i] for i in range(12)]  # 3 blocks each (2 full), no shared prefix
        returned: dict[int, str] = {}

        async def one(i: int) -> None:
            await kv.add_sequence(f"c{i}", prompts[i])
            returned[i] = "added"
            await kv.commit(f"c{i}", len(prompts[i]))
            await kv.append(f"c{i}", [5, 6])
            returned[i] = "appended"

        finished: dict[int, bool] = {}

        async def cancelled(i: int) -> None:
            finished[i] = await run_cancelled(lambda: one(i), i)

        async with anyio.create_task_group() as tg:  # cancelled at varying points while the others run
            for i in range(12):
                tg.start_soon(cancelled, i)
        assert finished[0] is False and 0 not in returned  # cancelled before it started
        assert any(finished.values()), "no caller finished: the sweep never reached the end of the calls"
        assert {i for i, done in finished.items() if done} == {i for i, r in returned.items() if r == "appended"}

        num_live = num_committed = 0
        for i in range(12):
            try:
                info = await kv.sequence(f"c{i}")
            except UnknownSequence:
                info = None
            if i in returned:
                assert info is not None, f"c{i}: add_sequence returned but the sequence is gone"
            num_live += info is not None
            num_committed += info is not None and info.num_computed == len(prompts[i])
            assert await kv.free(f"c{i}") is (info is not None)
            with pytest.raises(UnknownSequence):
                await kv.sequence(f"c{i}")
        await kv.wait_copies()
        stats = await kv.stats()
        assert (stats.active, stats.in_flight, stats.num_sequences) == (0, 0, 0)
        assert stats.sequences_added == stats.sequences_freed == num_live
        assert stats.cached == stats.prefix_cache_blocks == 2 * num_committed
        assert stats.free == 48 - 2 * num_committed
        await kv.check()


async def test_the_stored_crash_keeps_a_traceback_of_one_call(tiny_config, monkeypatch) -> None:
    """Every call after a crash raises the stored ActorCrashed; its traceback must not pile up the earlier raises."""
    import traceback

    def exploding_step(self, request):
        raise RuntimeError("boom")

    monkeypatch.setattr(ShardState, "step", exploding_step)
    depths = []
    with pytest.raises(ActorCrashed):
        async with KVCacheManager(tiny_config()) as kv:
            with pytest.raises(ActorCrashed):
                await kv.add_sequence("boom", [1, 2, 3])
            for _ in range(3):
                with pytest.raises(ActorCrashed) as again:
                    await kv.stats()
                depths.append(len(traceback.extract_tb(again.value.__traceback__)))
    assert depths[0] == depths[1] == depths[2]
