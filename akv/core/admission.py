"""Admissions: prefix matches and the hits a step's evictions must not take (part of :class:`~akv.core.shard_state.ShardState`)."""

from __future__ import annotations

from akv.core.publish import PendingPublish
from akv.core.reservation import admission_reserve
from akv.core.sequence import Sequence
from akv.core.step import StepOutcome


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

    def _evict_for_admissions(
        self, admits: list, matches: dict[int, list[int]], protected: PendingHits, out: StepOutcome
    ) -> None:
        """Evict the whole step's admission shortfall in one pass (recorded in ``out``).

        The admissions would otherwise each evict their own shortfall (one
        eviction pass, with its tree removals, per admission). The victims are
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
                need += total + reserve - min(self._split_hits(matches.get(i, [])), (length - 1) // bs)
        short = need - (pool.num_free - self.num_reserved)
        if 0 < short <= self._evictable(protected.blocks()):
            self._evict(short, protected.blocks(), out)

    def _match_admissions(self, admits) -> dict[int, list[int]]:
        """Match phase: every admission's prefix hits now (the tree compares the prompt's int32 bytes run by run).

        Returns:
            Admission index -> hit block ids (the last prompt token is never
            served from the cache); empty without a prefix cache.
        """
        if not self.enable_prefix_cache:
            return {}
        bs, tree = self.block_size, self.tree
        matches = {
            i: tree.match(self.namespace_key(adm.namespace), adm.prompt[: (len(adm.prompt) - 1) // bs * bs])
            for i, adm in enumerate(admits)
        }
        if self._hits_may_wait:
            matches = {i: self._ready_hits(hits) for i, hits in matches.items()}
        return matches

    def _admit(self, admits, matches: dict, protected: PendingHits, out: StepOutcome, sched_ids, sched):
        """Admit phase: each admission in order takes its hits and new blocks, or is rejected and leaves no trace.

        A ``prefill_done`` admission publishes its full blocks before the next
        admission matches again, so later prompts of the step hit them.
        Admitted rows go to ``sched_ids`` and ``sched``, rejections to
        ``out.rejected``.
        """
        bs = self.block_size
        if not any(adm.prefill_done for adm in admits):
            self._evict_for_admissions(admits, matches, protected, out)
        pending = PendingPublish()
        published_here = False  # a prefill_done admission of this step has published blocks
        for i, adm in enumerate(admits):
            length = len(adm.prompt)
            hits = matches.get(i, [])
            if out.promotes and hits:  # an earlier admission of the step may have promoted some of them
                hits = self._rematch(i, adm, protected, out)
            if published_here and len(hits) < (length - 1) // bs:
                hits = self._match_more(adm, hits, pending, out)
            total = -(-length // bs)
            need = total - self._split_hits(hits)
            reserve = admission_reserve(length, adm.max_new_tokens, bs)
            err = self._make_room(need + reserve, total + reserve, protected, out)
            protected.discard(i)
            if err is not None:
                out.rejected[adm.seq_id] = err
                continue
            seq = self._add_sequence(adm, hits, need, reserve, out)
            cached = seq.num_cached_tokens
            out.cached_tokens[adm.seq_id] = cached
            sched_ids.append(adm.seq_id)
            sched.append((seq.row, cached, length - cached))
            if adm.prefill_done:
                self.tables.num_computed[seq.row] = length
                self._queue_publish(seq, pending)
                published_here = published_here or bool(pending.entries)
        if pending.entries:
            self._publish(pending, out)

    def _match_more(self, adm, hits: list[int], pending: PendingPublish, out: StepOutcome):
        """Publish the step's queued blocks, then extend ``hits`` below its last block; the longer hit list.

        Earlier admissions of this step (``prefill_done``) publish first; their
        new blocks may extend this match (they are referenced, so they need no
        protection).
        """
        if pending.entries:
            self._publish(pending, out)
        bs = self.block_size
        rest = adm.prompt[len(hits) * bs : (len(adm.prompt) - 1) // bs * bs]
        more = self.tree.match(self.namespace_key(adm.namespace), rest, hits[-1] if hits else None)
        return self._ready_hits(hits + more, out) if more else hits

    def _rematch(self, i: int, adm, protected: PendingHits, out: StepOutcome) -> list[int]:
        """Admission ``i``'s hits matched again (promotions moved host blocks to device ids), now protected.

        The blocks an earlier admission of the step promoted are hits too:
        unready until the step's copies ran, which the step's runner waits for.
        """
        bs = self.block_size
        hits = self.tree.match(self.namespace_key(adm.namespace), adm.prompt[: (len(adm.prompt) - 1) // bs * bs])
        hits = self._ready_hits(hits, out)
        protected.discard(i)
        protected.add(i, hits)
        return hits

    def _add_sequence(self, adm, hits: list[int], need: int, reserve: int, out: StepOutcome) -> Sequence:
        """Create the admitted sequence: reference ``hits``, allocate ``need`` blocks, earmark ``reserve``, count it.

        ``need`` counts the host hits: each takes a new device block, into
        which it is promoted (:meth:`~akv.core.tiers.ShardTiers._promote`).
        """
        pool, tables, counters = self.pool, self.tables, self.counters
        length = len(adm.prompt)
        seq = Sequence(adm.seq_id, adm.namespace, length, tables.new_row())
        row = seq.row
        on_device = self._split_hits(hits)
        device_hits = hits if on_device == len(hits) else hits[:on_device]
        pool.incref(device_hits, hit=True, distinct=True)
        seq.block_ids.extend(device_hits)
        new = pool.allocate(need)
        if on_device < len(hits):  # host hits: the first new blocks take them (promotion)
            self._promote(hits[on_device:], new[: len(hits) - on_device], out)
            if not adm.resumed:
                counters.host_hit_tokens += (len(hits) - on_device) * self.block_size
        seq.block_ids.extend(new)
        self.table_refs += on_device + need
        counters.blocks_allocated += need
        cached = len(hits) * self.block_size
        self._write_tokens(row, on_device * self.block_size, adm.prompt[on_device * self.block_size :])
        tables.num_tokens[row] = length
        tables.num_computed[row] = cached
        if adm.max_new_tokens is not None:
            tables.max_tokens[row] = length + adm.max_new_tokens
            self.num_reserved += reserve
            self.num_reserved_seqs += 1
        seq.num_published = len(hits)
        seq.num_cached_tokens = cached
        self.sequences[adm.seq_id] = seq
        self.rows[adm.seq_id] = row
        counters.sequences_added += 1
        if adm.resumed:
            counters.sequences_resumed += 1
            counters.resumed_prompt_tokens += length
            counters.resumed_cached_tokens += cached
        else:
            counters.prompt_tokens += length
            counters.cached_tokens += cached
        return seq
