"""``kv.step(block_tables="updates")``: a runner's own copy of the block tables, kept current by each step's entries.

A runner that keeps its block tables (vLLM's model runner keeps a
``BlockTable`` and applies each step's new block ids) asks only for what
changed. Two managers run the same steps in lockstep, one returning the padded
tables and one the updates; a mirror that applies every update must equal the
padded tables up to each row's blocks, and every other field must match.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from akv import Admit, KVCacheConfig, KVCacheManager
from akv.errors import InvalidInput

BS = 4

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


def config(num_shards: int = 1, num_blocks: int = 64) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        block_size=BS,
        vocab_size=1000,
        storage="none",
        num_shards=num_shards,
        debug_invariants=True,
        low_watermark=0.0,
        high_watermark=0.0,
    )


def apply(mirror: dict, result) -> None:
    """Write a step's updates into ``mirror`` (sequence id -> list of block ids), as a runner would."""
    for row, col, block in result.block_table_updates.tolist():
        table = mirror.setdefault(result.seq_ids[row], [])
        table.extend([-1] * (col + 1 - len(table)))
        table[col] = block


def assert_same(full, upd, mirror: dict) -> None:
    """``upd`` (updates) says what ``full`` (padded tables) says, once applied to ``mirror``."""
    assert upd.block_tables is None and full.block_table_updates is None
    assert upd.seq_ids == full.seq_ids
    for name in ("context_lens", "query_start_loc", "slot_mapping"):
        assert torch.equal(getattr(upd, name), getattr(full, name)), name
    assert upd.block_table_updates.dtype == torch.int32 and upd.block_table_updates.shape[1:] == (3,)
    rows = upd.block_table_updates[:, 0].tolist()
    assert rows == sorted(rows)
    apply(mirror, upd)
    qsl = full.query_start_loc.tolist()
    for i, (seq_id, n) in enumerate(zip(full.seq_ids, full.context_lens.tolist(), strict=True)):
        blocks = -(-n // BS)
        assert mirror[seq_id][:blocks] == full.block_tables[i, :blocks].tolist(), seq_id
        table, first = full.block_tables[i].tolist(), n - (qsl[i + 1] - qsl[i])  # the row's new positions: first..n-1
        want = [table[p // BS] * BS + p % BS for p in range(first, n)]
        assert full.slot_mapping[qsl[i] : qsl[i + 1]].tolist() == want, seq_id


async def test_a_decode_step_returns_one_entry_per_row_and_an_admission_its_whole_table() -> None:
    async with KVCacheManager(config()) as kv:
        result = await kv.step(admits=[Admit(seq_id="a", prompt=list(range(1, 7)))], block_tables="updates")
        a = list((await kv.sequence("a")).block_ids)
        assert result.block_tables is None
        assert result.block_table_updates.tolist() == [[0, 0, a[0]], [0, 1, a[1]]]
        await kv.step(admits=[Admit(seq_id="b", prompt=[9, 9, 9, 9, 9])], want_metadata=False)
        b = list((await kv.sequence("b")).block_ids)
        result = await kv.step(appends={"a": 7, "b": 8}, block_tables="updates")
        # a: position 6, in column 1; b was admitted without metadata: its whole table
        assert result.block_table_updates.tolist() == [[0, 1, a[1]], [1, 0, b[0]], [1, 1, b[1]]]
        result = await kv.step(appends={"a": 7, "b": 8}, block_tables="updates")
        assert result.block_table_updates.tolist() == [[0, 1, a[1]], [1, 1, b[1]]]
        result = await kv.step(appends={"a": 9, "b": 8}, block_tables="updates")
        a = list((await kv.sequence("a")).block_ids)
        assert result.block_table_updates.tolist() == [[0, 2, a[2]], [1, 1, b[1]]]  # a's new block
        assert result.slot_mapping.tolist() == [a[2] * BS, b[1] * BS + 3]
        result = await kv.step(appends={"b": [1, 2, 3]}, block_tables="updates")  # positions 8-10: columns 2 (new)
        b = list((await kv.sequence("b")).block_ids)
        assert result.block_table_updates.tolist() == [[0, 2, b[2]]]


@pytest.mark.parametrize("value", ["partial", "Full", 1, None, True])
async def test_block_tables_must_be_full_or_updates(value) -> None:
    async with KVCacheManager(config()) as kv:
        with pytest.raises(InvalidInput, match='block_tables must be "full" or "updates"'):
            await kv.step(admits=[Admit(seq_id="a", prompt=[1, 2])], block_tables=value)
        assert (await kv.stats()).num_sequences == 0


ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 21)),
        st.tuples(st.just("admit_many"), st.lists(st.integers(1, 21), min_size=2, max_size=7)),
        st.tuples(st.just("decode"), st.booleans()),
        st.tuples(st.just("append"), st.integers(0, 5), st.integers(1, 9), st.booleans()),
        st.tuples(st.just("fork"), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 5)),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(ops=ops, num_shards=st.sampled_from([1, 2]))
