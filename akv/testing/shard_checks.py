"""The model, helpers and invariants of :class:`~akv.testing.state_machine.ShardStateMachine`.

:class:`ShardMachineBase` holds the machine's state (the shard under test, its
tree, the plain model of sequences and published prefixes), the helpers its
rules share and its ``@invariant`` checks; the rules live in
:mod:`akv.testing.state_machine`. Split out to keep each module short.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from akv.core.block_pool import ACTIVE, CACHED, FREE, IN_FLIGHT
from akv.core.radix_tree import RadixTree
from akv.core.shard_state import ShardCounters, ShardState
from akv.core.step import StepOutcome, StepRequest
from akv.errors import PoolExhausted, RequestTooLarge

__all__ = ["NAMESPACES", "PREFIXES", "ModelSequence", "ShardMachineBase", "ceil_div"]

#: Prompt prefixes: 0 and 1 share their first two blocks (of 4 tokens), 2 shares nothing.
PREFIXES: tuple[tuple[int, ...], ...] = (
    tuple(range(100, 116)),
    tuple(range(100, 108)) + tuple(range(200, 208)),
    tuple(range(300, 316)),
)
NAMESPACES: tuple[Hashable, ...] = (None, "tenant-b")


@dataclasses.dataclass
class ModelSequence:
    """What the model knows of one live sequence."""

    namespace: Hashable
    tokens: list[int]
    blocks: list[int]  # model block ids, logical order
    num_computed: int = 0
    num_published: int = 0
    stopped: bool = False

    def copy(self) -> ModelSequence:
        return dataclasses.replace(self, tokens=list(self.tokens), blocks=list(self.blocks))


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


class ShardMachineBase(RuleBasedStateMachine):
    """ShardState + RadixTree and a plain model of them: state, helpers, invariants.

    Sizes are class attributes (override in a subclass).
    """

    #: Tokens per block.
    block_size = 4
    #: Blocks in the shard: small, so exhaustion and eviction happen often.
    num_blocks = 20
    #: First global block id of the shard (non-zero: catches id/offset mix-ups).
    first_block_id = 100
    #: Live sequences at most.
    max_sequences = 6
    #: Keep copy-on-write copies pending until the ``finish_copies`` rule of
    #: :class:`PendingCopiesMachine` runs (False: they finish within their step).
    hold_copies = False

    def __init__(self) -> None:
        super().__init__()
        self.shard = self.make_shard()
        self.model: dict[Hashable, ModelSequence] = {}
        self.published: dict[tuple[Hashable, tuple[int, ...]], int] = {}
        self.dead: list[Hashable] = ["never-added"]
        #: Pinned block ids (sources and destinations) of each copy batch still pending, oldest first.
        self.pending: list[list[int]] = []
        self._next_block = 0
        self._next_id = 0

    # ------------------------------------------------------------ factories
    def make_shard(self) -> ShardState:
        """The shard under test, owning the tree of :meth:`make_tree`."""
        blocks = range(self.first_block_id, self.first_block_id + self.num_blocks)
        return ShardState(0, blocks, self.block_size, tree=self.make_tree())

    def make_tree(self) -> RadixTree:
        """The prefix tree the shard under test owns."""
        return RadixTree(self.block_size)

    @property
    def tree(self) -> RadixTree:
        """The prefix tree of the shard under test."""
        return self.shard.tree

    # -------------------------------------------------------------- helpers
    def _fresh_blocks(self, n: int) -> list[int]:
        out = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return out

    def _fresh_id(self) -> str:
        self._next_id += 1
        return f"s{self._next_id}"

    def _step(self, **kw: Any) -> StepOutcome:
        before = set(self.tree.block_ids())
        out = self.shard.step(StepRequest(**kw))
        self._check_cache_changes(before, out)
        if out.copies:
            pins = [b for pair in out.copies for b in pair]
            if self.hold_copies:
                self.pending.append(pins)
            else:  # the copies ran: release their source and destination pins
                self.shard.release_copy_pins(pins)
        return out

    def _check_cache_changes(self, before: set[int], out: StepOutcome) -> None:
        """The step's stored and removed block ids are exactly how the tree changed from ``before``."""
        stored, removed = out.stored_block_ids, out.removed_block_ids
        assert len(set(stored)) == len(stored), f"a block stored twice: {stored}"
        assert len(set(removed)) == len(removed), f"a block removed twice: {removed}"
        assert set(removed) <= before, f"removed {sorted(set(removed) - before)}, not in the prefix cache"
        kept = before - set(removed)
        assert kept.isdisjoint(stored), f"stored {sorted(kept & set(stored))}, already in the prefix cache"
        assert kept | set(stored) == set(self.tree.block_ids()), "stored/removed block ids differ from the tree diff"
        assert len(removed) == out.evicted_blocks

    def _pinned(self) -> set[int]:
        return {b for pins in self.pending for b in pins}

    def _snapshot(self) -> tuple:
        """Everything an error must leave unchanged (the ``pool_exhausted`` counter excepted)."""
        pool = self.shard.pool
        c = self.shard.counters
        counters = {f.name: getattr(c, f.name) for f in dataclasses.fields(ShardCounters) if f.name != "pool_exhausted"}
        seqs = {
            sid: (
                tuple(self.shard.token_ids(s).tolist()),
                tuple(s.block_ids.tolist()),
                s.num_computed,
                s.num_published,
                s.publish_stopped,
            )
            for sid, s in self.shard.sequences.items()
        }
        return (pool.counts(), pool.lru_order(), sorted(self.tree.block_ids()), seqs, counters, pool.total_refs)

    def _expected_hits(self, namespace: Hashable, prompt: list[int]) -> list[int]:
        """Model block ids of the longest published prefix (never the last prompt token)."""
        bs = self.block_size
        hits: list[int] = []
        for i in range((len(prompt) - 1) // bs):
            block = self.published.get((namespace, tuple(prompt[: (i + 1) * bs])))
            if block is None:
                break
            hits.append(block)
        return hits

    def _publish(self, seq: ModelSequence) -> None:
        """Publish the sequence's full committed blocks, stopping at a block computed twice."""
        if seq.stopped:
            return
        bs = self.block_size
        full = min(seq.num_computed // bs, len(seq.blocks))
        for i in range(seq.num_published, full):
            key = (seq.namespace, tuple(seq.tokens[: (i + 1) * bs]))
            have = self.published.setdefault(key, seq.blocks[i])
            if have != seq.blocks[i]:
                event("publish stopped at a block computed twice")
                seq.stopped = True
                return
            seq.num_published = i + 1

    def _real_hits(self, namespace: Hashable, prompt: list[int], num_blocks: int) -> list[int]:
        tokens = np.asarray(prompt, dtype=np.int32)[: num_blocks * self.block_size]
        return self.tree.match(self.shard.namespace_key(namespace), tokens)

    def _resync_after_eviction(self, evicted: int, out: StepOutcome | None = None) -> None:
        """Forget the published prefixes an eviction removed from the tree; exactly ``evicted`` must be gone.

        Call it before publishing what the step published in the model. A
        ``prefill_done`` admission recomputes its last full block (never a
        hit), and its step may evict the cached block of that very prefix
        and then publish its own: the prefix is back in the tree, in another
        block or in the same block id reallocated. ``out``, the step's
        outcome, tells them apart: a prefix the tree now maps to a block that
        the step removed or stored was evicted (without ``out``, as after
        :meth:`ShardState.evict <akv.core.shard_state.ShardState.evict>`,
        nothing was stored and a prefix still in the tree stayed).
        """
        bs = self.block_size
        renewed = {*out.removed_block_ids, *out.stored_block_ids} if out is not None else set()
        kept = {}
        for (ns, prefix), block in self.published.items():
            ids = self._real_hits(ns, list(prefix), len(prefix) // bs)
            if len(ids) == len(prefix) // bs and ids[-1] not in renewed:
                kept[(ns, prefix)] = block
        gone = len(self.published) - len(kept)
        if gone:
            event("eviction")
        note(f"  eviction removed {gone} published prefixes")
        assert gone == evicted, f"{evicted} blocks evicted but {gone} published prefixes left the tree"
        self.published = kept

    def _evictable(self, protected: list[int]) -> int:
        """Cached blocks an eviction can take now: not ``protected``, nor above a published block a pending copy pins."""
        pool, tree = self.shard.pool, self.tree
        blocked = {b for p in self._pinned() if p in tree and pool.state(p) == IN_FLIGHT for b in tree.path(p)[:-1]}
        return pool.num_cached - sum(1 for b in blocked | set(protected) if pool.state(b) == CACHED)

    def _check_rejection(
        self, err: Exception, need: int, total: int, free: int, evictable: int, before: tuple, exhausted: int
    ) -> None:
        """A rejection is the right one, with the right numbers, and left no trace.

        ``total`` blocks (the whole sequence after the operation) more than the
        shard holds can never be served: RequestTooLarge. Otherwise ``need``
        new blocks more than free plus evictable: PoolExhausted.
        """
        if total > self.num_blocks:
            assert isinstance(err, RequestTooLarge), f"expected RequestTooLarge, got {err!r}"
            assert (err.requested_blocks, err.num_blocks) == (total, self.num_blocks)
            assert self.shard.counters.pool_exhausted == exhausted
        else:
            assert isinstance(err, PoolExhausted), f"expected PoolExhausted, got {err!r}"
            assert (err.requested_blocks, err.free_blocks, err.evictable_blocks) == (need, free, evictable)
            assert need > free + evictable
            assert self.shard.counters.pool_exhausted == exhausted + 1
        assert self._snapshot() == before, "a rejected operation changed the shard"

    def _pick_live(self, data: st.DataObject) -> Hashable:
        return data.draw(st.sampled_from(sorted(self.model)), label="seq")

    # ------------------------------------------------------------- checks
    def _check_metadata(self, out: StepOutcome, sid: Hashable, start: int, end: int) -> None:
        """The one scheduled row's block table, context length and slot mapping."""
        bs = self.block_size
        table = self.shard.sequences[sid].block_ids.tolist()
        assert out.seq_ids == [sid]
        assert out.block_tables.tolist() == [table]
        assert out.context_lens.tolist() == [end]
        assert out.query_start_loc.tolist() == [0, end - start]
        assert out.slot_mapping.tolist() == [table[p // bs] * bs + p % bs for p in range(start, end)]

    @invariant()
    def states_add_up(self) -> None:
        counts = self.shard.pool.counts()
        assert sum(counts.values()) == self.num_blocks, counts
        referenced = {b for seq in self.shard.sequences.values() for b in seq.block_ids.tolist()}
        in_flight = len(self._pinned() - referenced)
        assert counts["in_flight"] == in_flight, f"{counts}: expected {in_flight} unreferenced blocks held by copies"

    @invariant()
    def shard_and_tree_are_consistent(self) -> None:
        self.shard.check()

    @invariant()
    def sequences_match_the_model(self) -> None:
        bs = self.block_size
        assert set(self.shard.sequences) == set(self.model)
        for sid, seq in self.model.items():
            real = self.shard.sequences[sid]
            assert self.shard.token_ids(real).tolist() == seq.tokens, f"{sid}: token history differs from the model"
            assert len(real.block_ids) == ceil_div(len(seq.tokens), bs) == len(seq.blocks), sid
            assert (real.num_computed, real.num_published, real.publish_stopped) == (
                seq.num_computed,
                seq.num_published,
                seq.stopped,
            ), sid

    @invariant()
    def block_sharing_matches_the_model(self) -> None:
        """Model block ids and real block ids are in one-to-one correspondence (tables and tree)."""
        bs = self.block_size
        m2r: dict[int, int] = {}
        r2m: dict[int, int] = {}

        def pair(m: int, r: int, where: str) -> None:
            assert m2r.setdefault(m, r) == r and r2m.setdefault(r, m) == m, (
                f"{where}: model block {m} / real block {r} break the one-to-one sharing"
            )

        for sid, seq in self.model.items():
            for m, r in zip(seq.blocks, self.shard.sequences[sid].block_ids.tolist()):
                pair(m, r, f"sequence {sid}")
        for (ns, prefix), m in self.published.items():
            ids = self._real_hits(ns, list(prefix), len(prefix) // bs)
            assert len(ids) == len(prefix) // bs, f"published prefix {prefix} (ns {ns!r}) is not in the tree"
            pair(m, ids[-1], f"prefix {prefix}")
        assert len(self.tree) == len(self.published), "the tree holds blocks the model never published"

    @invariant()
    def no_block_both_free_and_referenced(self) -> None:
        pool = self.shard.pool
        refs: dict[int, int] = {}
        for seq in self.shard.sequences.values():
            for b in seq.block_ids.tolist():
                refs[b] = refs.get(b, 0) + 1
        for b, r in refs.items():
            assert pool.state(b) == ACTIVE and pool.refcount(b) == r, f"block {b}: state {pool.state(b)}, refs {r}"
        assert pool.num_active == len(refs)
        pinned = self._pinned()
        for b in pinned:
            assert pool.state(b) != FREE, f"block {b} is free while a pending copy still uses it"
        published_idle = set(self.tree.block_ids()) - set(refs)
        model_idle = set(self.published.values()) - {m for s in self.model.values() for m in s.blocks}
        assert len(published_idle) == len(model_idle)
        assert pool.num_cached == len(published_idle - pinned), "cached blocks are not exactly the idle published ones"
