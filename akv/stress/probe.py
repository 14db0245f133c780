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

:func:`probe_pinned_child` and :func:`probe_pending_hits` ask questions a
random run reaches too rarely to rely on: while a copy is pending its
blocks stay pinned, ``wait_copies()`` waits for it and a cached parent above
its published source stays (leaves only); and a step's admission never evicts
the block a later admission of the same step hits.
"""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel

from akv.config import KVCacheConfig
from akv.core.step import Admit
from akv.errors import ActorCrashed, PoolExhausted
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


async def probe_eviction_order(policy: str, expected: tuple[int, ...] | None = None) -> list[str]:
    """Run the probe for ``policy`` on a fresh 16-block manager; return what disagreed (empty: none).

    Args:
        policy: ``lru``, ``lfu`` or ``slru``.
        expected: The order to hold it to (default :data:`EXPECTED_ORDER` of ``policy``).

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
        order = expected if expected is not None else EXPECTED_ORDER[policy]
        for j in range(1, len(order) + 1):
            await kv.add_sequence(f"t{j}", [8])  # one block: exactly one eviction
            evicted = {i for i in range(len(order)) if await kv.lookup(_prompt(i)) == 0}
            if evicted != set(order[:j]):
                errors.append(f"{policy}: after {j} evictions {sorted(evicted)} are gone, expected {sorted(order[:j])}")
                break
        await kv.check()
    return errors


async def probe_pinned_child() -> list[str]:
    """Pending copies: their blocks stay pinned, ``wait_copies()`` waits, a cached parent above them stays.

    ``a`` (one full block plus 2 tokens) is forked to ``b``; ``b``'s append
    copies the shared tail (the copy is held at the storage seam), ``a``
    fills and commits that tail (published, still the copy's source), both
    are freed: the first block is cached, the tail and ``b``'s copy in
    flight. While the copy is held, ``wait_copies()`` must not return, an
    admission needing one block more than is free must be refused (only
    leaves are evicted), and a new sequence must not get the copy's
    destination block.

    Returns:
        What disagreed (empty: none).
    """
    config = KVCacheConfig(num_blocks=8, block_size=_BS, low_watermark=0.0, high_watermark=0.0, debug_invariants=True)
    errors: list[str] = []
    try:
        await _pinned_child(KVCacheManager(config), errors)
    except ActorCrashed as exc:
        errors.append(f"the pending-copy probe crashed the manager: {exc.cause!r}")
    return errors


async def _pinned_child(kv: KVCacheManager, errors: list[str]) -> None:
    async with kv:
        gate = threading.Event()
        copy = kv.storage._copy_unchecked  # the harness holds the real copy at the storage seam

        def held(src, dst) -> None:  # runs in the stream worker's thread
            gate.wait(30)
            copy(src, dst)

        kv.storage._copy_unchecked = held
        waited = anyio.Event()

        async def wait_copies() -> None:
            await kv.wait_copies()
            waited.set()

        try:
            await kv.add_sequence("a", [1, 2, 3, 4, 5, 6])
            await kv.commit("a", 6)
            await kv.fork("a", ["b"])
            await kv.append("b", [7])  # copy-on-write of the shared tail, held
            destination = (await kv.sequence("b")).block_ids[-1]
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_copies)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                if waited.is_set():
                    errors.append("wait_copies() returned while a copy was still held")
                await _while_held(kv, destination, errors)
                gate.set()
        finally:
            gate.set()
        await kv.wait_copies()
        if await kv.lookup([1, 2, 3, 4, 5, 6, 8, 9, 0]) != 2 * _BS:
            errors.append("the pinned block's prefix is no longer served after its copy ran")
        await kv.check()


async def _while_held(kv: KVCacheManager, destination: int, errors: list[str]) -> None:
    await kv.append("a", [8, 9])
    await kv.commit("a", 2)  # the tail is full: published, still the copy's source
    await kv.free("a")
    await kv.free("b")
    await kv.add_sequence("c", [60])
    if destination in (await kv.sequence("c")).block_ids:
        errors.append(f"block {destination}, a pending copy's destination, was handed out again")
    await kv.free("c")
    free = (await kv.stats()).free
    try:
        await kv.add_sequence("big", [7] * ((free + 1) * _BS))
        errors.append("a cached block above a pinned published block was evicted")
        await kv.free("big")
    except PoolExhausted:
        pass


async def probe_pending_hits() -> list[str]:
    """Blocks a step's later admission hits are not evicted for an earlier admission of that step.

    ``P`` then ``Q`` (one full block plus a token each) are cached, every
    other block but two is held; one step admits ``A`` (fresh, two blocks)
    then ``B`` (hits ``P``'s block, needs one more): the step must evict
    ``Q``'s block, though ``P``'s comes first in every policy's order, and
    serve both, ``B`` with the hit.

    Returns:
        What disagreed (empty: none).
    """
    config = KVCacheConfig(
        num_blocks=8, block_size=_BS, storage="none", low_watermark=0.0, high_watermark=0.0, debug_invariants=True
    )
    errors: list[str] = []
    try:
        async with KVCacheManager(config) as kv:
            for seq_id, prompt in (("p", [1, 2, 3, 4, 5]), ("q", [11, 12, 13, 14, 15])):
                if (err := await _use(kv, seq_id, prompt, want_cached=0)) is not None:
                    errors.append(err)
            free = (await kv.stats()).free
            await kv.add_sequence("hold", [7] * ((free - 2) * _BS))  # two blocks stay free
            result = await kv.step(
                admits=[Admit(seq_id="A", prompt=[50] * (2 * _BS)), Admit(seq_id="B", prompt=[1, 2, 3, 4, 6])],
                want_metadata=False,
            )
            if result.rejected or result.cached_tokens.get("B") != _BS:
                errors.append(f"pending hit: rejected {sorted(result.rejected)}, cached {dict(result.cached_tokens)}")
            if await kv.lookup([11, 12, 13, 14, 15]) != 0 or await kv.lookup([1, 2, 3, 4, 6]) != _BS:
                errors.append("pending hit: the admission evicted the block a later admission hits")
            await kv.check()
    except ActorCrashed as exc:
        errors.append(f"the pending-hit probe crashed the manager: {exc.cause!r}")
    return errors
