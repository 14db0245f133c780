"""Pure helpers of the trace-mode peer comparison: schedule and the concurrent simulators.

No peers needed: stress/peer_trace.py imports peer_bench and the peers only in ``run``.
"""

from __future__ import annotations

import pytest
from stress_scripts import load

be = load("bench_eviction")
pt = load("peer_trace")


def _sim(events, blocks, capacity, policy, caps=None, out_cached=None, watermarks=None):
    caps = caps or [len(b) for b in blocks]
    out_cached = out_cached or [0] * len(blocks)
    return be.simulate(events, blocks, caps, out_cached, capacity, policy, watermarks)


def _sequential(order):
    """Admit and finish one request at a time."""
    ev = []
    for r in order:
        ev += [("A", r), ("S",), ("F", r), ("S",)]
    return ev


def test_belady_beats_lru_on_a_known_stream():
    # Chains A=[1], B=[2], C=[3], one block each; capacity 2; accesses A B C A B.
    # LRU misses everything (a cycle larger than the cache). Belady: when C arrives, A is
    # next used at 3 and B at 4, so B goes (farthest): A hits, then B misses: 1 hit.
    blocks = [[1], [2], [3], [1], [2]]
    caps = [1] * 5
    ev = _sequential(range(5))
    lru = _sim(ev, blocks, 2, "lru", caps)
    bel = _sim(ev, blocks, 2, "belady", caps)
    assert lru["hits"] == {0: 0, 1: 0, 2: 0, 3: 0, 4: 0}
    assert bel["hits"] == {0: 0, 1: 0, 2: 0, 3: 1, 4: 0}
    unb = _sim(ev, blocks, None, "lru", caps)
    assert sum(unb["hits"].values()) == 2


def test_held_blocks_are_never_evicted_and_serve_hits():
    # Request 0 holds chain [1, 2] while request 1 (same chain) is admitted: full hit even
    # though the pool is exactly full; nothing can be evicted while both hold it.
    blocks = [[1, 2], [1, 2]]
    ev = [("A", 0), ("S",), ("A", 1), ("S",), ("F", 0), ("F", 1), ("S",)]
    for policy in ("lru", "belady"):
        res = _sim(ev, blocks, 2, policy)
        assert res["hits"] == {0: 0, 1: 2}
        assert res["evicted"] == 0 and res["peak_held"] == 2


def test_pool_overflow_is_reported():
    blocks = [[1, 2], [3, 4]]
    ev = [("A", 0), ("A", 1)]
    with pytest.raises(be.PoolOverflow):
        _sim(ev, blocks, 3, "lru")


def test_hit_cap_and_leaf_only_eviction():
    # Chain [1, 2, 3]; a later request with the same chain may hit at most caps=2 blocks.
    # Capacity 3 and a one-block request in between: LRU evicts the deepest block (3) first,
    # so the prefix [1, 2] survives and still hits.
    blocks = [[1, 2, 3], [9], [1, 2, 3]]
    caps = [3, 1, 2]
    ev = _sequential([0, 1, 2])
    for policy in ("lru", "belady"):
        res = _sim(ev, blocks, 3, policy, caps)
        assert res["hits"][2] == 2, policy


def test_lru_output_blocks_take_cache_space():
    # Request 0 caches [1]; request 1 ([2]) decodes two more blocks that it publishes, so at
    # its finish the LRU order is 1, out, out, 2 and request 2's two new blocks evict 1 and
    # one output block: request 3 ([1]) misses. Unpublished outputs would be freed instead
    # and [1] would survive.
    blocks = [[1], [2], [7, 8], [1]]
    caps = [1, 1, 2, 1]
    ev = [*_sequential([0]), ("A", 1), ("G", 1, 2), ("S",), ("F", 1), ("S",), *_sequential([2, 3])]
    res = be.simulate(ev, blocks, caps, [0, 2, 0, 0], 4, "lru")
    assert res["hits"][3] == 0
    res = be.simulate(ev, blocks, caps, [0, 0, 0, 0], 4, "lru")
    assert res["hits"][3] == 1
    # Belady frees never-reused output blocks and keeps [1].
    assert be.simulate(ev, blocks, caps, [0, 2, 0, 0], 4, "belady")["hits"][3] == 1


def test_watermarks_evict_early():
    blocks = [[1, 2], [1, 2]]
    ev = _sequential([0, 1])
    assert _sim(ev, blocks, 4, "lru")["hits"][1] == 2
    # Below 60% free after request 0's finish (2 of 4): evict to 3 free, deepest block first.
    assert _sim(ev, blocks, 4, "lru", watermarks=(0.6, 0.6))["hits"][1] == 1
    assert _sim(ev, blocks, 4, "lru", watermarks=(0.9, 1.0))["hits"][1] == 0


def _req(rid, n_in, decode, ids=(0,)):
    return pt.Req(rid, n_in, decode, tuple(ids) * (-(-n_in // 512)))


def test_schedule_reserves_full_length_and_skips_too_large():
    reqs = [_req(0, 32, 16), _req(1, 32, 16), _req(2, 10_000, 4), _req(3, 16, 1)]
    # reserve: ceil(48/16)=3, 3, ceil(10004/16)=626, ceil(17/16)=2
    assert [pt.reserve_blocks(r) for r in reqs] == [3, 3, 626, 2]
    s = pt.build_schedule(reqs, 5, batch=8, prefill_budget=0)
    assert s["skipped"] == [2]
    assert s["peak_reserved"] <= 5
    admitted = [r for a, _ in s["steps"] for r in a]
    finished = [r for _, f in s["steps"] for r in f]
    assert admitted == [0, 1, 3] and sorted(finished) == [0, 1, 3]
    assert s["steps"][0][0] == [0]  # 1 would need 6 > 5 blocks: waits
    # Unlimited pool: both admitted together.
    assert pt.build_schedule(reqs[:2], None, batch=8, prefill_budget=0)["steps"][0][0] == [0, 1]


def test_schedule_events_grow_at_block_boundaries():
    reqs = [_req(0, 16, 17)]  # decode k writes position 16 + k - 1: new blocks at k=1 and k=17
    s = pt.build_schedule(reqs, None, batch=1, prefill_budget=0)
    ev = list(pt.schedule_events(reqs, s["steps"]))
    assert sum(e[2] for e in ev if e[0] == "G") == 2
    assert pt.reserve_blocks(reqs[0]) == 3
    res = be.simulate(ev, [[5]], [0], [1], 3, "lru")
    assert res["peak_held"] == 3


def test_sim_matches_sequential_unbounded_on_a_trace_slice():
    from akv.trace import default_trace_path, expected_cached_tokens, read_trace

    records = read_trace(default_trace_path(), limit=200)
    reqs = pt.make_reqs(records, 64)
    s = pt.build_schedule(reqs, None, batch=8, prefill_budget=16384)
    unb = pt.sim_hit_rate(reqs, s["steps"], None, "lru")
    assert unb["cached_tokens"] == sum(expected_cached_tokens(records, block_size=16, trace_block_tokens=512))
    cap = 2 * s["peak_reserved"]
    lru = pt.sim_hit_rate(reqs, s["steps"], cap, "lru")
    bel = pt.sim_hit_rate(reqs, s["steps"], cap, "belady")
    assert lru["hit_rate"] <= bel["hit_rate"] <= unb["hit_rate"]
