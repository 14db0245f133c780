"""A long SLRU release (numpy path) leaves the pool exactly as the per-block loop does."""

from __future__ import annotations

import random

import pytest

import akv.core.block_refs as block_refs
from akv.core.block_pool import BlockPool

N = 2048


def _scenario(seed: int) -> tuple:
    """Allocate, publish some, hit some (protected on release), release long batches; the pool's observable state."""
    rnd = random.Random(seed)
    pool = BlockPool(range(100, 100 + N), policy="slru")
    seqs = [pool.allocate(rnd.randint(500, 700)) for _ in range(2)]
    for ids in seqs:
        pool.mark_published(rnd.sample(ids, len(ids) * 3 // 4))
    pool.decref(seqs[0][::-1], distinct=True)  # cached blocks enter probation, deepest first
    hits = [b for b in seqs[0] if pool.is_published(b)][: rnd.randint(100, 300)]
    pool.incref(hits, hit=True, distinct=True)  # taken again as prefix hits: protected when released
    pool.decref(hits + seqs[1], distinct=True)
    pool.check()
    return pool.counts(), pool.eviction_order(), pool.allocate(pool.num_free), pool.blocks_freed


@pytest.mark.parametrize("seed", range(4))
def test_long_slru_release_equals_the_loop(monkeypatch, seed: int) -> None:
    bulk = _scenario(seed)
    monkeypatch.setattr(block_refs, "_NUMPY_RELEASE_MIN", 10**9)  # every release through the loop
    loop = _scenario(seed)
    assert bulk == loop
    assert bulk[0]["cached"] > 0 and bulk[0]["free"] > 0 and bulk[0]["active"] == 0
