"""ShardMap on its own (pure, synchronous): splitting a step per shard, placement, owners, merging outcomes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_admissions_go_to_the_largest_free_fraction_less_the_step_s_earlier_admissions() -> None:
    shards = ShardMap([10, 10], BS, NULL)
    request = StepRequest(admits=[admit("a", 3 * BS), admit("b", BS), admit("c", BS, max_new_tokens=BS)])
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
    subs, _ = shards.split(StepRequest(frees=("p",), admits=[admit("p", BS)]), [10, 10])
    assert [(shard, list(sub.frees), [a.seq_id for a in sub.admits]) for shard, sub in subs] == [
        (0, [], ["p"]),
        (1, ["p"], []),
    ]


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
