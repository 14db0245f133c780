"""Stateful property test of one pool shard: ShardState against a plain-Python model.

The machine calls :meth:`ShardState.step <akv.core.shard_state.ShardState.step>`
and :meth:`ShardState.evict <akv.core.shard_state.ShardState.evict>` of a shard
that owns its :class:`~akv.core.radix_tree.RadixTree`, one scheduler operation per rule, and
keeps a model beside them (the zarr-python pattern: every rule applies to both,
every ``@invariant`` compares them, ``note()`` makes a shrunk failure read as a
script).

The model is deliberately naive: plain lists of tokens per sequence, model
block ids (fresh integers; a fork shares them, copy-on-write replaces a shared
partial tail), and the published prefixes as a dict from ``(namespace, token
tuple of whole blocks)`` to a model block id. It predicts the prefix hit of
every admission exactly. It does not predict which blocks eviction picks (that
is policy): after an eviction it keeps the published prefixes that the tree
still holds in a block the step neither removed nor stored, and checks that
exactly as many disappeared as were evicted (a ``prefill_done`` admission may
evict a prefix's cached block and publish its own for it in the same step).

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
from typing import Any

import numpy as np
from hypothesis import HealthCheck, assume, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from akv.core.block_pool import CACHED, IN_FLIGHT
from akv.core.step import Admit, StepRequest
from akv.errors import DuplicateSequence, InvalidInput, UnknownSequence
from akv.testing.shard_checks import NAMESPACES, PREFIXES, ModelSequence, ShardMachineBase, ceil_div

__all__ = [
    "ModelSequence",
    "PendingCopiesMachine",
    "ShardStateMachine",
    "TestPendingCopiesMachine",
    "TestShardStateMachine",
]


class ShardStateMachine(ShardMachineBase):
    """ShardState + RadixTree against a model, one scheduler operation per rule (see the module docstring)."""

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
        seq = ModelSequence(None, prompt, self._fresh_blocks(ceil_div(len(prompt), self.block_size)))
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
        total = ceil_div(len(prompt), bs)
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
        if out.evicted_blocks:  # first: the step evicted before it published
            self._resync_after_eviction(out.evicted_blocks, out)
        self._publish(seq)
        self._check_metadata(out, sid, cached, len(prompt))

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
        total = ceil_div(n + k, bs)
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
            self._resync_after_eviction(out.evicted_blocks, out)

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
        shard = copy.deepcopy(self.shard)
        out = self._step(frees=frees, want_metadata=False)
        expected = list(dict.fromkeys(x for x in frees if x in self.model))
        note(f"free {frees} in one step -> {out.freed}")
        assert out.freed == expected
        for sid in frees:
            shard.step(StepRequest(frees=[sid], want_metadata=False))
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
        evicted = self.shard.evict(max_blocks)
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
