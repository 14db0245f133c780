"""Blocks a pending copy still pins when their sequence is freed: eviction meets leaves first, never a whole chain refused."""

from __future__ import annotations

import numpy as np
import pytest

from akv.core.eviction_policy import EVICTION_POLICIES
from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepOutcome, StepRequest


def _admit(state: ShardState, seq_id: str, tokens: list[int]) -> StepOutcome:
    prompt = np.array(tokens, dtype=np.int32)
    return state.step(StepRequest(admits=[Admit(seq_id=seq_id, prompt=prompt, prefill_done=True)]))


def _promoting_shard() -> tuple[ShardState, StepOutcome]:
    """Chain A-B-C demoted to the host; then ``s2`` = A-B-C-D admitted: A-B-C promoted, their copy still pending."""
    state = ShardState(0, range(0, 8), 2, null_block_id=8, host_ids=range(9, 17), sync_copies=False)
    _admit(state, "s1", [1, 2, 3, 4, 5, 6, 0])
    state.step(StepRequest(frees=["s1"]))
    out = StepOutcome()
    assert state.evict(3, out) == 3 and len(out.demotes) == 3
    state.transfer_done(out.transfer)
    assert state.host.num_cached == 3 and state.pool.num_cached == 0
    promoted = _admit(state, "s2", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert len(promoted.promoted_to) == 3 and promoted.transfer is not None
    return state, promoted


def test_a_chain_freed_while_its_promotion_copy_pends_is_evicted_deepest_first() -> None:
    state, promoted = _promoting_shard()
    state.step(StepRequest(frees=["s2"]))  # D cached now; A, B, C in flight until the copy ran
    pool = state.pool
    assert pool.num_cached == 1 and pool.num_in_flight == 3
    assert state.evict(4, StepOutcome()) == 1  # D only: the blocks above a pinned block are skipped, not refused
    assert state.counters.eviction_refusals == 0
    state.transfer_done(promoted.transfer)
    a, b, c = promoted.promoted_to
    assert pool.eviction_order() == [c, b, a]  # entered as if freed now: children first
    out = StepOutcome()
    assert state.evict(3, out) == 3 and state.counters.eviction_refusals == 0
    assert out.demoted == [c, b, a]
    state.check()


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_cached_ancestors_enter_again_above_a_chain_released_late(policy: str) -> None:
    """X-A-B-C cached, A-B-C demoted; X-A-B-C-D admitted (X a device hit, A-B-C promoted) and freed before the copy."""
    state = ShardState(
        0, range(0, 8), 2, null_block_id=8, host_ids=range(9, 17), sync_copies=False, eviction_policy=policy
    )
    _admit(state, "s1", [7, 7, 1, 2, 3, 4, 5, 6, 0])
    state.step(StepRequest(frees=["s1"]))
    out = StepOutcome()
    assert state.evict(3, out) == 3
    state.transfer_done(out.transfer)
    promoted = _admit(state, "s2", [7, 7, 1, 2, 3, 4, 5, 6, 8, 8, 0])
    x, d = (int(b) for b in state.get("s2").block_ids.view()[[0, 4]])
    state.step(StepRequest(frees=["s2"]))
    assert state.pool.eviction_order() == [d, x]
    state.transfer_done(promoted.transfer)
    a, b, c = promoted.promoted_to
    assert state.pool.eviction_order() == [d, c, b, a, x]  # X, cached before, enters again above them
    assert state.evict(5, StepOutcome()) == 5 and state.counters.eviction_refusals == 0
    state.check()


def test_a_step_short_of_room_takes_held_demotions_and_waits_for_their_copy() -> None:
    """All 8 device blocks: 4 held in flight by the eviction loop's demotion, 4 active; a prompt of 3 blocks takes 3 of them."""
    state = ShardState(0, range(0, 8), 2, null_block_id=8, host_ids=range(9, 17), sync_copies=False)
    _admit(state, "old", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    state.step(StepRequest(frees=["old"]))
    _admit(state, "busy", [9, 9, 8, 8, 7, 7, 6, 6])
    demoting = StepOutcome()
    assert state.evict(4, demoting) == 4 and state.pool.num_in_flight == 4 and state.pool.num_free == 0
    assert state.evictable_now() == 4  # the held blocks count: a step may take them
    out = _admit(state, "new", [5, 5, 4, 4, 3])
    assert "new" in out.seq_ids and out.wait_transfer == demoting.transfer  # its runner waits for that copy
    taken = set(state.get("new").block_ids.view().tolist())
    assert taken <= {d for d, _ in demoting.demotes} and len(taken) == 3
    assert all(state.pool.is_pinned(b) for b in taken)  # freed before the copy ran, it would stay in flight
    assert all(h in state.unready for _, h in demoting.demotes)
    state.transfer_done(demoting.transfer)
    assert not state.unready and state.pool.total_pins == 0 and state.host.num_cached == 4
    state.step(StepRequest(frees=["new", "busy"]))
    again = _admit(state, "again", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert len(again.promoted) == 4  # the demoted chain is a host hit, its copy having run
    state.check()
