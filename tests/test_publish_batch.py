"""A decode step's newly full blocks reach the prefix tree whether a few or many fill at once.

``_queue_publish_single`` reads up to ``_SCALAR_SINGLES`` blocks with scalar
reads and more with numpy gathers; both must publish the same blocks, with
their parents and tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from akv.core.publish import _SCALAR_SINGLES
from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepRequest

BS = 4


@pytest.mark.parametrize("num_seqs", [1, _SCALAR_SINGLES, _SCALAR_SINGLES + 1, 3 * _SCALAR_SINGLES])
def test_blocks_filled_by_one_commit_are_published_with_their_tokens(num_seqs: int) -> None:
    state = ShardState(0, range(0, 256), BS)
    ids = [f"s{i}" for i in range(num_seqs)]
    prompts = {
        sid: [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4, 10 * i + 5, 10 * i + 6, 7] for i, sid in enumerate(ids)
    }
    state.step(
        StepRequest(admits=[Admit(seq_id=sid, prompt=np.array(p, dtype=np.int32)) for sid, p in prompts.items()])
    )
    state.step(StepRequest(commits=dict.fromkeys(ids, 7)))  # block 0 of each published; 3 tokens in block 1
    assert sorted(state.tree.block_ids()) == sorted(state.sequences[sid].block_ids[0] for sid in ids)
    state.step(StepRequest(appends={sid: 100 + i for i, sid in enumerate(ids)}))
    out = state.step(StepRequest(commits=dict.fromkeys(ids, 1), appends={sid: 200 for sid in ids}))
    # the commit filled block 1 of every sequence: one tree insert each, below its block 0
    blocks = [state.sequences[sid].block_ids[1] for sid in ids]
    assert out.stored_block_ids == blocks
    for i, sid in enumerate(ids):
        full = np.array([*prompts[sid], 100 + i, 200], dtype=np.int32)
        assert state.lookup(None, full) == 2
        assert (
            state.tree.match(state.namespace_key(None), full[: 2 * BS]) == state.sequences[sid].block_ids.tolist()[:2]
        )
        assert state.sequences[sid].num_published == 2
    state.check()
