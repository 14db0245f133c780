"""ShardMap on its own (pure, synchronous): splitting a step per shard, placement, owners, merging outcomes."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.core.block_key import chain_keys
from akv.core.shard_map import ShardMap
from akv.core.step import Admit, StepOutcome, StepRequest
from akv.errors import DuplicateSequence, UnknownSequence

BS = 4
NULL = 99


def admit(seq_id: str, num_tokens: int, max_new_tokens: int | None = None) -> Admit:
    """An admission of ``num_tokens`` tokens."""
    return Admit(seq_id=seq_id, prompt=np.arange(num_tokens, dtype=np.int32), max_new_tokens=max_new_tokens)


def admitted(shards: ShardMap, placed: dict[str, int]) -> None:
    """Record ``placed`` (id -> shard) as admitted, as the manager does after a step."""
    outcomes = [(shard, StepOutcome(cached_tokens={seq_id: 0})) for seq_id, shard in placed.items()]
    shards.record(outcomes, {})


def short(seq_id: str, num_tokens: int) -> Admit:
    """An admission of a prompt shorter than a block (placed by free blocks) that reserves ``num_tokens`` in all."""
    return admit(seq_id, BS - 1, max_new_tokens=num_tokens - (BS - 1))


def test_short_prompts_go_to_the_largest_free_fraction_less_the_step_s_earlier_admissions() -> None:
    shards = ShardMap([10, 10], BS, NULL)
    request = StepRequest(admits=[short("a", 3 * BS), short("b", BS), short("c", 2 * BS)])
    subs, children = shards.split(request, [8, 6])
    # a: 0.8 vs 0.6 -> shard 0 (left 0.5); b: 0.5 vs 0.6 -> shard 1 (left 0.5); c: tie -> shard 0.
    assert [(shard, [a.seq_id for a in sub.admits]) for shard, sub in subs] == [(0, ["a", "c"]), (1, ["b"])]
    assert children == {}


def test_parts_follow_the_owner_and_fork_children_stay_with_their_parent() -> None:
    shards = ShardMap([10, 10], BS, NULL)
    admitted(shards, {"p": 1, "q": 0})
    request = StepRequest(
        frees=("q", "gone"),
        preempted=frozenset({"q"}),
        commits={"p": 2},
        forks=[("p", ("k",))],
        appends={"k": 5, "p": 6},
    )
    subs, children = shards.split(request, [10, 10])
    by_shard = dict(subs)
    assert sorted(by_shard) == [0, 1]
    assert list(by_shard[0].frees) == ["q"] and by_shard[0].preempted == frozenset({"q"})
    assert by_shard[1].commits == {"p": 2}
    assert list(by_shard[1].forks) == [("p", ("k",))]
    assert by_shard[1].appends == {"k": 5, "p": 6}
    assert children == {"k": 1}
    shards.record([(0, StepOutcome(freed=["q"])), (1, StepOutcome())], children)
    assert shards.owner("k") == 1 and shards.owner("p") == 1
    with pytest.raises(UnknownSequence):
        shards.owner("q")


@pytest.mark.parametrize(
    "request_",
    [
        StepRequest(commits={"nobody": 1}),
        StepRequest(appends={"nobody": 1}),
        StepRequest(forks=[("nobody", ("k",))]),
        StepRequest(forks=[("p", ("p",))]),
        StepRequest(admits=[admit("p", BS)]),
        StepRequest(admits=[admit("x", BS), admit("x", BS)]),
    ],
)
def test_a_refused_split_changes_no_owner(request_: StepRequest) -> None:
    shards = ShardMap([10, 10], BS, NULL)
    admitted(shards, {"p": 1})
    with pytest.raises((UnknownSequence, DuplicateSequence)):
        shards.split(request_, [10, 10])
    assert shards.owner("p") == 1
    for seq_id in ("nobody", "k", "x"):
        with pytest.raises(UnknownSequence):
            shards.owner(seq_id)


def test_a_freed_id_may_be_admitted_again_in_the_same_step() -> None:
    shards = ShardMap([10, 10], BS, NULL)
    admitted(shards, {"p": 1})
    subs, _ = shards.split(StepRequest(frees=("p",), admits=[admit("p", BS - 1)]), [10, 10])
    assert [(shard, list(sub.frees), [a.seq_id for a in sub.admits]) for shard, sub in subs] == [
        (0, [], ["p"]),
        (1, ["p"], []),
    ]


def first_block_shard(prompt: np.ndarray, namespace, num_shards: int) -> int:
    """The affine shard as documented: the first block's content key, its first 8 bytes big-endian, mod shards."""
    key = chain_keys(prompt[:BS], BS, namespace)[0]
    return int.from_bytes(key[:8], "big") % num_shards


@settings(max_examples=40, deadline=None)
@given(
    first=st.lists(st.integers(0, 999), min_size=BS, max_size=BS),
    tails=st.lists(st.lists(st.integers(0, 999), max_size=3 * BS), min_size=2, max_size=4),
    namespace=st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3), st.tuples(st.just("lora"), st.integers())),
    num_shards=st.integers(2, 5),
    free=st.data(),
)
def test_a_prompt_goes_to_its_first_block_s_shard_whatever_follows_and_whatever_is_free(
    first: list[int], tails: list[list[int]], namespace, num_shards: int, free: st.DataObject
) -> None:
    shards = ShardMap([64] * num_shards, BS, NULL)
    want = first_block_shard(np.array(first, dtype=np.int32), namespace, num_shards)
    for i, tail in enumerate(tails):
        prompt = np.array(first + tail, dtype=np.int32)
        assert shards.affine_shard(namespace, prompt) == want
        num_free = free.draw(st.lists(st.integers(8, 64), min_size=num_shards, max_size=num_shards))
        adm = Admit(seq_id=i, prompt=prompt, namespace=namespace)
        subs, _ = shards.split(StepRequest(admits=[adm]), num_free)
        assert [shard for shard, _ in subs] == [want]