# A fork's child copies its shared tail on its first append (a changed column), a
# decode without metadata, then the same rows again; a freed row handed out anew.
@example(
    ops=[
        ("admit", 6),
        ("fork", 0),
        ("decode", True),
        ("decode", False),
        ("decode", True),
        ("free", 0),
        ("admit", 3),
        ("append", 1, 9, True),
        ("decode", True),
    ],
    num_shards=1,
)
# Steps without metadata fill a whole new block; the next step's token is in the one after.
@example(ops=[("admit", 4), ("decode", False), ("append", 0, 3, False), ("decode", True)], num_shards=1)
# Six prefills of two blocks or more in one step, then five (both ways of computing their slots).
@example(ops=[("admit_many", [9, 12, 21, 8, 17, 10]), ("admit_many", [9, 9, 9, 9, 3]), ("decode", True)], num_shards=1)
# Admitted on two shards, scheduled in request order, not shard order.
@example(ops=[("admit", 5), ("admit", 2), ("admit", 7), ("decode", True), ("append", 1, 6, True)], num_shards=2)
def test_applied_updates_rebuild_the_padded_tables(ops, num_shards: int) -> None:
    async def run() -> None:
        async with KVCacheManager(config(num_shards)) as full, KVCacheManager(config(num_shards)) as upd:
            mirror: dict = {}
            live: list[str] = []
            token = 100

            async def both(**step):
                r1 = await full.step(**step)
                r2 = await upd.step(**step, block_tables="updates")
                if step.get("want_metadata", True):
                    assert_same(r1, r2, mirror)
                assert r1.rejected.keys() == r2.rejected.keys()
                return r1

            for n, op in enumerate(ops):
                note(f"{op}, live {live}")
                kind = op[0]
                if kind == "admit":
                    sid = f"s{n}"
                    first = n * 50 % 950  # every token inside the vocabulary of 1000
                    r = await both(admits=[Admit(seq_id=sid, prompt=list(range(first, first + op[1])))])
                    live += [sid] if sid in r.seq_ids else []
                elif kind == "admit_many":  # several prefills in one step (one pass over all tokens past 4)
                    admits = [Admit(seq_id=f"s{n}.{j}", prompt=list(range(j, j + k))) for j, k in enumerate(op[1])]
                    r = await both(admits=admits)
                    live += [a.seq_id for a in admits if a.seq_id in r.seq_ids]
                elif kind == "decode" and live:
                    token += 1
                    await both(appends=dict.fromkeys(live, token), commits=dict.fromkeys(live, 0), want_metadata=op[1])
                elif kind == "append" and live:
                    sid = live[op[1] % len(live)]
                    await both(appends={sid: list(range(token, token + op[2]))}, want_metadata=op[3])
                elif kind == "fork" and live:
                    parent = live[op[1] % len(live)]
                    await both(forks=[(parent, [f"c{n}"])], want_metadata=False)
                    live.append(f"c{n}")
                elif kind == "free" and live:
                    sid = live.pop(op[1] % len(live))
                    await both(frees=[sid])
                    mirror.pop(sid, None)
            await full.check()
            await upd.check()

    anyio.run(run)
