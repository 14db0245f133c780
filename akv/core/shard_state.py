"""The synchronous heart of a pool shard: sequences, block tables, pool, prefix tree.

:class:`ShardState` owns one shard's :class:`~akv.core.radix_tree.RadixTree`
and calls it directly: the pool shard actor runs one method per message, and
tests run the same methods without any actor. No asyncio or torch is
imported here.

Every public mutation validates its whole input before changing anything, so
an error leaves the shard exactly as it was.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from akv.core.block_pool import CACHED, BlockPool
from akv.core.block_table import BlockTables
from akv.core.radix_tree import RadixTree, block_keys
from akv.core.reservation import admission_reserve, fork_earmarks, reserved_blocks, row_reserved
from akv.core.sequence import Sequence
from akv.core.step import StepOutcome, StepRequest, empty_metadata
from akv.errors import DuplicateSequence, InvalidInput, PoolExhausted, RequestTooLarge, UnknownSequence

_NO_KEYS: tuple[bytes, ...] = ()  # Sequence.prompt_keys once every prompt block is published


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


class PendingPublish:
    """Committed full blocks queued for the prefix tree, inserted together by ``ShardState._publish``.

    Attributes:
        entries: ``(sequence, first block index, block ids)`` per queued
            insert, in queue order: the multi-block inserts, then the
            one-block ones.
        inserts: ``(namespace key, parent block id | None, keys, block ids)``
            arguments of :meth:`~akv.core.radix_tree.RadixTree.insert`, one
            per multi-block entry.
        singles: ``(namespace key, parent block id | None, key, block id)``
            items of one :meth:`~akv.core.radix_tree.RadixTree.insert_blocks`
            call, one per one-block entry.
    """

    __slots__ = ("entries", "inserts", "singles")

    def __init__(self) -> None:
        self.entries: list = []
        self.inserts: list = []
        self.singles: list = []

    def clear(self) -> None:
        """Forget the queued inserts (they were applied)."""
        self.entries.clear()
        self.inserts.clear()
        self.singles.clear()


@dataclass(kw_only=True, slots=True)
class ShardCounters:
    """Monotonic counters of one shard (units: blocks, tokens, sequences, events)."""

    blocks_allocated: int = 0
    blocks_evicted: int = 0
    eviction_batches: int = 0
    cow_copies: int = 0
    forks: int = 0
    sequences_added: int = 0
    sequences_freed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pool_exhausted: int = 0
    eviction_refusals: int = 0
    preemptions: int = 0
    sequences_resumed: int = 0
    resumed_prompt_tokens: int = 0
    resumed_cached_tokens: int = 0


@dataclass(slots=True)
class Checked:
    """What :meth:`ShardState.validate` found, reused by :meth:`ShardState.step`.

    Attributes:
        commit_rows: intp ``(len(commits),)`` rows of the committed sequences, in order.
        commit_counts: int64 ``(len(commits),)`` tokens committed.
        single_appends: Every append is one ``int`` token (a decode batch).
    """

    commit_rows: np.ndarray | None = None
    commit_counts: np.ndarray | None = None
    single_appends: bool = False


class ShardState:
    """Sequences and blocks of one shard.

    Token ids are stored per block, beside the K/V they stand for:
    ``block_tokens[b - first_block_id]`` holds the ``block_size`` token ids
    of block ``b``. A sequence's history is its blocks' rows read in table
    order, so a fork shares tokens exactly as it shares blocks,
    copy-on-write copies a block's tokens with its K/V, and a decode step
    writes a batch's new tokens with one scatter through the slot mapping.

    Args:
        shard_index: Index of this shard; part of every prefix-cache namespace
            key, since a block can only serve sequences of its own partition.
        block_ids: Global block ids owned by the shard.
        block_size: Tokens per block.
        enable_prefix_cache: Publish committed full blocks and match prompts.
        eviction_policy: Eviction policy name, passed to :class:`BlockPool`.
        tree: The prefix tree of this shard's blocks (default: a new, empty
            :class:`RadixTree`); the shard owns it from now on.
    """

    def __init__(
        self,
        shard_index: int,
        block_ids: range,
        block_size: int,
        *,
        enable_prefix_cache: bool = True,
        eviction_policy: str = "lru",
        tree: RadixTree | None = None,
    ) -> None:
        self.shard_index = shard_index
        #: The prefix cache index of this shard's published blocks.
        self.tree = RadixTree() if tree is None else tree
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = BlockPool(block_ids, policy=eviction_policy)
        self.tables = BlockTables()
        self.sequences: dict[Hashable, Sequence] = {}
        #: Sequence id -> its row in :attr:`tables` (for vectorized batch lookups).
        self.rows: dict[Hashable, int] = {}
        #: int32 ``(num_blocks, block_size)``: the token ids whose K/V each block holds.
        self.block_tokens = np.zeros((len(block_ids), block_size), dtype=np.int32)
        self._flat_tokens = self.block_tokens.reshape(-1)
        #: Blocks a decode batch lacked when :meth:`_decode` last returned None.
        self._decode_shortfall = 0
        self._first_slot = block_ids.start * block_size
        self.counters = ShardCounters()
        #: Block-table references held by live sequences (equals pool.total_refs).
        self.table_refs = 0
        #: Free blocks earmarked by reservations (see :mod:`akv.core.reservation`); <= pool.num_free.
        self.num_reserved = 0
        #: Live sequences admitted with a reservation (0: no reservation code runs).
        self.num_reserved_seqs = 0

    # ------------------------------------------------------------------ queries
    def namespace_key(self, namespace: Hashable) -> tuple:
        """Tree namespace key of ``namespace`` in this shard."""
        return (self.shard_index, namespace)

    def get(self, seq_id: Hashable) -> Sequence:
        """The live sequence ``seq_id``.

        Raises:
            UnknownSequence: Not live in this shard.
        """
        try:
            return self.sequences[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def token_ids(self, seq: Sequence) -> np.ndarray:
        """Token history of ``seq``: int32 ``(num_tokens,)``, a new array."""
        ids = seq.block_ids.view().astype(np.intp) - self.pool.first_block_id
        return self.block_tokens[ids].reshape(-1)[: seq.num_tokens]

    def usage(self) -> float:
        """Fraction of blocks not free (0.0-1.0)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def lookup(self, namespace: Hashable, prompt: np.ndarray) -> int:
        """Blocks of ``prompt`` an admission in ``namespace`` would hit now (changes nothing).

        Args:
            namespace: Prefix-cache namespace of the prompt.
            prompt: Token ids, int32 ``(num_tokens,)``.

        Returns:
            Leading blocks of the prompt in the prefix cache (the last token
            is never served from the cache, so at most ``(len - 1) // block_size``).
        """
        n = (len(prompt) - 1) // self.block_size if len(prompt) else 0
        return self.tree.lookup(self.namespace_key(namespace), block_keys(prompt, self.block_size, n))

    # ---------------------------------------------------------------- the step
    def step(self, req: StepRequest) -> StepOutcome:
        """Apply one scheduler step (see :class:`~akv.core.step.StepRequest` for the order).

        Appends and admissions are each all-or-nothing: one that cannot get its
        blocks (even after evicting cached blocks) is listed in
        ``outcome.rejected`` and leaves no trace. Everything else is validated
        up front.

        A batch of one-token appends (a decode step) whose new blocks and
        copy-on-write copies fit in the free blocks takes a vectorized path:
        a few numpy operations over the batch's rows, no per-sequence Python
        work except for the ~1/block_size rows that start a block.

        Raises:
            UnknownSequence: A commit, fork or append names no live sequence.
            DuplicateSequence: An admission or fork child reuses a live id.
            InvalidInput: Bad commit counts or empty token arrays.
            PoolExhausted: A fork of a reserved sequence cannot earmark its
                copy-on-write block (:meth:`fork_room`); nothing is applied.
        """
        checked = self.validate(req)
        bs, seqs, pool, tables = self.block_size, self.sequences, self.pool, self.tables
        out = StepOutcome()
        # Made before anything is applied: frees only add room, commits take none.
        earmarks = (self.fork_room(req.forks)) if req.forks and self.num_reserved_seqs else []
        if earmarks:
            out.evicted_blocks += self._room_for_earmarks(len(earmarks))

        if req.frees:
            self._free(req, out)
            if req.frees_only:
                if req.want_metadata:
                    self._fill_metadata(out, None, [])
                return out

        publishing = PendingPublish()
        if req.commits:
            self._commit(req.commits, checked, publishing)

        for parent_id, child_ids in req.forks:
            parent = seqs[parent_id]
            for child_id in child_ids:
                child = parent.fork(child_id, tables.new_row())
                ids = child.block_ids.view()
                pool.incref(ids, distinct=True)
                self.table_refs += len(ids)
                seqs[child_id] = child
                self.rows[child_id] = child.row
                self.counters.forks += 1
        if earmarks:
            tables.cow_reserved[earmarks] = True
            self.num_reserved += len(earmarks)

        # Batch the matches of ordinary admissions with the inserts in one tree message.
        bs_keys = (
            [block_keys(adm.prompt, bs, len(adm.prompt) // bs) for adm in req.admits]
            if self.enable_prefix_cache
            else []
        )
        matches: dict[int, list[int]] = {}
        if publishing.entries:
            self._publish(publishing)
        if self.enable_prefix_cache:
            for i, adm in enumerate(req.admits):
                n = (len(adm.prompt) - 1) // bs
                matches[i] = self.tree.match(self.namespace_key(adm.namespace), bs_keys[i][:n])
        # Prefix hits of admissions not processed yet must not be evicted to make
        # room for anything else in this step.
        protected = PendingHits()
        for i, hits in matches.items():
            protected.add(i, hits)

        # Scheduled rows, in metadata order: (seq ids, rows, first new position, new tokens).
        decoded = self._decode(req.appends, out, req.commits, checked.commit_rows) if checked.single_appends else None
        if decoded is None and checked.single_appends:
            # The batch's new blocks do not fit in the free blocks: evict the
            # shortfall in one pass (instead of per sequence on the general
            # path below) and take the vectorized path after all.
            short = self._decode_shortfall
            if short <= self._evictable(protected.blocks()):
                out.evicted_blocks += self._evict(short, protected.blocks())
                decoded = self._decode(req.appends, out, req.commits, checked.commit_rows)
        sched_ids: list = []
        sched: list[tuple[int, int, int]] = []
        if req.appends and decoded is None:
            for seq_id, tokens in req.appends.items():
                seq = seqs[seq_id]
                blocks = seq.block_ids
                row = blocks.row
                start = int(tables.num_tokens[row])
                single = type(tokens) is int
                k = 1 if single else len(tokens)
                tail = start % bs != 0 and pool.refcount(blocks.last()) > 1
                total = (start + k + bs - 1) // bs
                need = total - len(blocks) + tail
                own = row_reserved(tables, row, bs) if self.num_reserved_seqs else 0
                if need > pool.num_free - self.num_reserved + own or total > pool.num_blocks:
                    err = self._make_room(need, total, protected, out, own)
                    if err is not None:
                        out.rejected[seq_id] = err
                        continue
                if tail:
                    self._copy_on_write(seq_id, row, out)
                    need -= 1
                if need:
                    blocks.extend(pool.allocate(need))
                    self.table_refs += need
                    self.counters.blocks_allocated += need
                tables.shared_tail[row] = False
                if own:
                    tables.cow_reserved[row] = False
                    self.num_reserved += row_reserved(tables, row, bs) - own
                self._write_tokens(row, start, np.array([tokens], dtype=np.int32) if single else tokens)
                tables.num_tokens[row] = start + k
                sched_ids.append(seq_id)
                sched.append((row, start, k))

        if req.admits and not any(adm.prefill_done for adm in req.admits):
            out.evicted_blocks += self._evict_for_admissions(req.admits, matches, protected)
        pending = PendingPublish()
        published_here = False  # a prefill_done admission of this step has published blocks
        for i, adm in enumerate(req.admits):
            prompt = adm.prompt
            length = len(prompt)
            max_hit_blocks = (length - 1) // bs
            ns = self.namespace_key(adm.namespace)
            hits = matches.get(i, [])
            if published_here and len(hits) < max_hit_blocks:
                # Earlier admissions of this step (prefill_done) publish first; their new
                # blocks may extend this match (they are referenced, so need no protection).
                if pending.entries:
                    self._publish(pending)
                more = self.tree.match(ns, bs_keys[i][len(hits) : max_hit_blocks], hits[-1] if hits else None)
                if more:
                    hits = hits + more
            total = -(-length // bs)
            need = total - len(hits)
            reserve = admission_reserve(length, adm.max_new_tokens, bs)
            err = self._make_room(need + reserve, total + reserve, protected, out)
            protected.discard(i)
            if err is not None:
                out.rejected[adm.seq_id] = err
                continue
            seq = Sequence(adm.seq_id, adm.namespace, length, tables.new_row())
            row = seq.row
            if self.enable_prefix_cache:
                seq.prompt_keys = bs_keys[i]
            pool.incref(hits, hit=True, distinct=True)
            seq.block_ids.extend(hits)
            seq.block_ids.extend(pool.allocate(need))
            self.table_refs += len(hits) + need
            self.counters.blocks_allocated += need
            cached = len(hits) * bs
            self._write_tokens(row, cached, prompt[cached:])
            tables.num_tokens[row] = length
            tables.num_computed[row] = cached
            if adm.max_new_tokens is not None:
                tables.max_tokens[row] = length + adm.max_new_tokens
                self.num_reserved += reserve
                self.num_reserved_seqs += 1
            seq.num_published = len(hits)
            seq.num_cached_tokens = cached
            seqs[adm.seq_id] = seq
            self.rows[adm.seq_id] = row
            out.cached_tokens[adm.seq_id] = cached
            self.counters.sequences_added += 1
            if adm.resumed:
                self.counters.sequences_resumed += 1
                self.counters.resumed_prompt_tokens += length
                self.counters.resumed_cached_tokens += cached
            else:
                self.counters.prompt_tokens += length
                self.counters.cached_tokens += cached
            sched_ids.append(adm.seq_id)
            sched.append((row, cached, length - cached))
            if adm.prefill_done:
                tables.num_computed[row] = length
                self._queue_publish(seq, pending)
                published_here = published_here or bool(pending.entries)
        if pending.entries:
            self._publish(pending)

        if decoded is not None:
            out.seq_ids = decoded[0] + sched_ids
        else:
            out.seq_ids = sched_ids
        if req.want_metadata:
            self._fill_metadata(out, decoded, sched)
        return out

    def evict(self, max_blocks: int) -> int:
        """Evict up to ``max_blocks`` cached blocks, in the eviction policy's order (leaves only).

        Returns:
            Blocks evicted (removed from the prefix cache, now free).
        """
        n = self._evict(max_blocks, frozenset())
        return n

    def release_copy_pins(self, block_ids: list[int]) -> None:
        """A copy batch finished: its source and destination blocks may become cached or free."""
        self.pool.unpin_copied(block_ids)

    # ------------------------------------------------------------- internals
    def validate(self, req: StepRequest) -> Checked:
        """Raise the input error :meth:`step` would raise for ``req``; change nothing.

        The one shortage :meth:`step` raises, a fork's earmark, needs the tree:
        :meth:`fork_room` checks it.

        The common case (every id known, every count an int) is checked with
        set and array operations; any problem reruns the per-item checks to
        report the first offending item in request order.

        Returns:
            What the checks found that :meth:`step` reuses.

        Raises:
            UnknownSequence, DuplicateSequence, InvalidInput: As :meth:`step`.
        """
        if req.frees_only:
            return Checked()  # unknown ids are no-ops
        seqs = self.sequences
        freed = {s for s in req.frees if s in seqs}
        checked = Checked()
        if req.commits:
            found = self._commits_ok(req.commits, freed)
            if found is None:
                self._validate_commits(req.commits, freed)
                found = self._commit_arrays(req.commits)
            checked.commit_rows, checked.commit_counts = found
        created: set = set()

        def live(seq_id: Hashable) -> bool:
            return seq_id in seqs and seq_id not in freed

        for parent_id, child_ids in req.forks:
            if not live(parent_id) and parent_id not in created:
                raise UnknownSequence(parent_id)
            for child_id in child_ids:
                if live(child_id) or child_id in created:
                    raise DuplicateSequence(child_id)
                created.add(child_id)
        for parent_id, _ in req.forks:
            if parent_id in created and parent_id not in seqs:
                raise InvalidInput(f"fork of {parent_id!r}, a child created in the same step; fork it next step")
        appends = req.appends
        if appends:
            keys = appends.keys()
            unknown = ((keys - seqs.keys()) | (keys & freed)) - created
            checked.single_appends = single = set(map(type, appends.values())) == {int}
            if unknown or not single:
                for seq_id, tokens in appends.items():
                    if (seq_id not in seqs or seq_id in freed) and seq_id not in created:
                        raise UnknownSequence(seq_id)
                    if type(tokens) is not int and len(tokens) == 0:
                        raise InvalidInput(f"append of no tokens to sequence {seq_id!r}")
        for adm in req.admits:
            if live(adm.seq_id) or adm.seq_id in created:
                raise DuplicateSequence(adm.seq_id)
            created.add(adm.seq_id)
            if len(adm.prompt) == 0:
                raise InvalidInput(f"empty prompt for sequence {adm.seq_id!r}")
        return checked

    def _commits_ok(self, commits, freed: set) -> tuple[np.ndarray, np.ndarray] | None:
        """Vectorized commit check: all ids live, all counts ints within range; their rows and counts, or None."""
        if (freed and not freed.isdisjoint(commits)) or set(map(type, commits.values())) != {int}:
            return None
        try:
            rows, add = self._commit_arrays(commits)
        except (KeyError, OverflowError):  # an unknown id, a count beyond int64: the per-item check words the error
            return None
        t = self.tables
        if (add >= 0).all() and (t.num_computed[rows] + add <= t.num_tokens[rows]).all():
            return rows, add
        return None

    def _commit_arrays(self, commits) -> tuple[np.ndarray, np.ndarray]:
        """Rows (intp) and token counts (int64) of valid ``commits``, in their order."""
        n = len(commits)
        rows = np.fromiter(map(self.rows.__getitem__, commits), dtype=np.intp, count=n)
        return rows, np.fromiter(commits.values(), dtype=np.int64, count=n)

    def _validate_commits(self, commits, freed: set) -> None:
        seqs = self.sequences
        for seq_id, n in commits.items():
            seq = seqs.get(seq_id)
            if seq is None or seq_id in freed:
                raise UnknownSequence(seq_id)
            if type(n) is not int and (not isinstance(n, np.integer) or isinstance(n, bool)):
                raise InvalidInput(f"commit of {n!r} tokens for sequence {seq_id!r}: need an int >= 0")
            computed, tokens = seq.num_computed, seq.num_tokens
            if n < 0 or computed + n > tokens:
                raise InvalidInput(
                    f"commit of {n} tokens for sequence {seq_id!r}: need 0 <= n <= "
                    f"{tokens - computed} ({computed} of {tokens} tokens computed)"
                )

    def _commit(self, commits, checked: Checked, publishing: PendingPublish) -> None:
        """Add committed token counts (vectorized); queue the publishing of newly full blocks."""
        ids = list(commits)
        rows, add = checked.commit_rows, checked.commit_counts
        computed = self.tables.num_computed
        old = computed[rows]
        new = old + add
        computed[rows] = new
        if not self.enable_prefix_cache:
            return
        bs, seqs = self.block_size, self.sequences
        single: list[tuple[Sequence, int]] = []  # (sequence, index of its one newly full block)
        single_rows: list[int] = []
        for i in np.flatnonzero(new // bs > old // bs).tolist():
            seq = seqs[ids[i]]
            full = int(new[i]) // bs
            if seq.publish_stopped or full <= seq.num_published:
                continue
            if full == seq.num_published + 1:  # the decode case: one block just filled
                single.append((seq, full - 1))
                single_rows.append(int(rows[i]))
            else:
                self._queue_publish(seq, publishing)
        if single:
            self._queue_publish_single(single, single_rows, publishing)

    def _queue_publish_single(self, single: list, rows: list[int], publishing: PendingPublish) -> None:
        """Queue the publishing of each sequence's one newly full block: one tree call, keys cut from one gather."""
        tables = self.tables
        cols = np.fromiter((c for _, c in single), dtype=np.intp, count=len(single))
        r = np.array(rows, dtype=np.intp)
        blocks = tables.array[r, cols]
        parents = tables.array[r, np.maximum(cols - 1, 0)].tolist()
        raw = self.block_tokens[blocks.astype(np.intp) - self.pool.first_block_id].tobytes()
        width = 4 * self.block_size
        shard = self.shard_index
        items, entries = publishing.singles, publishing.entries
        for j, ((seq, col), block) in enumerate(zip(single, blocks.tolist())):
            items.append(((shard, seq.namespace), parents[j] if col else None, raw[j * width : (j + 1) * width], block))
            entries.append((seq, col, [block]))

    def _decode(
        self, appends, out: StepOutcome, commits=None, commit_rows: np.ndarray | None = None
    ) -> tuple[list, np.ndarray, np.ndarray, np.ndarray] | None:
        """The vectorized decode path: one ``int`` token for each sequence of ``appends``.

        Returns ``(seq_ids, rows, positions, slots)`` (int arrays of shape
        ``(batch,)``), or None without changing anything when the batch's new
        blocks and copies do not fit in the free blocks (the shortfall is left
        in ``_decode_shortfall``; the step then evicts it in one pass, or the
        general path evicts or rejects per sequence).

        ``commits`` and ``commit_rows`` (the step's validated commits and their
        rows) save looking the rows up again when the appends start with the
        same sequences in the same order, as a decode loop's do.
        """
        values = appends.values()
        bs, pool, tables = self.block_size, self.pool, self.tables
        n = len(appends)
        ids = list(appends)
        k = len(commits) if commit_rows is not None else 0
        if k and k <= n and ids[:k] == list(commits):  # a decode loop commits and appends the same rows
            rest = np.fromiter(map(self.rows.__getitem__, ids[k:]), dtype=np.intp, count=n - k)
            rows = commit_rows if k == n else np.concatenate((commit_rows, rest))
        else:
            rows = np.fromiter(map(self.rows.__getitem__, ids), dtype=np.intp, count=n)
        pos = tables.num_tokens[rows]
        new_block = pos % bs == 0
        maybe_shared = np.flatnonzero(tables.shared_tail[rows] & ~new_block).tolist()
        num_new = int(np.count_nonzero(new_block))
        released = 0  # earmarked blocks this batch takes or gives back
        if self.num_reserved_seqs:
            # A row allocates at most one block (a new block or a copy); a row
            # with an earmark takes it from there, the others from the free
            # blocks no reservation holds. Afterwards every row's copy earmark
            # is gone (used or, its tail written in place, given back) and each
            # new block of a row with earmarked blocks came out of them.
            ahead = np.maximum(-(-tables.max_tokens[rows] // bs) - tables.lens[rows], 0) > 0
            cow = tables.cow_reserved[rows]
            released = int(np.count_nonzero(new_block & ahead)) + int(np.count_nonzero(cow))
            short = self._decode_short(
                rows,
                [i for i in maybe_shared if not cow[i]],
                int(np.count_nonzero(new_block & ~ahead)),
                pool.num_free - self.num_reserved,
            )
        else:
            short = self._decode_short(rows, maybe_shared, num_new, pool.num_free)
        if short:
            self._decode_shortfall = short
            return None
        for i in maybe_shared:  # in order: the last holder of a shared tail writes in place
            r = int(rows[i])
            if pool.refcount(tables.last_block(r)) > 1:
                self._copy_on_write(ids[i], r, out)
        if num_new:
            grow = rows[new_block]
            cols = pos[new_block] // bs
            tables.ensure_cols(int(cols[-1] if num_new == 1 else cols.max()) + 1)
            tables.array[grow, cols] = pool.allocate(num_new)
            tables.lens[grow] += 1
            self.table_refs += num_new
            self.counters.blocks_allocated += num_new
        tables.shared_tail[rows] = False
        if released:
            tables.cow_reserved[rows] = False
            self.num_reserved -= released
        slots = tables.array[rows, pos // bs].astype(np.int64) * bs + pos % bs
        self._flat_tokens[slots - self._first_slot] = np.fromiter(values, dtype=np.int64, count=n)
        tables.num_tokens[rows] = pos + 1
        return ids, rows, pos, slots

    def _decode_short(self, rows: np.ndarray, shared: list[int], num_new: int, free: int) -> int:
        """Blocks a decode batch lacks: ``num_new`` new blocks plus the copies of ``shared`` rows, against ``free``."""
        if num_new + len(shared) <= free:  # at most one copy per flagged row
            return 0
        # Exact copies: rows copy in order while their tail is still shared,
        # so a tail held R times by k rows of the batch is copied min(k, R - 1) times.
        pool, tables = self.pool, self.tables
        holders: dict[int, int] = {}
        for i in shared:
            b = tables.last_block(int(rows[i]))
            holders[b] = holders.get(b, 0) + 1
        copies = sum(min(k, pool.refcount(b) - 1) for b, k in holders.items())
        return max(0, num_new + copies - free)

    def _copy_on_write(self, seq_id: Hashable, row: int, out: StepOutcome) -> None:
        """Give ``row`` a private copy of its shared partial tail block (K/V copy queued in ``out``)."""
        pool, tables = self.pool, self.tables
        col = int(tables.lens[row]) - 1
        old = int(tables.array[row, col])
        (new,) = pool.allocate(1)
        tables.array[row, col] = new
        pool.pin_for_copy((old, new))  # neither may be reused before the copy ran
        pool.decref((old,))
        base = pool.first_block_id
        self.block_tokens[new - base] = self.block_tokens[old - base]
        out.copies.append((old, new))
        out.copy_seq_ids.append(seq_id)
        self.counters.cow_copies += 1
        self.counters.blocks_allocated += 1

    def _write_tokens(self, row: int, start: int, tokens: np.ndarray) -> None:
        """Store ``tokens`` at positions ``start..`` of ``row`` (its blocks must exist)."""
        k = len(tokens)
        if not k:
            return
        bs = self.block_size
        if start % bs == 0:  # an admission after its prefix hits: whole blocks, then a partial one
            full, rem = divmod(k, bs)
            first = start // bs
            offsets = self.tables.array[row, first : first + full + (rem > 0)] - self.pool.first_block_id
            if full:
                self.block_tokens[offsets[:full]] = tokens[: full * bs].reshape(full, bs)
            if rem:
                self.block_tokens[offsets[full], :rem] = tokens[full * bs :]
            return
        pos = np.arange(start, start + k)
        slots = self.tables.array[row, pos // bs].astype(np.int64) * bs + pos % bs
        self._flat_tokens[slots - self._first_slot] = tokens

    def _free(self, req: StepRequest, out: StepOutcome) -> None:
        """Free the step's live sequences (unknown ids are ignored): one decref for all their blocks.

        Each sequence releases its blocks deepest first, so on ties the deepest
        block is evicted first; sequences release in request order.
        """
        seqs, rows = self.sequences, self.rows
        freed_rows = []
        for seq_id in req.frees:
            seq = seqs.pop(seq_id, None)
            if seq is None:
                continue
            freed_rows.append(rows.pop(seq_id))
            out.freed.append(seq_id)
            if seq_id in req.preempted:
                self.counters.preemptions += 1
        if not freed_rows:
            return
        if self.num_reserved_seqs:
            r = np.array(freed_rows, dtype=np.intp)
            self.num_reserved -= int(reserved_blocks(self.tables, r, self.block_size).sum())
            self.num_reserved_seqs -= int(np.count_nonzero(self.tables.max_tokens[r]))
        ids = self.tables.release_many(freed_rows)
        self.pool.decref(ids, distinct=len(freed_rows) == 1)
        self.table_refs -= len(ids)
        self.counters.sequences_freed += len(freed_rows)

    def _queue_publish(self, seq: Sequence, publishing: PendingPublish) -> None:
        """Queue the publishing of ``seq``'s committed full blocks not published yet (one tree insert)."""
        if not self.enable_prefix_cache or seq.publish_stopped:
            return
        bs = self.block_size
        full = min(seq.num_computed // bs, len(seq.block_ids))
        start = seq.num_published
        if full <= start:
            return
        parent = seq.block_ids[start - 1] if start else None
        view = seq.block_ids.view()[start:full]
        if full <= len(seq.prompt_keys):
            keys = seq.prompt_keys[start:full]
        else:
            tokens = self.block_tokens[view.astype(np.intp) - self.pool.first_block_id].reshape(-1)
            keys = block_keys(tokens, bs, full - start)
        ids = view.tolist()
        publishing.inserts.append((self.namespace_key(seq.namespace), parent, keys, ids))
        publishing.entries.append((seq, start, ids))

    def _publish(self, publishing: PendingPublish) -> None:
        """Insert the queued blocks into the tree, in queue order; record how far each sequence got; clear the queue."""
        tree = self.tree
        results = [tree.insert(ns, parent, keys, ids) for ns, parent, keys, ids in publishing.inserts]
        if publishing.singles:
            results.extend(tree.insert_blocks(publishing.singles))
        marked: list[int] = []
        for (seq, start, ids), done in zip(publishing.entries, results):
            if done:
                marked.extend(ids[:done])
            seq.num_published = start + done
            if done < len(ids):
                seq.publish_stopped = True
            if seq.prompt_keys and (seq.publish_stopped or seq.num_published >= len(seq.prompt_keys)):
                # Every prompt block is published (or never will be): drop the keys
                # now, while they are hot, rather than one object per block at free.
                seq.prompt_keys = _NO_KEYS
        publishing.clear()
        if marked:
            self.pool.mark_published(marked)

    def _evictable(self, protected: dict[int, int]) -> int:
        """Cached blocks eviction may take now (the ``protected`` prefix hits excluded)."""
        pool = self.pool
        return pool.num_cached - sum(1 for b in protected if pool.state(b) == CACHED)

    def _make_room(
        self, need: int, total: int, protected: PendingHits, out: StepOutcome, own: int = 0
    ) -> PoolExhausted | RequestTooLarge | None:
        """Ensure ``need`` free blocks for one sequence, evicting if needed; return an error instead if impossible.

        ``total`` is the blocks the sequence will hold in all: more than the
        shard has can never be served (:class:`RequestTooLarge`). ``own`` is
        the blocks earmarked for this sequence: it may take those and the
        free blocks no reservation holds.
        """
        pool = self.pool
        if total > pool.num_blocks:
            return RequestTooLarge(total, pool.num_blocks)
        held = self.num_reserved - own  # earmarked for other sequences
        if need <= pool.num_free - held:
            return None
        evictable = self._evictable(protected.blocks())
        if need > pool.num_free - held + evictable:
            self.counters.pool_exhausted += 1
            return PoolExhausted(need, pool.num_free - held, evictable)
        out.evicted_blocks += self._evict(need - pool.num_free + held, protected.blocks())
        if need > pool.num_free - held:
            # Cached blocks above a published block that a pending copy still
            # pins cannot be evicted (only leaves can) until the copy has run.
            self.counters.pool_exhausted += 1
            return PoolExhausted(need, pool.num_free - held, (self.evictable_now()))
        return None

    def fork_room(self, forks) -> list[int]:
        """Check that the copy-on-write blocks ``forks`` must earmark fit now; return their rows.

        Exact, so that a step validated on every shard (``Validate`` asks
        this too) cannot fail on one shard after another shard applied its
        part: the blocks must be among the unreserved free blocks plus the
        cached blocks an eviction pass can take now (:meth:`evictable_now`).
        Changes nothing but the ``pool_exhausted`` counter.

        Args:
            forks: ``(parent_id, child_ids)`` pairs of validated live parents.

        Returns:
            The parent rows to earmark a block for (see
            :func:`~akv.core.reservation.fork_earmarks`).

        Raises:
            PoolExhausted: They do not fit (the step must be refused whole).
        """
        earmarks = fork_earmarks(self.tables, [self.sequences[p].row for p, _ in forks], self.block_size)
        free = self.pool.num_free - self.num_reserved
        if len(earmarks) > free:
            evictable = self.evictable_now()
            if len(earmarks) > free + evictable:
                self.counters.pool_exhausted += 1
                raise PoolExhausted(len(earmarks), free, evictable)
        return earmarks

    def evictable_now(self) -> int:
        """Cached blocks an eviction pass could take now (reads the tree; changes nothing).

        All cached blocks but those above a published block that only a
        pending copy still holds: the tree evicts only leaves, so they wait
        for the copy. (A referenced block's ancestors are referenced too: the
        same block table holds them.) One tree message, only while such a
        pinned block exists; O(pins + their depth).

        Returns:
            The number of cached blocks (``int``) :meth:`_evict` can reclaim.
        """
        pool = self.pool
        pinned = pool.pinned_published()
        if not pinned:
            return pool.num_cached
        tree = self.tree
        above = {a: None for b in pinned for a in tree.path(b)[:-1]}
        return pool.num_cached - sum(1 for b in above if pool.state(b) == CACHED)

    def _room_for_earmarks(self, num_blocks: int) -> int:
        """Evict until ``num_blocks`` unreserved free blocks exist (:meth:`fork_room` found them); return the blocks evicted."""
        pool = self.pool
        short = num_blocks - (pool.num_free - self.num_reserved)
        evicted = (self._evict(short, frozenset())) if short > 0 else 0
        if num_blocks > pool.num_free - self.num_reserved:
            raise AssertionError(
                f"shard {self.shard_index}: fork earmarks of {num_blocks} blocks checked to fit, "
                f"but {pool.num_free - self.num_reserved} unreserved free after evicting {evicted}"
            )
        return evicted

    def room(self, seq_id: Hashable, num_tokens: int) -> tuple[int, int, int]:
        """Blocks ``seq_id`` needs to append ``num_tokens`` tokens, and the room there is for them (changes nothing).

        Args:
            seq_id: A live sequence.
            num_tokens: Tokens to append (>= 1).

        Returns:
            ``(need, free, evictable)``: new blocks plus a copy-on-write copy
            of a shared partial tail; free blocks this sequence may take (the
            unreserved ones plus its own earmark); cached blocks an eviction
            pass could take now (:meth:`evictable_now`). There is room when
            ``need <= free + evictable``.

        Raises:
            UnknownSequence: Not live.
            RequestTooLarge: The sequence would hold more blocks than the shard.
        """
        seq, pool, bs = self.get(seq_id), self.pool, self.block_size
        row = seq.row
        start = int(self.tables.num_tokens[row])
        total = -(-(start + num_tokens) // bs)
        if total > pool.num_blocks:
            raise RequestTooLarge(total, pool.num_blocks)
        tail = start % bs != 0 and pool.refcount(seq.block_ids.last()) > 1
        own = row_reserved(self.tables, row, bs) if self.num_reserved_seqs else 0
        evictable = self.evictable_now()
        return total - len(seq.block_ids) + tail, pool.num_free - self.num_reserved + own, evictable

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

    def _evict(self, num_blocks: int, protected) -> int:
        """Evict cached leaves in policy order; blocks the tree refuses go to the evict-last end.

        A cached block can stand above a block that is not evictable yet (a
        published block that a pending copy still pins); the tree refuses such
        a non-leaf, and it waits at the evict-last end. The loop ends when
        every cached block was refused once since the last removal.
        """
        evicted = 0
        untried = self.pool.num_cached
        while evicted < num_blocks and untried > 0:
            victims = self.pool.evict_begin(min(num_blocks - evicted, untried), protected)
            if not victims:
                break
            untried -= len(victims)
            removed, refused = self.tree.remove_leaves(victims)
            self.pool.evict_finish(removed)
            evicted += len(removed)
            if refused:
                self.pool.evict_abort(refused, to_mru=True)
                self.counters.eviction_refusals += len(refused)
            if removed:  # a removal can turn a refused parent into a leaf: try everything again
                untried = self.pool.num_cached
        if evicted:
            self.counters.blocks_evicted += evicted
            self.counters.eviction_batches += 1
        return evicted

    def _fill_metadata(self, out: StepOutcome, decoded, sched: list[tuple[int, int, int]]) -> None:
        """Block tables, context lengths and slot mapping of the scheduled rows, vectorized.

        ``slot = block_table[row, pos // block_size] * block_size + pos % block_size``
        for every new token, computed for the whole batch at once (the decode
        path has computed its slots already).
        """
        bs, tables = self.block_size, self.tables
        if decoded is not None and not sched:  # a pure decode step
            _, rows, pos, slots = decoded
            batch = len(rows)
            out.block_tables = tables.gather(rows, int(tables.lens[rows].max()))
            out.context_lens = (pos + 1).astype(np.int32)
            out.query_start_loc = np.arange(batch + 1, dtype=np.int32)
            out.slot_mapping = slots
            return
        extra = np.array(sched, dtype=np.int64).reshape(-1, 3)
        if decoded is not None:
            _, drows, dpos, _ = decoded
            rows = np.concatenate([drows, extra[:, 0]])
            starts = np.concatenate([dpos, extra[:, 1]])
            lens = np.concatenate([np.ones(len(drows), dtype=np.int64), extra[:, 2]])
        else:
            rows, starts, lens = extra[:, 0], extra[:, 1], extra[:, 2]
        batch = len(rows)
        if not batch:
            out.block_tables, out.context_lens, out.query_start_loc, out.slot_mapping = empty_metadata()
            return
        tab = tables.gather(rows, int(tables.lens[rows].max()))
        qsl = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        total = int(qsl[-1])
        if total == batch:  # one new token per row
            row_of, pos = np.arange(batch), starts
        else:
            row_of = np.repeat(np.arange(batch), lens)
            pos = starts[row_of] + (np.arange(total) - qsl[row_of])
        out.block_tables = tab
        out.context_lens = (starts + lens).astype(np.int32)
        out.query_start_loc = qsl.astype(np.int32)
        out.slot_mapping = tab[row_of, pos // bs].astype(np.int64) * bs + pos % bs

    # ------------------------------------------------------------- checking
    def check_counters(self) -> None:
        """Cheap conservation check (O(1)).

        Raises:
            AssertionError: States do not add up to the shard's blocks, or the
                refcount total differs from the block-table references.
        """
        pool = self.pool
        total = pool.num_free + pool.num_active + pool.num_cached + pool.num_in_flight
        if total != pool.num_blocks:
            raise AssertionError(f"shard {self.shard_index}: block states add up to {total}, not {pool.num_blocks}")
        if not 0 <= self.num_reserved <= pool.num_free:
            raise AssertionError(
                f"shard {self.shard_index}: {self.num_reserved} reserved of {pool.num_free} free blocks"
            )
        if pool.total_refs != self.table_refs:
            raise AssertionError(
                f"shard {self.shard_index}: refcounts total {pool.total_refs} but block tables hold {self.table_refs}"
            )

    def _check_reservations(self) -> None:
        """The earmarks of live rows add up to ``num_reserved`` (see :mod:`akv.core.reservation`)."""
        rows = np.array([seq.row for seq in self.sequences.values()], dtype=np.intp)
        reserved = int(reserved_blocks(self.tables, rows, self.block_size).sum())
        if reserved != self.num_reserved:
            raise AssertionError(f"live rows earmark {reserved} blocks but num_reserved is {self.num_reserved}")
        seqs = int(np.count_nonzero(self.tables.max_tokens[rows]))
        if seqs != self.num_reserved_seqs:
            raise AssertionError(
                f"{seqs} live rows have a reservation but num_reserved_seqs is {self.num_reserved_seqs}"
            )

    def check(self) -> None:
        """Full consistency check of the shard and its tree (O(blocks + tokens)).

        Exactly the blocks marked published are in the prefix tree.

        Raises:
            AssertionError: Naming the first inconsistency found.
        """
        self.check_counters()
        self.pool.check()
        self.tree.check()
        bs = self.block_size
        refs: dict[int, int] = {}
        if self.rows != {sid: seq.row for sid, seq in self.sequences.items()}:
            raise AssertionError("the id -> row map disagrees with the live sequences")
        for seq in self.sequences.values():
            if len(seq.block_ids) != -(-seq.num_tokens // bs):
                raise AssertionError(
                    f"sequence {seq.seq_id!r}: {len(seq.block_ids)} blocks for {seq.num_tokens} tokens"
                )
            for b in seq.block_ids.tolist():
                refs[b] = refs.get(b, 0) + 1
        self._check_reservations()
        for b, r in refs.items():
            if self.pool.refcount(b) != r:
                raise AssertionError(f"block {b}: refcount {self.pool.refcount(b)} but {r} block-table references")
        in_tree = self.tree.block_ids()
        for b in in_tree:
            if not self.pool.owns(b):
                raise AssertionError(f"block {b}: in the prefix cache of shard {self.shard_index} but not its own")
            if not self.pool.is_published(b):
                raise AssertionError(f"block {b}: in the prefix cache but not marked published")
        published = self.pool.num_published
        if published != len(in_tree):
            raise AssertionError(f"{published} blocks marked published but {len(in_tree)} in the prefix cache")
