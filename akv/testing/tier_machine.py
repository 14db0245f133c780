"""Stateful property test of a shard with a host tier: ShardState, its copies and a plain model of the K/V.

The machine drives :class:`~akv.core.shard_state.ShardState` with a host tier
(:mod:`akv.core.tiers`, :mod:`akv.core.swap`) one scheduler operation per
rule, and keeps beside it:

- **the K/V as a model runner and the stream worker would leave them**: a
  dict per tier from block (or host slot) to the token ids its K/V stands
  for, one list of ``block_size`` entries per block. After every step the
  runner writes the token of every scheduled position through the block
  table, as a real runner writes K/V through the slot mapping. Copy batches
  (demotions and swap-outs to the host, copy-on-write, promotions and
  swap-ins to the device) are applied in submission order, each batch's
  phases in the stream worker's order;
- **pending copies**: with ``sync_copies`` off, a step's batch runs before
  the runner writes (the runner waits for the step's copies, or for the
  earlier batch ``wait_transfer`` names when the step has none; a step with
  nothing to write waits for nothing, its batch stays queued), but the shard
  hears of it only at its next call (as the actor settles at its next
  message); a background ``evict``'s batch (held demotions) stays queued
  until the ``finish`` rule or a later step's batch runs it;
- **the sequences**: their token histories and committed counts.

The invariants are what a serving stack must be able to trust: every live
sequence reads back its own token history through its block table; every
block the prefix tree would match (either tier, once its copy completed)
holds exactly the tokens of its chain; the shard's full consistency check
(states of both tiers add up, the tree holds exactly the published blocks,
device blocks are ancestor-closed) passes after every rule.

Use ``TierMachine.TestCase`` (pending copies) or ``SyncTierMachine.TestCase``
(metadata mode: copies complete where they are made).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from akv.core.shard_state import ShardState
from akv.core.step import Admit, StepOutcome, StepRequest
from akv.errors import AkvError, PoolExhausted, UnknownSequence

__all__ = ["SyncTierMachine", "TierMachine"]

#: Prompt stems: 0 and 1 share their first two blocks (of 2 tokens), 2 shares nothing.
STEMS = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (7, 7, 8, 8, 6, 6, 5, 5))


class TierMachine(RuleBasedStateMachine):
    """A shard with a host tier, its copies and K/V against a plain model (see the module docstring)."""

    block_size = 2
    num_blocks = 14
    first_block_id = 10
    num_host_blocks = 10
    sync_copies = False
    shard_class: type[ShardState] = ShardState  # what _make builds
    policies = ("lru", "slru", "lfu")

    def __init__(self) -> None:
        super().__init__()
        self.policy = None
        self.shard: ShardState | None = None
        self.tokens: dict[Hashable, list[int]] = {}  # live sequences' histories
        self.swapped_tokens: dict[Hashable, list[int]] = {}  # swapped-out sequences' histories
        self.dev: dict[int, list] = {}  # device block -> token ids its K/V stands for
        self.host: dict[int, list] = {}  # host id -> the same
        self.queue: list[tuple[StepOutcome, bool]] = []  # submitted batches, oldest first: (outcome, ran)
        self._next = 0

    def _make(self, policy: str) -> ShardState:
        first, n = self.first_block_id, self.num_blocks
        host = range(first + n + 1, first + n + 1 + self.num_host_blocks)
        return self.shard_class(
            0,
            range(first, first + n),
            self.block_size,
            eviction_policy=policy,
            null_block_id=first + n,
            host_ids=host,
            sync_copies=self.sync_copies,
        )

    # ----------------------------------------------------------- copies
    def _run(self, out: StepOutcome) -> None:
        """Apply one batch's copies to the model K/V in the stream worker's order."""
        for dev, hid in out.demotes + out.swap_outs:
            self.host[hid] = list(self.dev.get(dev, [None] * self.block_size))
        for src, dst in out.copies:
            self.dev[dst] = list(self.dev.get(src, [None] * self.block_size))
        for hid, dev in out.promotes + out.swap_ins:
            self.dev[dev] = list(self.host.get(hid, [None] * self.block_size))

    def _run_through(self, k: int) -> None:
        """Run the queued batches up to index ``k`` (inclusive), in order."""
        for i in range(k + 1):
            out, ran = self.queue[i]
            if not ran:
                self._run(out)
                self.queue[i] = (out, True)

    def _settle(self) -> None:
        """What the actor does at the start of every message: report the batches that ran."""
        keep = []
        for out, ran in self.queue:
            if not ran:
                keep.append((out, ran))
                continue
            if out.copies:
                self.shard.release_copy_pins([b for pair in out.copies for b in pair])
            if out.transfer is not None:
                self.shard.transfer_done(out.transfer)
        self.queue = keep

    def _submit(self, out: StepOutcome, *, runner_waits: bool) -> None:
        """Queue ``out``'s batch; if the runner waits, run what it waits for: its batch, else ``out.wait_transfer``'s."""
        if self.sync_copies and out.transfer is None:
            self._run(out)
            if out.copies:
                self.shard.release_copy_pins([b for pair in out.copies for b in pair])
            return
        if out.copies or out.transfer is not None:
            self.queue.append((out, False))
            if runner_waits:
                self._run_through(len(self.queue) - 1)
        elif runner_waits and out.wait_transfer is not None:  # an earlier batch still reads a block it got
            for i, (earlier, _) in enumerate(self.queue):
                if earlier.transfer == out.wait_transfer:
                    self._run_through(i)

    def _step(self, **kw) -> StepOutcome:
        """One step; its runner waits for what the step gives it to wait for only if it has rows to write."""
        self._settle()
        out = self.shard.step(StepRequest(**kw))
        self._submit(out, runner_waits=bool(out.seq_ids))
        self._write(out)
        return out

    def _write(self, out: StepOutcome) -> None:
        """The runner writes the K/V of every scheduled position (here: the token id) through the block table."""
        bs = self.block_size
        for sid in out.seq_ids:
            seq = self.shard.sequences[sid]
            table = seq.block_ids.tolist()
            history = self.tokens[sid]
            start = seq.num_cached_tokens if sid in out.cached_tokens else len(history) - 1
            for p in range(start, len(history)):
                self.dev.setdefault(table[p // bs], [None] * bs)[p % bs] = history[p]

    # ------------------------------------------------------------ rules
    @initialize(policy=st.sampled_from(policies))
    def start(self, policy: str) -> None:
        self.policy = policy
        self.shard = self._make(policy)
        note(f"shard with policy {policy}, sync_copies={self.sync_copies}")

    @precondition(lambda self: len(self.tokens) < 5)
    @rule(stem=st.sampled_from(range(len(STEMS))), cut=st.integers(1, 8), tail=st.lists(st.integers(0, 3), max_size=3))
    def add(self, stem: int, cut: int, tail: list[int]) -> None:
        prompt = list(STEMS[stem][:cut]) + tail
        sid = f"s{self._next}"
        self._next += 1
        self.tokens[sid] = prompt
        out = self._step(admits=[Admit(seq_id=sid, prompt=np.asarray(prompt, dtype=np.int32), prefill_done=True)])
        if sid in out.rejected:
            del self.tokens[sid]
            note(f"add {sid} {prompt} -> {out.rejected[sid]!r}")
            return
        note(f"add {sid} {prompt} -> cached {out.cached_tokens[sid]}, promoted {len(out.promotes)}")
        if out.promotes:
            event("promotion")
        if out.demotes:
            event("demotion on demand")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        self._settle()
        out = self.shard.step(StepRequest(appends={sid: token}))
        if sid in out.rejected:
            note(f"decode {sid} -> {out.rejected[sid]!r}")
            self._submit(out, runner_waits=False)  # nothing to write: its copies may still be pending
            return
        self.tokens[sid].append(token)
        self._submit(out, runner_waits=True)
        self._write(out)
        self._settle()
        self.shard.step(StepRequest(commits={sid: len(self.tokens[sid]) - self.shard.sequences[sid].num_computed}))
        note(f"decode {sid} +{token}")

    @precondition(lambda self: self.tokens and len(self.tokens) < 5)
    @rule(data=st.data())
    def fork(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        child = f"s{self._next}"
        self._next += 1
        self._step(forks=[(sid, (child,))], want_metadata=False)
        self.tokens[child] = list(self.tokens[sid])
        note(f"fork {sid} -> {child}")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        self._step(frees=[sid], want_metadata=False)
        del self.tokens[sid]
        note(f"free {sid}")

    @rule(max_blocks=st.integers(1, 8))
    def evict(self, max_blocks: int) -> None:
        """Background eviction: demotions held in flight until their copies ran."""
        self._settle()
        out = StepOutcome()
        evicted = self.shard.evict(max_blocks, out)
        self._submit(out, runner_waits=False)
        note(f"evict {max_blocks} -> {evicted} ({len(out.demotes)} demoted)")

    @precondition(lambda self: any(not ran for _, ran in self.queue))
    @rule(data=st.data())
    def finish(self, data) -> None:
        """The stream worker runs the oldest pending batches."""
        waiting = [i for i, (_, ran) in enumerate(self.queue) if not ran]
        k = data.draw(st.sampled_from(waiting), label="through")
        self._run_through(k)
        note(f"copies ran through batch {k}")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        self._settle()
        out = StepOutcome()
        try:
            n = self.shard.swap_out(sid, out)
        except PoolExhausted as exc:
            note(f"swap out {sid} -> {exc!r}")
            self._submit(out, runner_waits=False)
            return
        self.swapped_tokens[sid] = self.tokens.pop(sid)
        self._submit(out, runner_waits=True)  # swap_out returns once its copies ran
        note(f"swap out {sid}: {n} blocks")
        event("swap out")

    @precondition(lambda self: self.swapped_tokens)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.swapped_tokens)), label="seq")
        self._settle()
        out = StepOutcome()
        try:
            n = self.shard.swap_in(sid, out)
        except AkvError as exc:
            note(f"swap in {sid} -> {exc!r}")
            self._submit(out, runner_waits=False)  # a refused swap-in waits for nothing
            return
        self.tokens[sid] = self.swapped_tokens.pop(sid)
        self._submit(out, runner_waits=True)
        note(f"swap in {sid}: {n} blocks")
        event("swap in")

    @precondition(lambda self: self.swapped_tokens)
    @rule(data=st.data())
    def free_swapped(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.swapped_tokens)), label="seq")
        out = self._step(frees=[sid], want_metadata=False)
        assert out.freed == [sid]
        del self.swapped_tokens[sid]
        note(f"free swapped {sid}")

    @precondition(lambda self: self.swapped_tokens)
    @rule()
    def step_on_swapped_is_unknown(self) -> None:
        for sid in self.swapped_tokens:
            try:
                self.shard.step(StepRequest(appends={sid: 1}))
            except UnknownSequence:
                continue
            raise AssertionError(f"an append to swapped-out {sid} was accepted")

    # ------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        if self.shard is not None:
            self.shard.check()

    @invariant()
    def sequences_read_their_own_history(self) -> None:
        if self.shard is None:
            return
        bs = self.block_size
        for sid, history in self.tokens.items():
            seq = self.shard.sequences[sid]
            assert self.shard.token_ids(seq).tolist() == history, f"{sid}: token ids differ"
            table = seq.block_ids.tolist()
            read = [self.dev.get(table[p // bs], [None] * bs)[p % bs] for p in range(len(history))]
            assert read == history, f"{sid} reads {read} through {table}, wrote {history}"

    @invariant()
    def matchable_blocks_hold_their_chain(self) -> None:
        """Every block a match could return (ready, either tier) holds exactly its chain's last block of tokens."""
        shard = self.shard
        if shard is None:
            return
        tree, bs = shard.tree, self.block_size
        for b in tree.block_ids():
            if b in shard.unready:
                continue
            _, chain = tree.chain(b)
            want = np.frombuffer(chain, dtype="<i4")[-bs:].tolist()
            have = (self.host if tree.is_host(b) else self.dev).get(b)
            assert have == want, f"cached block {b} holds {have}, its chain ends in {want}"

    def teardown(self) -> None:
        if self.shard is None:
            return
        self._run_through(len(self.queue) - 1)
        self._settle()
        assert not self.shard._transfers, "transfers left open after every copy ran"
        self.shard.check()


class SyncTierMachine(TierMachine):
    """:class:`TierMachine` in metadata mode: copies complete where they are made, nothing is ever unready."""

    sync_copies = True

    @invariant()
    def nothing_unready(self) -> None:
        if self.shard is not None:
            assert not self.shard.unready and not self.shard._transfers


TierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SyncTierMachine.TestCase.settings = TierMachine.TestCase.settings
