"""Input validation and consistency checks of a shard (part of :class:`~akv.core.shard_state.ShardState`).

:meth:`ShardChecks.validate` raises the input error a step would raise before
anything changes; :meth:`ShardChecks.check_counters` and :meth:`ShardChecks.check`
assert the shard's invariants (blocks conserved, refcounts equal the block-table
references, reservations add up, exactly the published blocks in the tree).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from akv.core.reservation import reserved_blocks
from akv.core.step import StepRequest
from akv.errors import DuplicateSequence, InvalidInput, UnknownSequence


@dataclass(slots=True)
class Checked:
    """What :meth:`ShardState.validate` found, reused by :meth:`ShardState.step`.

    Attributes:
        commit_rows: intp ``(len(commits),)`` rows of the committed sequences, in order.
        commit_counts: int64 ``(len(commits),)`` tokens committed.
        commit_totals: int64 ``(len(commits),)`` each row's committed tokens
            once the step's commits are applied (the validation computed them).
        single_appends: Every append is one ``int`` token (a decode batch).
    """

    commit_rows: np.ndarray | None = None
    commit_counts: np.ndarray | None = None
    commit_totals: np.ndarray | None = None
    single_appends: bool = False


class ShardChecks:
    """Validation and invariant checks; a mixin of :class:`~akv.core.shard_state.ShardState` (uses its attributes)."""

    __slots__ = ()

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
        freed = {s for s in req.frees if s in seqs} if req.frees else set()
        checked = Checked()
        if req.commits:
            found = self._commits_ok(req.commits, freed)
            if found is None:
                self._validate_commits(req.commits, freed)
                rows, add = self._commit_arrays(req.commits)
                found = rows, add, self.tables.num_computed[rows] + add
            checked.commit_rows, checked.commit_counts, checked.commit_totals = found
        created: set = set()

        swapped = self.swapped  # swapped-out ids are not live, but stay taken (akv.core.swap)

        def live(seq_id: Hashable) -> bool:
            return seq_id in seqs and seq_id not in freed

        def taken(seq_id: Hashable) -> bool:
            return live(seq_id) or (seq_id in swapped and seq_id not in req.frees)

        for parent_id, child_ids in req.forks:
            if not live(parent_id) and parent_id not in created:
                raise UnknownSequence(parent_id)
            for child_id in child_ids:
                if taken(child_id) or child_id in created:
                    raise DuplicateSequence(child_id)
                created.add(child_id)
        for parent_id, _ in req.forks:
            if parent_id in created and parent_id not in seqs:
                raise InvalidInput(f"fork of {parent_id!r}, a child created in the same step; fork it next step")
        appends = req.appends
        if appends:
            keys = appends.keys()
            unknown = keys - seqs.keys()
            if freed:
                unknown |= keys & freed
            if created:
                unknown -= created
            checked.single_appends = single = set(map(type, appends.values())) == {int}
            if unknown or not single:
                for seq_id, tokens in appends.items():
                    if (seq_id not in seqs or seq_id in freed) and seq_id not in created:
                        raise UnknownSequence(seq_id)
                    if type(tokens) is not int and len(tokens) == 0:
                        raise InvalidInput(f"append of no tokens to sequence {seq_id!r}")
        for adm in req.admits:
            if taken(adm.seq_id) or adm.seq_id in created:
                raise DuplicateSequence(adm.seq_id)
            created.add(adm.seq_id)
            if len(adm.prompt) == 0:
                raise InvalidInput(f"empty prompt for sequence {adm.seq_id!r}")
        return checked

    def _commits_ok(self, commits, freed: set) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Vectorized commit check: all ids live, all counts ints within range; their rows, counts and new totals, or None."""
        counts = commits.values()
        if (freed and not freed.isdisjoint(commits)) or set(map(type, counts)) != {int} or min(counts) < 0:
            return None
        try:
            rows, add = self._commit_arrays(commits)
        except (KeyError, OverflowError):  # an unknown id, a count beyond int64: the per-item check words the error
            return None
        t = self.tables
        totals = t.num_computed[rows] + add
        if not np.count_nonzero(totals > t.num_tokens[rows]):  # (count_nonzero: 0.2 us, .all(): 1.1 us)
            return rows, add, totals
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
        host = self.host
        if host is not None:
            total = host.num_free + host.num_active + host.num_cached + host.num_in_flight
            if total != host.num_blocks:
                raise AssertionError(f"shard {self.shard_index}: host states add up to {total}, not {host.num_blocks}")

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

    def _check_null_block(self) -> None:
        """Nothing points at the null block but padding: no shard owns it, no table or tree holds it."""
        null, tables = self.null_block_id, self.tables
        if self.pool.owns(null):
            raise AssertionError(f"the null block {null} is one of the shard's blocks")
        rows = np.array([seq.row for seq in self.sequences.values()], dtype=np.intp)
        if len(rows):
            entries = tables.array[rows]
            held = np.arange(entries.shape[1]) < tables.lens[rows][:, None]
            if (entries[held] == null).any():
                raise AssertionError(f"a block table holds the null block {null}")
            if (entries[~held] != null).any():
                raise AssertionError(f"a block table is padded with something else than the null block {null}")
        if null in self.tree:
            raise AssertionError(f"the null block {null} is in the prefix cache")

    def check(self) -> None:
        """Full consistency check of the shard and its tree (O(blocks + tokens)).

        Exactly the blocks marked published are in the prefix tree.

        Raises:
            AssertionError: Naming the first inconsistency found.
        """
        self.check_counters()
        self.pool.check()
        self.tree.check()
        self._check_null_block()
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
        self._check_tree_ids()
        self._check_swapped()

    def _check_swapped(self) -> None:
        """The host tier's references are exactly the swapped-out sequences' host blocks, one each."""
        host = self.host
        if host is None:
            if self.swapped:
                raise AssertionError(f"{len(self.swapped)} sequences swapped out without a host tier")
            return
        held = [h for rec in self.swapped.values() for h in rec.host_ids]
        if len(set(held)) != len(held):
            raise AssertionError("a host block is held by two swapped-out sequences, or twice by one")
        for seq_id, rec in self.swapped.items():
            if seq_id in self.sequences:
                raise AssertionError(f"sequence {seq_id!r} is both live and swapped out")
            if len(rec.host_ids) != -(-len(rec.tokens) // self.block_size):
                raise AssertionError(
                    f"swapped-out {seq_id!r}: {len(rec.host_ids)} host blocks for {len(rec.tokens)} tokens"
                )
            for h in rec.host_ids:
                if host.refcount(h) != 1:
                    raise AssertionError(f"host block {h} of swapped-out {seq_id!r} has refcount {host.refcount(h)}")
        if host.total_refs != len(held):
            raise AssertionError(f"host refcounts total {host.total_refs} but swapped-out sequences hold {len(held)}")

    def _check_tree_ids(self) -> None:
        """The tree holds exactly the published blocks of both tiers; device blocks are ancestor-closed."""
        in_tree = self.tree.block_ids()
        host, hb = self.host, self.host_base
        for b in in_tree:
            pool = host if hb is not None and b >= hb else self.pool
            if not pool.owns(b):
                raise AssertionError(f"block {b}: in the prefix cache of shard {self.shard_index} but not its own")
            if not pool.is_published(b):
                raise AssertionError(f"block {b}: in the prefix cache but not marked published")
            if pool is self.pool:
                parent, _ = self.tree.parent_of(b)
                if parent is not None and hb is not None and parent >= hb:
                    raise AssertionError(f"device block {b} hangs below host block {parent}")
        published = self.pool.num_published + (host.num_published if host is not None else 0)
        if published != len(in_tree):
            raise AssertionError(f"{published} blocks marked published but {len(in_tree)} in the prefix cache")
        if host is not None:
            host.check()
            held = sum(len(t.host_pins) for t in self._transfers.values())
            if not self._transfers and host.num_in_flight:
                raise AssertionError(f"{host.num_in_flight} host blocks in flight with no transfer pending ({held})")
        if not self.unready <= set(in_tree):
            raise AssertionError(
                f"unready blocks {sorted(self.unready - set(in_tree))[:8]} are not in the prefix cache"
            )
