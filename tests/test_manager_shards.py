"""KVCacheManager with two shards, and regressions found by review: routing, all-or-nothing steps, ids.

Each test runs a real manager (actors on anyio, tiny model, block_size 4) and
ends with ``await kv.check()`` wherever the manager is still running. Hangs
are turned into failures with ``anyio.fail_after`` (a hang guard, never the
thing asserted); a module watchdog dumps the stacks and exits should a
shielded wait ever hang beyond it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from akv import Admit, KVCacheManager
from akv.errors import (
    DuplicateSequence,
    InvalidInput,
    InvalidTokens,
    PoolExhausted,
)
from tests.checkpoints import run_cancelled
from tests.manager_helpers import (  # noqa: F401 - anyio_backend and watchdog are this module's fixtures
    BS,
    Runner,
    anyio_backend,
    publish,
    snapshot,
    watchdog,
)

pytestmark = pytest.mark.anyio


# ------------------------------------------------------------------ shards
async def test_two_shards_route_and_keep_forks_in_the_parent_shard(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        run = Runner(kv)
        await run.admit("a", list(range(100, 110)))  # placed by its first block: shard 0
        await run.admit("b", list(range(10)))  # shard 1
        a, b = await kv.sequence("a"), await kv.sequence("b")
        assert (a.shard, b.shard) == (0, 1)
        assert all(0 <= x < 8 for x in a.block_ids)
        assert all(8 <= x < 16 for x in b.block_ids)

        await run.fork("a", ["a1", "a2"])
        for child in ("a1", "a2"):
            info = await kv.sequence(child)
            assert (info.shard, info.block_ids, info.parent_id) == (0, a.block_ids, "a")
        result = await run.append({"a1": [1], "b": [2], "a2": [3, 4]})
        assert set(result.seq_ids) == {"a1", "b", "a2"}
        assert result.copies.num_blocks == 2  # a1 and a2 each copy the tail they share with a
        assert all(0 <= x < 8 for x in (await kv.sequence("a1")).block_ids)
        for sid in ("a", "a1", "a2", "b"):
            await run.verify(sid)

        # Prefix hits are shard-local; lookup asks the shard the prompt would be placed on.
        assert await kv.lookup(list(range(10))) == 8
        assert await kv.lookup(list(range(100, 110))) == 8
        stats = await kv.stats()
        assert stats.num_sequences == 4
        assert stats.free + stats.active + stats.cached == 16
        assert stats.max_inbox_depth.keys() == {"pool_shard_0", "pool_shard_1"}
        for sid in ("a", "a1", "a2", "b"):
            assert await kv.free(sid) is True
        assert await kv.free("a") is False
        stats = await kv.stats()
        assert (stats.active, stats.num_sequences, stats.free + stats.cached) == (0, 0, 16)
        await kv.check()


async def test_two_shards_cancelled_step_then_free_leaks_nothing(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=2)) as kv:
        admitted = 0
        for round_ in range(12):  # cancelled after 0, 1, 2, ... checkpoints
            ids = [f"r{round_}-{i}" for i in range(4)]
            admits = [Admit(seq_id=s, prompt=[round_, i, 1, 2, 3]) for i, s in enumerate(ids)]
            finished = await run_cancelled(lambda admits=admits: kv.step(admits=admits), round_)
            freed = [await kv.free(sid) for sid in ids]
            assert freed == [freed[0]] * 4, f"round {round_}: the step was applied in part ({freed})"
            assert freed[0] or not finished
            admitted += 4 * freed[0]
        assert 0 < admitted < 48  # some steps were cancelled before they were sent, some applied
        stats = await kv.stats()
        assert (stats.active, stats.num_sequences, stats.free + stats.cached) == (0, 0, 32)
        assert stats.sequences_added == stats.sequences_freed == admitted
        await kv.check()


async def test_two_shards_duplicate_id_is_refused(tiny_config) -> None:
    # Regression: the second "a" was routed to the other shard and admitted; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        await kv.add_sequence("a", list(range(10)))  # shard 0; shard 1 is now the emptier one
        with pytest.raises(DuplicateSequence):
            await kv.add_sequence("a", list(range(10)))
        assert (await kv.stats()).num_sequences == 1


async def test_two_shards_error_applies_nothing(tiny_config) -> None:
    # Regression: shard 0's part (a's commit, publishing 2 blocks) was applied before shard 1 raised; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        await kv.add_sequence("a", list(range(100, 110)))  # placed by its first block: shard 0
        await kv.add_sequence("b", list(range(10)))  # shard 1
        assert ((await kv.sequence("a")).shard, (await kv.sequence("b")).shard) == (0, 1)
        before = await snapshot(kv, ["a", "b"])
        with pytest.raises(InvalidInput):
            await kv.step(commits={"a": 8, "b": 99})  # b's commit is invalid
        assert await snapshot(kv, ["a", "b"]) == before


async def test_two_shards_free_and_readmit_same_id_in_one_step(tiny_config) -> None:
    # Regression: the free in shard 1 dropped the route the re-admission in shard 0 had just set; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=2)) as kv:
        await kv.add_sequence("x", list(range(20)))  # shard 0
        await kv.add_sequence("a", list(range(5)))  # shard 1
        await kv.free("x")  # shard 0 is the emptier one again
        await kv.step(frees=["a"], admits=[Admit(seq_id="a", prompt=[7, 7, 7])])
        info = await kv.sequence("a")  # raises UnknownSequence: the route was dropped
        assert info.token_ids == (7, 7, 7)
        assert await kv.free("a") is True
        assert (await kv.stats()).num_sequences == 0


async def test_two_shards_rows_in_request_order(tiny_config) -> None:
    # Regression: rows came grouped by shard, not in request order as StepResult documents; fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=2)) as kv:
        run = Runner(kv)
        await run.admit("a", [1, 2, 3])  # shard 0
        await run.admit("b", [4, 5, 6])  # shard 1
        await run.fork("a", ["a1"])  # shard 0
        for sid, toks in {"a": [7], "b": [8, 9, 10], "a1": [11, 12]}.items():
            run.history[sid].extend(toks)
        run.history["c"] = [13, 14, 15, 16, 17]
        run.history["d"] = [18]
        result = await kv.step(
            appends={"a": [7], "b": [8, 9, 10], "a1": [11, 12]},
            admits=[Admit(seq_id="c", prompt=run.history["c"]), Admit(seq_id="d", prompt=run.history["d"])],
        )
        assert result.seq_ids == ("a", "b", "a1", "c", "d")
        assert result.context_lens.tolist() == [4, 6, 5, 5, 1]
        assert result.query_start_loc.tolist() == [0, 1, 4, 6, 11, 12]
        for row, sid in enumerate(result.seq_ids):
            info = await kv.sequence(sid)
            assert result.block_tables[row, : len(info.block_ids)].tolist() == list(info.block_ids)
            a, b = result.query_start_loc[row : row + 2].tolist()
            start = len(info.token_ids) - (b - a)
            want = [info.block_ids[p // BS] * BS + p % BS for p in range(start, len(info.token_ids))]
            assert result.slot_mapping[a:b].tolist() == want
        await run.write(result)
        for sid in ("a", "b", "a1", "c", "d"):
            await run.verify(sid)
        await kv.check()


async def test_rejected_admission_does_not_expose_a_later_admissions_hits(tiny_config) -> None:
    # Regression: "big" being rejected unprotected the hits "small" shares; small's eviction then took
    # its own hit and the shard crashed (ValueError: incref of a free block); fixed in 6e1dc5a.
    async with KVCacheManager(tiny_config(num_blocks=7)) as kv:
        shared = list(range(8))  # 2 blocks
        await publish(kv, "a", [*shared, 100])  # 2 cached blocks (least recently used), 5 free
        await publish(kv, "z", [200, 201, 202, 203, 204])  # 1 more cached block, 4 free
        await kv.add_sequence("x", [50] * 12)  # 3 blocks: 1 free left
        result = await kv.step(
            admits=[
                Admit(seq_id="big", prompt=[*shared, *([7] * 16)]),  # 2 hits + 4 new: PoolExhausted
                Admit(seq_id="small", prompt=[*shared, 9, 9, 9, 9, 9]),  # 2 hits + 2 new: evicts z's block
            ]
        )
        assert isinstance(result.rejected["big"], PoolExhausted)
        assert result.cached_tokens == {"small": 8}
        assert result.evicted_blocks == 1
        assert await kv.lookup([200, 201, 202, 203, 204]) == 0
        await kv.check()


@pytest.mark.parametrize("num_shards", [1, 2])
async def test_malformed_ids_and_arguments_are_typed_errors_not_crashes(tiny_config, num_shards: int) -> None:
    """Regression (fresh-eyes review): an unhashable id or namespace crashed the shard actor, and a
    string given as ``frees`` freed one id per character."""
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=num_shards)) as kv:
        for seq_id in ("r", "e", "q"):
            await kv.add_sequence(seq_id, [1, 2, 3])
        before = await kv.stats()
        calls = [
            lambda: kv.free(["x"]),
            lambda: kv.add_sequence(["c"], [1]),
            lambda: kv.fork("r", [["z"]]),
            lambda: kv.sequence({}),
            lambda: kv.add_sequence("n", [1], namespace=[1]),
            lambda: kv.lookup([1, 2], namespace={}),
            lambda: kv.step(frees="req"),
            lambda: kv.step(appends=[("r", 1)]),
            lambda: kv.step(forks=["r"]),
        ]
        for call in calls:
            with pytest.raises(InvalidInput):
                await call()
        assert await kv.stats() == before
        await kv.check()


async def test_numpy_and_torch_integer_scalars_are_one_token(tiny_config) -> None:
    async with KVCacheManager(tiny_config(num_blocks=16)) as kv:
        await kv.add_sequence("a", [1, 2, 3])
        await kv.append("a", np.int64(5))
        await kv.append("a", torch.tensor(6))
        assert (await kv.sequence("a")).token_ids == (1, 2, 3, 5, 6)
        with pytest.raises(InvalidTokens):
            await kv.append("a", np.bool_(True))