def test_a_prompt_shorter_than_a_block_has_no_affine_shard() -> None:
    shards = ShardMap([10, 10, 10], BS, NULL)
    assert shards.affine_shard(None, np.arange(BS - 1, dtype=np.int32)) is None
    assert shards.affine_shard(None, np.arange(BS, dtype=np.int32)) is not None


def test_the_affine_shard_is_the_same_in_every_process() -> None:
    """A str namespace: Python's hash() of it differs between processes (PYTHONHASHSEED); the shard does not."""
    code = (
        "import numpy as np; from akv.core.shard_map import ShardMap; m = ShardMap([8] * 7, 4, 99); "
        "print([m.affine_shard(ns, np.arange(i, i + 4, dtype=np.int32)) for ns in ('tenant', b'x', None) "
        "for i in range(20)], hash('tenant'))"
    )
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.append(out.stdout.rsplit(" ", 1))
    (shards_1, hash_1), (shards_2, hash_2) = runs
    assert hash_1 != hash_2  # the two processes do salt str hashes differently
    assert shards_1 == shards_2
    assert len(set(ast.literal_eval(shards_1))) == 7  # 60 prefixes reach all 7 shards


def test_spill_when_the_affine_shard_cannot_hold_the_admission_with_the_step_s_earlier_ones() -> None:
    """Room is unreserved free plus cached blocks of the affine shard, less what the step's earlier
    admissions there take; a prompt that does not fit spills to the largest free fraction."""
    shards = ShardMap([10, 10], BS, NULL)
    prompt = np.arange(2 * BS, dtype=np.int32)  # 2 blocks
    home = shards.affine_shard(None, prompt)
    other = 1 - home
    room = [0, 0]
    room[home], room[other] = 3, 9
    free = [1, 1]
    free[home], free[other] = 1, 2  # the other shard is freer: it takes what spills
    admits = [Admit(seq_id=i, prompt=prompt) for i in range(3)]
    subs, _ = shards.split(StepRequest(admits=admits), free, room)
    assert {shard: [a.seq_id for a in sub.admits] for shard, sub in subs} == {home: [0], other: [1, 2]}
    reserve = Admit(seq_id="r", prompt=prompt, max_new_tokens=2 * BS)  # 4 blocks > 3
    assert shards.split(StepRequest(admits=[reserve]), free, room)[0][0][0] == other
    assert shards.place(None, prompt, 3, [0.1, 0.2], room) == home  # what lookup asks: fits


def shard_outcome(rows: list[tuple[str, int, int]]) -> StepOutcome:
    """An outcome whose row ``(seq_id, num_blocks, num_new_tokens)`` holds blocks and slots named after its id."""
    width = max((n for _, n, _ in rows), default=0)
    tables = np.full((len(rows), width), NULL, dtype=np.int32)
    slots, lens = [], []
    for i, (seq_id, n, q) in enumerate(rows):
        base = 1000 * (ord(seq_id[0]) - ord("a"))
        tables[i, :n] = base + np.arange(n)
        slots.extend(base + 500 + np.arange(q))
        lens.append(q)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    return StepOutcome(
        seq_ids=[s for s, _, _ in rows],
        block_tables=tables,
        context_lens=np.array([10 * n for _, n, _ in rows], dtype=np.int32),
        query_start_loc=qsl,
        slot_mapping=np.array(slots, dtype=np.int64),
        cached_tokens={s: 0 for s, _, _ in rows},
        evicted_blocks=len(rows),
    )


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=6),
    data=st.data(),
)
def test_merge_puts_every_row_and_its_slots_back_in_request_order(rows: list, data: st.DataObject) -> None:
    ids = [chr(ord("a") + i) for i in range(len(rows))]
    parts: dict[int, list] = {}
    for seq_id, (n, q, shard) in zip(ids, rows, strict=True):
        parts.setdefault(shard, []).append((seq_id, n, q))
    order = data.draw(st.permutations(ids))
    merged = ShardMap([10, 10, 10], BS, NULL).merge(
        [shard_outcome(parts[s]) for s in sorted(parts)], order, want_metadata=True
    )
    expected = dict(zip(ids, rows, strict=True))
    assert merged.seq_ids == order
    assert merged.block_tables.shape == (len(rows), max(n for n, _, _ in rows))
    slot_at = 0
    for i, seq_id in enumerate(order):
        n, q, _ = expected[seq_id]
        base = 1000 * (ord(seq_id) - ord("a"))
        assert merged.block_tables[i].tolist() == [base + j for j in range(n)] + [NULL] * (
            merged.block_tables.shape[1] - n
        )
        assert merged.context_lens[i] == 10 * n
        assert merged.query_start_loc[i] == slot_at
        assert merged.slot_mapping[slot_at : slot_at + q].tolist() == [base + 500 + j for j in range(q)]
        slot_at += q
    assert merged.query_start_loc[-1] == slot_at == len(merged.slot_mapping)
    assert merged.evicted_blocks == len(rows)


def test_merge_with_nothing_scheduled_gives_empty_metadata_when_asked() -> None:
    shards = ShardMap([10, 10], BS, NULL)
    merged = shards.merge([StepOutcome(freed=["a"]), StepOutcome(freed=["b"])], [], want_metadata=True)
    assert merged.freed == ["a", "b"] and merged.seq_ids == []
    assert merged.block_tables.shape[0] == 0 and merged.query_start_loc.tolist() == [0]
    bare = shards.merge([StepOutcome(), StepOutcome()], [], want_metadata=False)
    assert bare.block_tables is None and bare.slot_mapping is None
