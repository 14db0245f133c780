"""Admissions: prefix matches and the hits a step's evictions must not take (part of :class:`~akv.core.shard_state.ShardState`)."""

from __future__ import annotations

from akv.core.reservation import admission_reserve


def _protect(protected: dict[int, int], block_ids: list[int]) -> None:
    for b in block_ids:
        protected[b] = protected.get(b, 0) + 1


def _unprotect(protected: dict[int, int], block_ids: list[int]) -> None:
    for b in block_ids:
        left = protected[b] - 1
        if left:
            protected[b] = left
        else:
            del protected[b]


class PendingHits:
    """Prefix hits of a step's admissions not applied yet: blocks its evictions must skip.

    A multiset (two admissions may hit the same blocks, and one being done or
    rejected must not expose the other's), built only when an eviction first
    needs it and kept up to date from then on: a step that evicts nothing
    pays one dict entry per admission instead of two dict updates per hit
    block.
    """

    __slots__ = ("_counts", "_lists")

    def __init__(self) -> None:
        self._lists: dict[int, list[int]] = {}
        self._counts: dict[int, int] | None = None

    def add(self, key: int, hits: list[int]) -> None:
        """Admission ``key`` (its index in the step) will take references to ``hits``."""
        self._lists[key] = hits
        if self._counts is not None:
            _protect(self._counts, hits)

    def discard(self, key: int) -> None:
        """Admission ``key`` is applied or rejected: its hits need no protection any more."""
        hits = self._lists.pop(key, None)
        if hits is not None and self._counts is not None:
            _unprotect(self._counts, hits)

    def blocks(self) -> dict[int, int]:
        """Block id -> pending admissions hitting it (a container for ``in`` and iteration)."""
        if self._counts is None:
            counts: dict[int, int] = {}
            for hits in self._lists.values():
                _protect(counts, hits)
            self._counts = counts
        return self._counts


class ShardAdmission:
    """Admissions; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes)."""

    __slots__ = ()

    def _evict_for_admissions(self, admits: list, matches: dict[int, list[int]], protected: PendingHits) -> int:
        """Evict the whole step's admission shortfall in one pass; return the blocks evicted.

        The admissions would otherwise each evict their own shortfall (one
        eviction pass, with its tree message, per admission). The victims are
        the same blocks in the same order: allocations add nothing to the
        eviction order and every pending hit is protected either way. Does
        nothing unless the whole shortfall can be met (then some admission
        will be rejected, and the per-admission path decides which); an
        admission larger than the shard is left out of the count.
        """
        bs, pool = self.block_size, self.pool
        need = 0
        for i, adm in enumerate(admits):
            length = len(adm.prompt)
            total = -(-length // bs)
            reserve = admission_reserve(length, adm.max_new_tokens, bs)
            if total + reserve <= pool.num_blocks:
                need += total + reserve - min(len(matches.get(i, ())), (length - 1) // bs)
        short = need - (pool.num_free - self.num_reserved)
        if short <= 0 or short > self._evictable(protected.blocks()):
            return 0
        evicted = self._evict(short, protected.blocks())
        return evicted
