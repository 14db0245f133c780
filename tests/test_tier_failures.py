"""A held demotion whose copy failed: put back on the device, or dropped when its parent moved to the host meanwhile."""

from __future__ import annotations

import numpy as np

from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepOutcome, StepRequest


def _shard() -> ShardState:
    """4 device blocks of 2 tokens, 4 host ids, copies pending until reported; one cached chain A -> B."""
    state = ShardState(0, range(0, 4), 2, null_block_id=4, host_ids=range(5, 9), sync_copies=False)
    prompt = np.array([1, 2, 3, 4, 0], dtype=np.int32)
    state.step(StepRequest(admits=[Admit(seq_id="s", prompt=prompt, prefill_done=True)]))
    state.step(StepRequest(frees=["s"]))
    assert state.pool.num_cached == 2
    return state


def _evict_one(state: ShardState) -> StepOutcome:
    out = StepOutcome()
    assert state.evict(1, out) == 1 and len(out.demotes) == 1
    return out


def test_a_failed_held_demotion_goes_back_to_the_device() -> None:
    state = _shard()
    out = _evict_one(state)
    ((dev, hid),) = out.demotes
    assert state.tree.is_host(hid) and hid in state.unready
    put_back, dropped = state.transfer_done(out.transfer, ok=False)
    assert (put_back, dropped) == ([(hid, dev)], [])
    assert dev in state.tree and hid not in state.tree and not state.unready
    assert state.pool.num_cached == 2 and state.host.num_free == 4
    state.check()


def test_a_failed_held_demotion_below_a_demoted_parent_leaves_the_tree() -> None:
    state = _shard()
    child = _evict_one(state)  # B moves to the host, its copy pending
    parent = _evict_one(state)  # then A (a device leaf now), its copy pending too
    (_, child_hid), (_, parent_hid) = child.demotes[0], parent.demotes[0]
    assert state.tree.parent_of(child_hid)[0] == parent_hid
    put_back, dropped = state.transfer_done(child.transfer, ok=False)  # B's copy failed: no device place for it
    assert (put_back, dropped) == ([], [child_hid])
    assert child_hid not in state.tree and parent_hid in state.tree
    state.transfer_done(parent.transfer)
    assert len(state.tree) == 1 and state.pool.num_free == 4 and state.host.num_cached == 1
    state.check()
