"""A step over several shards is one ``Step`` message per shard, and all or nothing (the shared ``StepVote``).

Prompts here are shorter than a block (``tiny_config``: block_size 4), so they
are placed by free blocks: one step admitting ``n`` of them puts one in each
of ``n`` shards. Every test runs on asyncio and trio, on the direct path
(every shard served on the caller's task) and on the queued path (every
message through the shards' inboxes).
"""

from __future__ import annotations

import pytest

from akv import Admit, KVCacheManager
from akv.errors import InvalidInput
from tests.manager_helpers import snapshot

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every test of this module on asyncio and on trio."""
    return request.param


async def one_per_shard(kv: KVCacheManager, path: str) -> list[str]:
    """Admit one 3-token sequence per shard (in one step), then route every later message by ``path``."""
    ids = [f"s{i}" for i in range(kv.config.num_shards)]
    await kv.step(admits=[Admit(seq_id=s, prompt=[i, i, i]) for i, s in enumerate(ids)], want_metadata=False)
    assert sorted([(await kv.sequence(s)).shard for s in ids]) == list(range(kv.config.num_shards))
    for shard in kv._shards:
        shard.direct = path == "direct"
    return ids


@pytest.mark.parametrize("path", ["direct", "queued"])
@pytest.mark.parametrize("num_shards", [2, 4])
async def test_a_step_over_every_shard_is_one_message_per_shard(tiny_config, num_shards: int, path: str) -> None:
    """Commits and appends to a sequence in each shard: each shard's handler runs once (at 0a4c218:
    twice, ``Validate`` then ``Step``), and the step is applied everywhere."""
    async with KVCacheManager(tiny_config(num_blocks=8 * num_shards, num_shards=num_shards)) as kv:
        ids = await one_per_shard(kv, path)
        before = [shard.messages_handled for shard in kv._shards]
        result = await kv.step(commits=dict.fromkeys(ids, 3), appends=dict.fromkeys(ids, 7))
        assert [s.messages_handled - b for s, b in zip(kv._shards, before, strict=True)] == [1] * num_shards
        assert result.seq_ids == tuple(ids)
        assert [list(t[t != kv.null_block_id]) for t in result.block_tables.numpy()] == [
            list((await kv.sequence(s)).block_ids) for s in ids
        ]
        for s in ids:
            info = await kv.sequence(s)
            assert (info.num_computed, info.token_ids[-1]) == (3, 7)
        await kv.check()


@pytest.mark.parametrize("path", ["direct", "queued"])
@pytest.mark.parametrize("refused", [[0], [3], [1, 3]])
async def test_a_part_refused_by_any_shard_applies_nowhere(tiny_config, path: str, refused: list[int]) -> None:
    """4 shards; the commit of the sequences in the ``refused`` shards is too large: nothing is applied
    anywhere (not the valid commits and appends of the other shards), each shard served one message, and
    the error raised is the one of the lowest refused shard."""
    async with KVCacheManager(tiny_config(num_blocks=32, num_shards=4)) as kv:
        ids = await one_per_shard(kv, path)
        by_shard = {(await kv.sequence(s)).shard: s for s in ids}
        before = await snapshot(kv, ids)
        handled = [shard.messages_handled for shard in kv._shards]
        commits = {s: (99 if shard in refused else 3) for shard, s in by_shard.items()}
        with pytest.raises(InvalidInput, match=f"sequence {by_shard[refused[0]]!r}"):
            await kv.step(commits=commits, appends=dict.fromkeys(ids, 7))
        assert [s.messages_handled - b for s, b in zip(kv._shards, handled, strict=True)] == [1] * 4
        assert await snapshot(kv, ids) == before
        result = await kv.step(commits=dict.fromkeys(ids, 3), appends=dict.fromkeys(ids, 7))  # then it goes through
        assert result.seq_ids == tuple(ids)
        await kv.check()


@pytest.mark.parametrize("path", ["direct", "queued"])
async def test_a_step_touching_one_of_several_shards_is_one_message_to_it_alone(tiny_config, path: str) -> None:
    """A commit to one sequence of a 3-shard manager: one message to its shard, none to the others."""
    async with KVCacheManager(tiny_config(num_blocks=24, num_shards=3)) as kv:
        ids = await one_per_shard(kv, path)
        shard = (await kv.sequence(ids[1])).shard
        handled = [s.messages_handled for s in kv._shards]
        await kv.commit(ids[1], 3)
        assert [s.messages_handled - b for s, b in zip(kv._shards, handled, strict=True)] == [
            int(i == shard) for i in range(3)
        ]
        with pytest.raises(InvalidInput):
            await kv.commit(ids[1], 1)  # nothing left to commit: refused by the shard, nothing applied
        assert (await kv.sequence(ids[1])).num_computed == 3
        await kv.check()
