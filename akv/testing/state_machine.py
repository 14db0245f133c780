"""Stateful property test of one pool shard: ShardState against a plain-Python model.

The machine drives :meth:`ShardState.step <akv.core.shard_state.ShardState.step>`
and :meth:`ShardState.evict <akv.core.shard_state.ShardState.evict>` synchronously
with :func:`~akv.core.shard_state.drive` against a local
:class:`~akv.core.radix_tree.RadixTree`, one scheduler operation per rule, and
keeps a model beside them (the zarr-python pattern: every rule applies to both,
every ``@invariant`` compares them, ``note()`` makes a shrunk failure read as a
script).

The model is deliberately naive: plain lists of tokens per sequence, model
block ids (fresh integers; a fork shares them, copy-on-write replaces a shared
partial tail), and the published prefixes as a dict from ``(namespace, token
tuple of whole blocks)`` to a model block id. It predicts the prefix hit of
every admission exactly. It does not predict which blocks eviction picks (that
is policy): after an eviction it keeps the published prefixes that the tree
still holds and checks that exactly as many disappeared as were evicted.

Copies are released right after each step (as the shard actor does when the
stream worker has finished them), so every invariant runs at a quiescent
point: no block is in flight.

Reuse it against another shard or tree implementation by subclassing and
overriding :meth:`ShardStateMachine.make_shard` / :meth:`ShardStateMachine.make_tree`
(and the class attributes for sizes)::

    class MyMachine(ShardStateMachine):
        def make_shard(self):
            return MyShardState(0, range(self.num_blocks), self.block_size)

    TestMyMachine = MyMachine.TestCase
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, assume, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from akv.core.block_pool import ACTIVE, CACHED, FREE, IN_FLIGHT
from akv.core.radix_tree import RadixTree, block_keys
from akv.core.shard_state import ShardCounters, ShardState, drive
from akv.core.step import Admit, StepOutcome, StepRequest
from akv.errors import DuplicateSequence, InvalidInput, PoolExhausted, RequestTooLarge, UnknownSequence

__all__ = [
    "ModelSequence",
    "PendingCopiesMachine",
    "ShardStateMachine",
    "TestPendingCopiesMachine",
    "TestShardStateMachine",
]

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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ShardStateMachine(RuleBasedStateMachine):
    """ShardState + RadixTree against a model. Sizes are class attributes (override in a subclass)."""

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
        self.tree = self.make_tree()
        self.model: dict[Hashable, ModelSequence] = {}
        self.published: dict[tuple[Hashable, tuple[int, ...]], int] = {}
        self.dead: list[Hashable] = ["never-added"]
        #: Pinned block ids (sources and destinations) of each copy batch still pending, oldest first.
        self.pending: list[list[int]] = []
        self._next_block = 0
        self._next_id = 0

    # ------------------------------------------------------------ factories
    def make_shard(self) -> ShardState:
        """The shard under test."""
        return ShardState(0, range(self.first_block_id, self.first_block_id + self.num_blocks), self.block_size)

    def make_tree(self) -> RadixTree:
        """The prefix tree the shard's generators are driven against."""
        return RadixTree()

    # -------------------------------------------------------------- helpers
    def _fresh_blocks(self, n: int) -> list[int]:
        out = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return out

    def _fresh_id(self) -> str:
        self._next_id += 1
        return f"s{self._next_id}"

    def _step(self, **kw: Any) -> StepOutcome:
        out = drive(self.shard.step(StepRequest(**kw)), self.tree)
        if out.copies:
            pins = [b for pair in out.copies for b in pair]
            if self.hold_copies:
                self.pending.append(pins)
            else:  # the copies ran: release their source and destination pins
                self.shard.release_copy_pins(pins)
        return out

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
        keys = block_keys(np.asarray(prompt, dtype=np.int32), self.block_size, num_blocks)
        return self.tree.match(self.shard.namespace_key(namespace), keys)

    def _resync_after_eviction(self, evicted: int) -> None:
        """Keep the published prefixes the tree still holds; exactly ``evicted`` must be gone."""
        bs = self.block_size
        kept = {
            (ns, prefix): block
            for (ns, prefix), block in self.published.items()
            if len(self._real_hits(ns, list(prefix), len(prefix) // bs)) == len(prefix) // bs
        }
        gone = len(self.published) - len(kept)
        if gone:
            event("eviction")
        note(f"  eviction removed {gone} published prefixes")
        assert gone == evicted, f"{evicted} blocks evicted but {gone} published prefixes left the tree"
        self.published = kept

    def _evictable(self, protected: list[int]) -> int:
        pool = self.shard.pool
        return pool.num_cached - sum(1 for b in set(protected) if pool.state(b) == CACHED)

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

    # ---------------------------------------------------------------- rules
    @initialize(which=st.integers(0, len(PREFIXES) - 1), extra=st.sampled_from([0, 1, 3]), prefill_done=st.booleans())
    def first_sequence(self, which, extra, prefill_done) -> None:
        """Start with one live sequence (a whole prefix plus a partial block), so every rule is enabled."""
        prompt = list(PREFIXES[which]) + [0] * extra
        sid = self._fresh_id()
        out = self._step(
            admits=[Admit(seq_id=sid, prompt=np.asarray(prompt, dtype=np.int32), prefill_done=prefill_done)]
        )
        note(f"first {sid} prompt={prompt} prefill_done={prefill_done}")
        assert out.cached_tokens == {sid: 0}
        seq = ModelSequence(None, prompt, self._fresh_blocks(_ceil_div(len(prompt), self.block_size)))
        if prefill_done:
            seq.num_computed = len(prompt)
        self.model[sid] = seq
        self._publish(seq)

    @precondition(lambda self: len(self.model) < self.max_sequences)
    @rule(
        data=st.data(),
        which=st.integers(0, len(PREFIXES) - 1),
        cut=st.sampled_from([0, 3, 4, 5, 8, 9, 12, 13, 16, 16, 16, 16]),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        length=st.sampled_from([None, None, None, None, 1, 4, 5, 8, 12]),
        namespace=st.sampled_from((*NAMESPACES, None, None)),
        prefill_done=st.booleans(),
    )
    def add(self, data, which, cut, suffix, length, namespace, prefill_done) -> None:
        bs = self.block_size
        prompt = list(PREFIXES[which][:cut]) + suffix
        if length is not None:
            prompt = (prompt + list(PREFIXES[which]))[:length]
        if data.draw(st.integers(0, 19), label="oversized") == 7:
            prompt = prompt + [5] * (self.num_blocks * bs)  # more blocks than the shard holds
        if not prompt:
            prompt = [PREFIXES[which][0]]
        sid = self._fresh_id()
        hits = self._expected_hits(namespace, prompt)
        total = _ceil_div(len(prompt), bs)
        need = total - len(hits)
        real_hits = self._real_hits(namespace, prompt, (len(prompt) - 1) // bs)
        free, evictable = self.shard.pool.num_free, self._evictable(real_hits)
        before, exhausted = self._snapshot(), self.shard.counters.pool_exhausted

        out = self._step(
            admits=[
                Admit(
                    seq_id=sid,
                    prompt=np.asarray(prompt, dtype=np.int32),
                    namespace=namespace,
                    prefill_done=prefill_done,
                )
            ]
        )
        if sid in out.rejected:
            note(f"add {sid} ns={namespace!r} prompt={prompt} prefill_done={prefill_done} -> {out.rejected[sid]!r}")
            self._check_rejection(out.rejected[sid], need, total, free, evictable, before, exhausted)
            event(f"add rejected: {type(out.rejected[sid]).__name__}")
            self.dead.append(sid)
            return
        cached = out.cached_tokens[sid]
        note(f"add {sid} ns={namespace!r} prompt={prompt} prefill_done={prefill_done} -> cached {cached}")
        assert total <= self.num_blocks and need <= free + evictable, (
            f"admitted needing {need} blocks with {free} free and {evictable} evictable"
        )
        assert cached % bs == 0, f"cached {cached} is not whole blocks"
        assert 0 <= cached < len(prompt), f"cached {cached} of a {len(prompt)}-token prompt"
        assert cached == len(hits) * bs, f"cached {cached} tokens, the model expected {len(hits) * bs}"
        event("add: prefix hit" if cached else "add: miss")
        assert out.seq_ids == [sid]
        assert out.copies == []
        seq = ModelSequence(namespace, list(prompt), hits + self._fresh_blocks(need), cached, len(hits))
        if prefill_done:
            seq.num_computed = len(prompt)
        self.model[sid] = seq
        self._publish(seq)
        self._check_metadata(out, sid, cached, len(prompt))
        if out.evicted_blocks:
            self._resync_after_eviction(out.evicted_blocks)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.lists(st.sampled_from([0, 0, 1, 2]), min_size=1, max_size=3), as_int=st.booleans())
    def append(self, data, tokens, as_int) -> None:
        bs = self.block_size
        sid = self._pick_live(data)
        seq = self.model[sid]
        if data.draw(st.integers(0, 19), label="oversized") == 7:
            tokens = [1] * (self.num_blocks * bs + 1)
        n, k = len(seq.tokens), len(tokens)
        holders = sum(1 for other in self.model.values() if seq.blocks[-1] in other.blocks)
        cow = n % bs != 0 and holders > 1
        total = _ceil_div(n + k, bs)
        need = total - len(seq.blocks) + cow
        free, evictable = self.shard.pool.num_free, self._evictable([])
        before, exhausted = self._snapshot(), self.shard.counters.pool_exhausted
        payload: Any = tokens[0] if as_int and k == 1 else np.asarray(tokens, dtype=np.int32)

        out = self._step(appends={sid: payload})
        if sid in out.rejected:
            note(f"append {sid} {k} tokens -> {out.rejected[sid]!r}")
            self._check_rejection(out.rejected[sid], need, total, free, evictable, before, exhausted)
            event(f"append rejected: {type(out.rejected[sid]).__name__}")
            return
        if cow:
            event("append: copy-on-write")
        note(f"append {sid} {tokens if k < 8 else f'{k} tokens'} (copy-on-write: {cow})")
        assert total <= self.num_blocks and need <= free + evictable
        assert len(out.copies) == int(cow), f"expected {int(cow)} copies, got {out.copies}"
        if cow:
            seq.blocks[-1] = self._fresh_blocks(1)[0]
        seq.blocks.extend(self._fresh_blocks(need - cow))
        seq.tokens.extend(tokens)
        self._check_metadata(out, sid, n, n + k)
        if out.evicted_blocks:
            self._resync_after_eviction(out.evicted_blocks)

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def decode(self, data) -> None:
        """One int token for each of several sequences in one step (the vectorized decode path)."""
        bs = self.block_size
        sids = data.draw(st.lists(st.sampled_from(sorted(self.model, key=str)), min_size=2, unique=True), label="batch")
        tokens = data.draw(st.lists(st.integers(0, 3), min_size=len(sids), max_size=len(sids)), label="tokens")
        # The model applies the batch in order: a shared tail is copied for every
        # holder but the last one to write, which finds it private.
        model = {sid: seq.copy() for sid, seq in self.model.items()}
        copies, starts = 0, []
        for sid in sids:
            seq = model[sid]
            n = len(seq.tokens)
            holders = sum(1 for other in model.values() if seq.blocks[-1] in other.blocks)
            cow = n % bs != 0 and holders > 1
            if cow:
                seq.blocks[-1] = -1 - copies  # a private block (ids fixed below)
                copies += 1
            if n % bs == 0:
                seq.blocks.append(None)
            starts.append(n)
        need = copies + sum(1 for sid in sids if model[sid].blocks[-1] is None)
        assume(need <= self.shard.pool.num_free)  # eviction and rejection are the append rule's
        out = self._step(appends=dict(zip(sids, tokens)))
        note(f"decode {dict(zip(sids, tokens))} ({copies} copies-on-write, {need} new blocks)")
        assert out.rejected == {} and out.evicted_blocks == 0
        assert len(out.copies) == copies, f"expected {copies} copies, got {out.copies}"
        for sid, tok in zip(sids, tokens):
            seq = model[sid]
            seq.blocks = [b if b is not None and b >= 0 else self._fresh_blocks(1)[0] for b in seq.blocks]
            seq.tokens.append(tok)
        self.model.update({sid: model[sid] for sid in sids})
        assert out.seq_ids == sids
        tables = [self.shard.sequences[sid].block_ids.tolist() for sid in sids]
        width = max(len(t) for t in tables)
        assert out.block_tables.tolist() == [t + [self.shard.null_block_id] * (width - len(t)) for t in tables]
        assert out.context_lens.tolist() == [p + 1 for p in starts]
        assert out.query_start_loc.tolist() == list(range(len(sids) + 1))
        assert out.slot_mapping.tolist() == [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def commit(self, data) -> None:
        sid = self._pick_live(data)
        seq = self.model[sid]
        left = len(seq.tokens) - seq.num_computed
        n = data.draw(st.one_of(st.just(left), st.integers(0, left)), label="num_tokens")
        out = self._step(commits={sid: n}, want_metadata=False)
        seq.num_computed += n
        self._publish(seq)
        note(f"commit {sid} {n} -> computed {seq.num_computed}, published {seq.num_published} blocks")
        assert out.seq_ids == [] and out.rejected == {}

    @precondition(lambda self: self.model and len(self.model) < self.max_sequences)
    @rule(data=st.data(), num_children=st.integers(1, 2))
    def fork(self, data, num_children) -> None:
        parent = self._pick_live(data)
        children = [self._fresh_id() for _ in range(num_children)]
        before = self.shard.pool.counts()
        self._step(forks=[(parent, children)], want_metadata=False)
        note(f"fork {parent} -> {children}")
        for child in children:
            self.model[child] = self.model[parent].copy()
        assert self.shard.pool.counts() == before, "a fork allocated or released blocks"

    @rule(data=st.data())
    def free(self, data) -> None:
        live = bool(self.model) and data.draw(st.booleans(), label="live")
        sid = self._pick_live(data) if live else data.draw(st.sampled_from(self.dead), label="dead")
        before = self._snapshot()
        out = self._step(frees=[sid], want_metadata=False)
        note(f"free {sid} ({'live' if live else 'unknown or already freed'})")
        if live:
            assert out.freed == [sid]
            del self.model[sid]
            self.dead.append(sid)
        else:
            assert out.freed == []
            assert self._snapshot() == before, "freeing an unknown sequence changed the shard"

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def free_several(self, data) -> None:
        """Several sequences (sharing prefix blocks, forks among them) freed in one step, with a
        repeated and an unknown id: the same shard as freeing them one step each."""
        live = data.draw(
            st.lists(st.sampled_from(sorted(self.model)), min_size=2, max_size=5, unique=True), label="live"
        )
        frees = [*live, live[0], data.draw(st.sampled_from(self.dead), label="dead")]
        frees = data.draw(st.permutations(frees), label="order")
        one_by_one = copy.deepcopy((self.shard, self.tree))
        out = self._step(frees=frees, want_metadata=False)
        expected = list(dict.fromkeys(x for x in frees if x in self.model))
        note(f"free {frees} in one step -> {out.freed}")
        assert out.freed == expected
        shard, tree = one_by_one
        for sid in frees:
            drive(shard.step(StepRequest(frees=[sid], want_metadata=False)), tree)
        pool, ref = self.shard.pool, shard.pool
        assert pool.counts() == ref.counts()
        assert pool.eviction_order() == ref.eviction_order(), "batched free released blocks in another order"
        assert pool._free == ref._free, "the free queues differ (the next allocations would)"
        blocks = range(pool.first_block_id, pool.first_block_id + pool.num_blocks)
        assert [pool.refcount(b) for b in blocks] == [ref.refcount(b) for b in blocks]
        for sid in expected:
            del self.model[sid]
            self.dead.append(sid)

    @rule(max_blocks=st.integers(1, 6))
    def evict(self, max_blocks) -> None:
        pool = self.shard.pool
        cached = pool.num_cached
        # Only leaves go: a cached block above a published block that a pending
        # copy pins (in flight) must wait for the copy.
        blocked = {
            b
            for p in self._pinned()
            if p in self.tree and pool.state(p) == IN_FLIGHT
            for b in self.tree.path(p)[:-1]
            if pool.state(b) == CACHED
        }
        evicted = drive(self.shard.evict(max_blocks), self.tree)
        note(f"evict up to {max_blocks} of {cached} cached ({len(blocked)} blocked) -> {evicted}")
        expected = min(max_blocks, cached - len(blocked))
        assert evicted == expected, f"evicted {evicted} of {cached} cached, {len(blocked)} blocked (asked {max_blocks})"
        assert self.shard.pool.num_cached == cached - evicted
        self._resync_after_eviction(evicted)

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            [
                "commit_too_many",
                "commit_negative",
                "commit_unknown",
                "append_unknown",
                "append_empty",
                "fork_unknown",
                "fork_existing",
                "admit_duplicate",
                "admit_empty",
            ]
        ),
    )
    def invalid(self, data, kind) -> None:
        """A malformed step raises its typed error and changes nothing."""
        ghost = data.draw(st.sampled_from(self.dead), label="ghost")
        if not self.model and kind in (
            "commit_too_many",
            "commit_negative",
            "append_empty",
            "fork_existing",
            "admit_duplicate",
        ):
            kind = "commit_unknown"
        sid = self._pick_live(data) if self.model else None
        empty = np.array([], dtype=np.int32)
        if kind == "commit_too_many":
            seq = self.model[sid]
            error, kw = InvalidInput, {"commits": {sid: len(seq.tokens) - seq.num_computed + 1}}
        elif kind == "commit_negative":
            error, kw = InvalidInput, {"commits": {sid: -1}}
        elif kind == "commit_unknown":
            error, kw = UnknownSequence, {"commits": {ghost: 0}}
        elif kind == "append_unknown":
            error, kw = UnknownSequence, {"appends": {ghost: np.array([1], dtype=np.int32)}}
        elif kind == "append_empty":
            error, kw = InvalidInput, {"appends": {sid: empty}}
        elif kind == "fork_unknown":
            error, kw = UnknownSequence, {"forks": [(ghost, ("new-child",))]}
        elif kind == "fork_existing":
            error, kw = DuplicateSequence, {"forks": [(sid, (sid,))]}
        elif kind == "admit_duplicate":
            error, kw = DuplicateSequence, {"admits": [Admit(seq_id=sid, prompt=np.array([1, 2], dtype=np.int32))]}
        else:
            error, kw = InvalidInput, {"admits": [Admit(seq_id="empty", prompt=empty)]}
        before = self._snapshot()
        exhausted = self.shard.counters.pool_exhausted
        note(f"invalid {kind}: {kw}")
        try:
            self._step(**kw)
        except error:
            pass
        else:
            raise AssertionError(f"{kind}: expected {error.__name__}")
        assert self._snapshot() == before, f"{kind}: a rejected step changed the shard"
        assert self.shard.counters.pool_exhausted == exhausted

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
        self.tree.check()
        self.shard.check(self.tree.block_ids())

    @invariant()
    def sequences_match_the_model(self) -> None:
        bs = self.block_size
        assert set(self.shard.sequences) == set(self.model)
        for sid, seq in self.model.items():
            real = self.shard.sequences[sid]
            assert self.shard.token_ids(real).tolist() == seq.tokens, f"{sid}: token history differs from the model"
            assert len(real.block_ids) == _ceil_div(len(seq.tokens), bs) == len(seq.blocks), sid
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


class PendingCopiesMachine(ShardStateMachine):
    """The same machine with copy-on-write copies that stay pending across steps.

    Their source and destination blocks stay pinned (in flight once no table
    holds them) until ``finish_copies`` completes the oldest batches, as the
    stream worker does in submission order. Checks that a pinned block is
    never handed out, and that a published block still read by a copy can be
    a prefix hit.
    """

    hold_copies = True

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def finish_copies(self, data) -> None:
        n = data.draw(st.integers(1, len(self.pending)), label="batches")
        done, self.pending = self.pending[:n], self.pending[n:]
        note(f"finish {n} copy batches: {done}")
        for pins in done:
            self.shard.release_copy_pins(pins)


ShardStateMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestShardStateMachine = ShardStateMachine.TestCase
PendingCopiesMachine.TestCase.settings = ShardStateMachine.TestCase.settings
TestPendingCopiesMachine = PendingCopiesMachine.TestCase
