"""Eviction-order probe: the order each policy must evict in, predicted from its definition alone.

A run's random workload cannot say which cached block should have gone
first, so after the run the harness asks a small manager of each policy a
question with one right answer. Seven one-block prompts ``Q0..Q6`` are
cached in this order of events::

    Q0 Q1 Q2 Q3 Q4 Q5 released (never hit), then Q1 hit twice, Q3 hit once, then Q6 released

and single-block admissions then evict one block at a time (the eviction
loop is off: watermarks 0). After the ``j``-th the evicted set must be the
first ``j`` of the policy's order, taken from the policy definitions
(docs/architecture.md), not from akv's key functions:

- ``lru``: least recently released first: Q0 Q2 Q4 Q5 Q1 Q3 Q6.
- ``slru``: never-hit blocks (LRU among them) before hit ones: Q0 Q2 Q4 Q5 Q6 Q1 Q3.
- ``lfu``: fewest hits first, ties by recency: Q0 Q2 Q4 Q5 Q6 Q3 Q1.
"""

from __future__ import annotations

from akv.config import KVCacheConfig
from akv.manager import KVCacheManager

#: Expected eviction order of the probe prompts per policy (indices of Q0..Q6).
EXPECTED_ORDER: dict[str, tuple[int, ...]] = {
    "lru": (0, 2, 4, 5, 1, 3, 6),
    "slru": (0, 2, 4, 5, 6, 1, 3),
    "lfu": (0, 2, 4, 5, 6, 3, 1),
}
_BS = 4
_NUM_BLOCKS = 16


def _prompt(i: int) -> list[int]:
    """Probe prompt ``Qi``: one full block of its own tokens plus one token."""
    return [100 + 10 * i + k for k in range(_BS)] + [999]


async def _use(kv: KVCacheManager, seq_id: str, prompt: list[int], *, want_cached: int) -> str | None:
    """Admit, commit, free one probe prompt; an error text if its prefix hit was not ``want_cached``."""
    cached = await kv.add_sequence(seq_id, prompt)
    await kv.commit(seq_id, len(prompt) - cached)
    await kv.free(seq_id)
    if cached != want_cached:
        return f"{seq_id}: {cached} cached tokens, expected {want_cached}"
    return None


async def probe_eviction_order(policy: str) -> list[str]:
    """Run the probe for ``policy`` on a fresh 16-block manager; return what disagreed (empty: none).

    Raises:
        ActorCrashed: The probe manager crashed (a broken invariant).
    """
    config = KVCacheConfig(
        num_blocks=_NUM_BLOCKS,
        block_size=_BS,
        storage="none",
        low_watermark=0.0,
        high_watermark=0.0,
        eviction_policy=policy,
        debug_invariants=True,
    )
    errors: list[str] = []
    async with KVCacheManager(config) as kv:
        events = [(i, 0) for i in range(6)] + [(1, _BS), (1, _BS), (3, _BS), (6, 0)]
        for n, (i, want) in enumerate(events):
            if (err := await _use(kv, f"q{i}-{n}", _prompt(i), want_cached=want)) is not None:
                errors.append(err)
        free = (await kv.stats()).free
        await kv.add_sequence("filler", [7] * (free * _BS))  # every free block, no eviction
        order = EXPECTED_ORDER[policy]
        for j in range(1, len(order) + 1):
            await kv.add_sequence(f"t{j}", [8])  # one block: exactly one eviction
            evicted = {i for i in range(len(order)) if await kv.lookup(_prompt(i)) == 0}
            if evicted != set(order[:j]):
                errors.append(f"{policy}: after {j} evictions {sorted(evicted)} are gone, expected {sorted(order[:j])}")
                break
        await kv.check()
    return errors
