"""A plain model of a prefix-cached paged KV cache, for :mod:`akv.testing.manager_machine`.

Nothing here imports akv's keys, counts or tree: the model is plain Python
over token lists, so it can judge akv instead of repeating it.

- Each live sequence: its namespace, its shard (where akv placed it: placement
  is akv's choice, read back, not predicted), its token list, and *model block
  ids* (fresh integers: a fork shares them, a prefix hit takes the cached
  entry's, copy-on-write gives the appender a fresh one).
- :attr:`PrefixModel.cache`: ``(shard, namespace, tokens of whole blocks)`` ->
  model block id, for every prefix that *may* be cached. An entry whose block a
  live sequence holds is certainly cached (a held block is never evicted);
  any other entry may have been evicted meanwhile, by demand or by the
  eviction loop, in any order the policy likes. When akv is seen to lack an
  entry (a hit or lookup that stops short of it), the entry and every longer
  prefix through it are dropped (:meth:`PrefixModel.forget`); they can come back
  only by being published again.

K/V values are a pure function of ``(namespace, token history up to a
position)``: :func:`history_values`. Any reader that knows a sequence's tokens
knows what its block table must read back.

With a host tier, eviction *demotes* a cached block instead of dropping it
when the host has room: its entry stays in the cache (it still hits, from
the host, and a hit promotes it back into a fresh device block that stands
for the same model block). Only a drop removes an entry: a device block
evicted without host room, or a host block the host tier evicts for room.
The model cannot tell a demoted entry from a device one, and needs not to:
both may be hit, neither must. A sequence *swapped out*
(:meth:`PrefixModel.swap_out`) holds no device block: its published blocks
stay in the cache as idle entries, and it comes back in fresh blocks
(:meth:`PrefixModel.swap_in`) that publish again from its first block, as
any sequence's would.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from akv.stress.oracle import GOLDEN, MASK64, splitmix64, splitmix64_array

__all__ = ["ModelSequence", "PrefixModel", "history_values"]


def history_values(
    namespace: Hashable, tokens: Sequence[int], *, num_layers: int, num_kv_heads: int, head_dim: int
) -> torch.Tensor:
    """The K/V a runner writes for every position of ``tokens`` (the history) in ``namespace``.

    Position ``p``'s values depend on the namespace and on every token up to
    ``p`` (a rolling hash), so two histories that differ anywhere before ``p``,
    or only in namespace, read back differently. Each value is the top 24 bits
    of a 64-bit mix scaled to ``[-0.5, 0.5)``: exact in float32.

    Args:
        namespace: Prefix-cache namespace (its ``repr`` seeds the hash).
        tokens: Token ids of the history, ``(n,)``.
        num_layers, num_kv_heads, head_dim: Model shape.

    Returns:
        float32 ``(num_layers, 2, n, num_kv_heads, head_dim)``, K then V.
    """
    h = int.from_bytes(hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest(), "little")
    hashes = []
    for token in tokens:
        h = splitmix64((h ^ ((int(token) + 1) * GOLDEN & MASK64)) + GOLDEN & MASK64)
        hashes.append(h)
    width = 2 * num_layers * num_kv_heads * head_dim
    salts = splitmix64_array((np.arange(width, dtype=np.uint64) + np.uint64(7)) * np.uint64(GOLDEN))
    mixed = splitmix64_array(np.asarray(hashes, dtype=np.uint64)[:, None] ^ salts[None, :])  # (n, width)
    vals = (mixed >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
    vals = vals.reshape(len(hashes), num_layers, 2, num_kv_heads, head_dim).transpose(1, 2, 0, 3, 4)
    return torch.from_numpy(np.ascontiguousarray(vals))


@dataclasses.dataclass
class ModelSequence:
    """What the model knows of one live sequence.

    Attributes:
        namespace: Its prefix-cache namespace.
        shard: The shard akv placed it on (read back after admission).
        tokens: Its token history.
        blocks: Model block ids, logical order (``ceil(len(tokens) / block_size)``).
        committed: Tokens committed (K/V written and reported).
        stopped: A full block of it duplicated another cached block for the
            same prefix: none of its later blocks is published.
    """

    namespace: Hashable
    shard: int
    tokens: list[int]
    blocks: list[int]
    committed: int = 0
    stopped: bool = False

    def copy(self) -> ModelSequence:
        """An independent copy (a fork child)."""
        return dataclasses.replace(self, tokens=list(self.tokens), blocks=list(self.blocks))


class PrefixModel:
    """Live sequences and the prefixes that may be cached (see the module docstring).

    Args:
        block_size: Tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sequences: dict[Hashable, ModelSequence] = {}
        #: ``(shard, namespace, tokens of whole blocks)`` -> model block id of each prefix that may be cached.
        self.cache: dict[tuple[int, Hashable, tuple[int, ...]], int] = {}
        #: Entries dropped from :attr:`cache` because akv was seen to have evicted them.
        self.forgotten = 0
        #: Sequences swapped out to the host tier: what they hold while away (their blocks are not held).
        self.swapped: dict[Hashable, ModelSequence] = {}
        self._next_block = 0

    # ---------------------------------------------------------------- blocks
    def fresh(self, n: int) -> list[int]:
        """``n`` new model block ids."""
        out = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return out

    def holders(self) -> Counter[int]:
        """Model block id -> live sequences holding it (the refcounts the model expects)."""
        counts: Counter[int] = Counter()
        for seq in self.sequences.values():
            counts.update(seq.blocks)
        return counts

    def held_on(self, shard: int) -> int:
        """Distinct blocks that live sequences on ``shard`` hold (its active blocks)."""
        return len({b for seq in self.sequences.values() if seq.shard == shard for b in seq.blocks})

    def append_need(self, seq_id: Hashable, num_tokens: int) -> tuple[int, int]:
        """``(total, new)`` blocks of ``seq_id`` after appending ``num_tokens``: all, and new ones (a copy counts)."""
        seq = self.sequences[seq_id]
        total = self.num_blocks_needed(len(seq.tokens) + num_tokens)
        copy = bool(len(seq.tokens) % self.block_size) and self.holders()[seq.blocks[-1]] > 1
        return total, total - len(seq.blocks) + copy

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- prefixes
    def key(self, shard: int, namespace: Hashable, tokens: Sequence[int], num_blocks: int) -> tuple:
        """Cache key of the first ``num_blocks`` whole blocks of ``tokens``."""
        return (shard, namespace, tuple(tokens[: num_blocks * self.block_size]))

    def bounds(self, shard: int, namespace: Hashable, tokens: Sequence[int], limit: int) -> tuple[int, int]:
        """``(certain, possible)``: leading blocks of ``tokens`` (at most ``limit``) that must / may hit.

        A hit must cover the blocks that live sequences hold (they cannot have
        been evicted) and may cover no more than the entries that may be cached.
        """
        held = self.holders()
        certain = possible = 0
        for j in range(1, limit + 1):
            block = self.cache.get(self.key(shard, namespace, tokens, j))
            if block is None:
                break
            possible = j
            if certain == j - 1 and held[block]:
                certain = j
        return certain, possible

    def forget(self, key: tuple) -> int:
        """Drop ``key`` and every longer cached prefix through it (akv evicted them); return how many."""
        shard, namespace, prefix = key
        n = len(prefix)
        gone = [k for k in self.cache if k[0] == shard and k[1] == namespace and k[2][:n] == prefix]
        for k in gone:
            del self.cache[k]
        self.forgotten += len(gone)
        return len(gone)

    def observe_hits(self, shard: int, namespace: Hashable, tokens: Sequence[int], limit: int, hits: int) -> list[int]:
        """Check a prefix hit of ``hits`` blocks seen on ``shard``; return the hit model block ids.

        A hit shorter than the cache allows means akv evicted the next entry:
        it is forgotten.

        Raises:
            AssertionError: ``hits`` is outside what the model allows.
        """
        certain, possible = self.bounds(shard, namespace, tokens, limit)
        assert certain <= hits <= possible, (
            f"shard {shard} ns {namespace!r}: hit {hits} blocks of {list(tokens)}; "
            f"the model allows {certain}..{possible} (held..may be cached)"
        )
        if hits < possible:
            self.forget(self.key(shard, namespace, tokens, hits + 1))
        return [self.cache[self.key(shard, namespace, tokens, j)] for j in range(1, hits + 1)]

    def observe_lookup(self, namespace: Hashable, tokens: Sequence[int], limit: int, hits: int, shards: int) -> None:
        """Check a lookup's ``hits`` against the bounds of the shards it may have asked.

        A lookup asks one shard, the one an admission of ``tokens`` would be
        placed on (akv's choice, not predicted here): ``hits`` must lie within
        some shard's bounds. When exactly one shard's bounds allow it, that
        shard was asked, and a hit short of its possible one means it lacks
        entry ``hits + 1``.

        Raises:
            AssertionError: ``hits`` is outside every shard's bounds.
        """
        per_shard = [self.bounds(s, namespace, tokens, limit) for s in range(shards)]
        asked = [s for s, (c, p) in enumerate(per_shard) if c <= hits <= p]
        assert asked, f"lookup ns {namespace!r} {list(tokens)}: {hits} blocks; the shards allow {per_shard}"
        if len(asked) == 1 and hits < per_shard[asked[0]][1]:
            self.forget(self.key(asked[0], namespace, tokens, hits + 1))

    # ---------------------------------------------------------------- publishing
    def own_run(self, seq: ModelSequence) -> int:
        """Leading blocks of ``seq`` that stand in the cache as its very blocks."""
        n = 0
        while (n + 1) * self.block_size <= len(seq.tokens) and n < len(seq.blocks):
            if self.cache.get(self.key(seq.shard, seq.namespace, seq.tokens, n + 1)) != seq.blocks[n]:
                break
            n += 1
        return n

    def _full_committed(self, seq: ModelSequence) -> int:
        return min(seq.committed // self.block_size, len(seq.blocks))

    def claim(self, seq_id: Hashable, published: int) -> None:
        """Record that akv reports ``published`` leading blocks of ``seq_id`` in the cache as its own.

        A sequence publishes each full committed block unless another block
        already stands for that prefix; a previous entry that no live sequence
        held may have been evicted first, which this observation settles. A
        count below the model's is allowed (a fork child learns of blocks its
        parent published later). Call :meth:`check_stop` once every claim of
        the step is in.

        Raises:
            AssertionError: It claims blocks that are not full and committed,
                claims after having stopped, or takes a prefix whose cached
                block a live sequence holds.
        """
        seq = self.sequences[seq_id]
        run = self.own_run(seq)
        if published <= run:
            return
        full = self._full_committed(seq)
        assert not seq.stopped, f"{seq_id}: published {published} blocks after publishing stopped at {run}"
        assert published <= full, f"{seq_id}: published {published} blocks, only {full} are full and committed"
        held = self.holders()
        for i in range(run, published):
            key = self.key(seq.shard, seq.namespace, seq.tokens, i + 1)
            have = self.cache.get(key)
            if have is not None and have != seq.blocks[i]:
                assert not held[have], f"{seq_id}: published block {i} for a prefix a live sequence holds"
                self.forget(key)  # that entry was evicted before this publish
            self.cache[key] = seq.blocks[i]

    def check_stop(self, seq_id: Hashable) -> None:
        """A sequence whose full committed blocks are not all published must have met another block.

        Call after a commit that filled a block (or a ``prefill_done``
        admission). If the next block's prefix is cached as another block,
        the sequence publishes nothing more (:attr:`ModelSequence.stopped`).

        Raises:
            AssertionError: Nothing stands for that prefix.
        """
        seq = self.sequences[seq_id]
        run = self.own_run(seq)
        if seq.stopped or run >= self._full_committed(seq):
            return
        have = self.cache.get(self.key(seq.shard, seq.namespace, seq.tokens, run + 1))
        assert have is not None, f"{seq_id}: block {run} is full and committed but was not published"
        seq.stopped = True

    # ---------------------------------------------------------------- one step's items
    def commit(self, commits: dict[Hashable, int], published_of: Callable[[Hashable], int]) -> None:
        """Apply a step's commits: counts, then the publishes akv reports (``published_of(seq_id)``).

        Every claim of the step is recorded before any stop is judged, since
        two sequences of one step may race for the same prefix.
        """
        filled = []
        for seq_id, n in commits.items():
            seq = self.sequences[seq_id]
            if (seq.committed + n) // self.block_size > seq.committed // self.block_size:
                filled.append(seq_id)
            seq.committed += n
        for seq_id in commits:
            self.claim(seq_id, published_of(seq_id))
        for seq_id in filled:
            self.check_stop(seq_id)

    def fork(self, parent_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Each child shares every block of the parent (same model block ids)."""
        for child_id in child_ids:
            self.sequences[child_id] = self.sequences[parent_id].copy()

    def append(self, seq_id: Hashable, tokens: Sequence[int]) -> bool:
        """Append ``tokens``; return whether the shared partial tail was copied first (copy-on-write)."""
        seq = self.sequences[seq_id]
        copied = bool(len(seq.tokens) % self.block_size) and self.holders()[seq.blocks[-1]] > 1
        if copied:
            seq.blocks[-1] = self.fresh(1)[0]
        seq.tokens += tokens
        seq.blocks += self.fresh(self.num_blocks_needed(len(seq.tokens)) - len(seq.blocks))
        return copied

    def admit(
        self, seq_id: Hashable, namespace: Hashable, shard: int, prompt: list[int], hits: int, published: int | None
    ) -> None:
        """Record an admission akv placed on ``shard`` with ``hits`` cached blocks (checked first).

        ``published`` is akv's reported count of its blocks in the cache (a
        ``prefill_done`` admission publishes its whole prompt at once; pass
        ``None`` otherwise).

        Raises:
            AssertionError: The hit is not one the model allows (:meth:`observe_hits`).
        """
        hit_blocks = self.observe_hits(shard, namespace, prompt, (len(prompt) - 1) // self.block_size, hits)
        fresh = self.fresh(self.num_blocks_needed(len(prompt)) - hits)
        self.sequences[seq_id] = ModelSequence(namespace, shard, prompt, hit_blocks + fresh, hits * self.block_size)
        if published is not None:
            self.sequences[seq_id].committed = len(prompt)
            self.claim(seq_id, published)
            self.check_stop(seq_id)

    # ---------------------------------------------------------------- swaps
    def swap_out(self, seq_id: Hashable) -> None:
        """``seq_id`` moved to the host tier: it holds no block now (its published ones stay cached, idle)."""
        self.swapped[seq_id] = self.sequences.pop(seq_id)

    def swap_in(self, seq_id: Hashable) -> None:
        """``seq_id`` came back in fresh device blocks (new model ids, none of them published yet)."""
        seq = self.swapped.pop(seq_id)
        seq.blocks = self.fresh(len(seq.blocks))
        seq.stopped = False
        self.sequences[seq_id] = seq
