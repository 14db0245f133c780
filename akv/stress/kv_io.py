"""Small, exact building blocks for tests: write oracle K/V through a manager and read it back.

Every K/V written is :class:`akv.stress.oracle.KVOracle`'s value for the
sequence's exact token history, so a read through any block table can be
checked against the tokens alone. The history is the client's own record
(:func:`prefill`, :func:`fork` and :func:`append` keep it per manager), never
what the manager reports, so a manager that loses or reorders tokens cannot
make its own reads look right. The reported-case and cancellation tests use
these; the concurrent harness uses :mod:`akv.stress.client`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from weakref import WeakKeyDictionary

import anyio
import torch

from akv.core.step import Admit
from akv.manager import KVCacheManager
from akv.results import StepResult
from akv.stress.oracle import KVOracle, history_hashes

#: Per manager: the token history each sequence was given, as its client recorded it.
_histories: WeakKeyDictionary[KVCacheManager, dict[Hashable, list[int]]] = WeakKeyDictionary()


def history(kv: KVCacheManager, seq_id: Hashable) -> list[int]:
    """The client's record of ``seq_id``'s tokens (admitted by :func:`prefill`, forked by :func:`fork`).

    Raises:
        KeyError: The helpers of this module never admitted or forked ``seq_id``.
    """
    try:
        return _histories[kv][seq_id]
    except KeyError:
        raise KeyError(
            f"{seq_id!r}: no client record; admit it with kv_io.prefill and fork it with kv_io.fork"
        ) from None


def oracle_for(kv: KVCacheManager) -> KVOracle:
    """The K/V oracle of ``kv``'s model shape."""
    shape = kv.config.model
    return KVOracle(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)


def write(kv: KVCacheManager, slots: torch.Tensor, tokens: Sequence[int], start: int, stop: int) -> None:
    """Write the oracle K/V of positions ``[start, stop)`` of history ``tokens`` to ``slots``."""
    if stop <= start:
        return
    values = oracle_for(kv).values(history_hashes(tokens)[start:stop])  # (L, 2, n, H, D)
    kv.storage.write_all_layers(slots, values[:, 0], values[:, 1])


async def prefill(kv: KVCacheManager, seq_id: Hashable, prompt: Sequence[int], *, commit: bool = True) -> int:
    """Admit ``prompt``, write its non-cached tokens' K/V, commit; return the cached tokens."""
    result = await kv.step(admits=[Admit(seq_id=seq_id, prompt=list(prompt))])
    if seq_id in result.rejected:
        raise result.rejected[seq_id]
    cached = result.cached_tokens[seq_id]
    _histories.setdefault(kv, {})[seq_id] = list(prompt)
    write(kv, result.slot_mapping, prompt, cached, len(prompt))
    if commit:
        await kv.commit(seq_id, len(prompt) - cached)
    return cached


async def fork(kv: KVCacheManager, seq_id: Hashable, child_ids: Sequence[Hashable]) -> None:
    """``kv.fork``, recording each child's history as a copy of the parent's."""
    parent = history(kv, seq_id)
    await kv.fork(seq_id, child_ids)
    record = _histories[kv]
    for child in child_ids:
        record[child] = list(parent)


async def append(kv: KVCacheManager, seq_id: Hashable, tokens: Sequence[int]) -> StepResult:
    """Append, wait for the copy-on-write copies, write the new tokens' K/V for the recorded history, commit.

    Raises:
        KeyError: No client record of ``seq_id`` (see :func:`history`).
    """
    tokens = list(tokens)
    record = history(kv, seq_id)
    result = await kv.append(seq_id, tokens)
    record.extend(tokens)
    await result.copies.wait()
    write(kv, result.slot_mapping, record, len(record) - len(tokens), len(record))
    await kv.commit(seq_id, len(tokens))
    return result


async def reads_back(kv: KVCacheManager, seq_id: Hashable) -> bool:
    """Whether every committed token of ``seq_id`` reads back its own history's K/V.

    The history is the client's record when there is one (and the manager's
    token ids must then equal it), else the manager's own.
    """
    info = await kv.sequence(seq_id)
    tokens = _histories.get(kv, {}).get(seq_id)
    if tokens is None:
        tokens = list(info.token_ids)
    elif tuple(tokens) != info.token_ids:
        return False
    n = info.num_computed
    expected = oracle_for(kv).values(history_hashes(tokens)[:n])
    table = torch.tensor(info.block_ids, dtype=torch.int64)
    for layer in range(kv.storage.num_layers):
        key, value = kv.storage.gather(layer, table, n)
        if not (torch.equal(key, expected[layer, 0]) and torch.equal(value, expected[layer, 1])):
            return False
    return True


async def refcounts(kv: KVCacheManager, seq_ids: Sequence[Hashable]) -> dict[int, int]:
    """Block id -> number of block tables (of ``seq_ids``, the live ones) holding it."""
    counts: Counter[int] = Counter()
    for seq_id in seq_ids:
        counts.update((await kv.sequence(seq_id)).block_ids)
    return dict(counts)


async def block_states(kv: KVCacheManager) -> tuple[int, int, int, int, int]:
    """``(free, active, cached, in_flight, num_sequences)`` after pending copies ran."""
    await kv.wait_copies()
    s = await kv.stats()
    return (s.free, s.active, s.cached, s.in_flight, s.num_sequences)


async def quiesce(kv: KVCacheManager, timeout_s: float = 5.0) -> None:
    """Wait until pending copies ran and the eviction loop has nothing left to do (no call in flight).

    Quiet means: no message waiting in any inbox, every shard at or above
    its low watermark or without cached blocks (only then does the eviction
    loop rest; the pool as a whole is not enough, a full shard may sit beside
    a cached one), and no change in block states or eviction batches over
    20 ms. Reads the shards' published gauges (no message).

    Raises:
        TimeoutError: Not quiet within ``timeout_s``.
    """

    def evicting() -> bool:
        return any(s.num_free < s.low_free_blocks and s.blocks_available > s.num_free for s in kv._shards)

    with anyio.fail_after(timeout_s):
        while True:
            await kv.wait_copies()
            s = await kv.stats()
            if not evicting() and not any(kv.inbox_depths.values()):
                await anyio.sleep(0.02)
                s2 = await kv.stats()
                if (s2.free, s2.cached, s2.eviction_loop_batches) == (s.free, s.cached, s.eviction_loop_batches):
                    return
            await anyio.sleep(0.001)
