"""Stateful property test of the whole manager: KVCacheManager, its actors and real K/V tensors.

:class:`ManagerMachine` runs a real :class:`~akv.manager.KVCacheManager` (pool
shards, eviction loop, stream worker) in an anyio blocking portal, so every
rule is a plain synchronous call, and keeps the plain model of
:mod:`akv.testing.prefix_model` beside it. Each example draws 1-4 shards, an
eviction policy, watermarks (the eviction loop off, or evicting in the
background between and during rules) and an event-loop backend.

Rules: scheduler steps mixing frees, preemptions, commits, forks, appends and
admissions (new and resumed), a decode step (one token for every sequence,
committing what was written), ``lookup``, ``wait_copies``, ``evict`` and a
conversation's ``next_turn`` (:mod:`akv.testing.manager_tier_rules`). About
half the examples draw a host tier (:data:`HOST_BLOCKS`; the eviction loop is
off in those, see :meth:`ManagerMachine.start`): eviction then demotes, hits
promote, and the tier rules swap sequences out and in (sometimes from a
cancelled scope) and free them swapped out. After each step the machine plays
the model runner: it waits for the step's copies and writes each new token's
K/V (a function of the namespace and the sequence's own token history, from
the model's record) through the slot mapping the step returned. After every
rule it checks that every live sequence reads back exactly its own history's
K/V through its block table, that the block states of both tiers add up and
match the model's refcounts and swapped-out sequences, that prefix hits and
evictions are ones the model allows, and that ``check()`` passes; then it
overwrites every free block with NaN (:meth:`ManagerMachineBase.poison_kv`),
so a missing copy cannot hide behind a block that still holds the right K/V.

Run it against your own storage or manager by overriding the hooks::

    class MyMachine(ManagerMachine):
        def make_manager(self, config):
            return MyManager(config)          # e.g. a manager over your storage

        def write_kv(self, slots, values):    # how your runner writes K/V
            ...

        def read_kv(self, block_ids, num_tokens):
            ...

    TestMyMachine = MyMachine.TestCase
"""

from __future__ import annotations

import importlib.util
from collections.abc import Hashable
from typing import Any

import anyio
import anyio.from_thread
import torch
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from akv.core.eviction_policy import EVICTION_POLICIES
from akv.core.step import Admit
from akv.errors import PoolExhausted, RequestTooLarge, UnknownSequence
from akv.manager import KVCacheManager
from akv.testing.manager_checks import ManagerMachineBase
from akv.testing.manager_tier_rules import TierRules
from akv.testing.step_plans import INVALID, WATERMARKS, StepPlan, draw_plan, draw_prompt, draw_tokens

__all__ = ["HOST_BLOCKS", "ManagerMachine", "TestManagerMachine"]

#: Host-tier sizes an example draws from (0: none): a tier in about half the examples (first: hypothesis
#: favours it), one of them small enough to fill.
HOST_BLOCKS = (24, 0, 8, 0)


async def _free_in_cancelled_scope(kv: KVCacheManager, seq_id: Hashable, *, preempted: bool) -> bool:
    """``kv.free`` from a task whose scope is already cancelled (a request cancelled mid-flight)."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        return await kv.free(seq_id, preempted=preempted)


def _backends() -> tuple[str, ...]:
    return ("asyncio", "trio") if importlib.util.find_spec("trio") else ("asyncio",)


class ManagerMachine(TierRules, ManagerMachineBase):
    """KVCacheManager with real tensors against the plain model: the rules (see the module docstring)."""

    @initialize(
        num_shards=st.integers(1, 4),
        watermarks=st.sampled_from(WATERMARKS),
        policy=st.sampled_from(sorted(EVICTION_POLICIES)),
        backend=st.sampled_from(_backends()),
        host_blocks=st.sampled_from(HOST_BLOCKS),
    )
    def start(
        self, num_shards: int, watermarks: tuple[float, float], policy: str, backend: str, host_blocks: int
    ) -> None:
        """Enter a fresh manager in a blocking portal."""
        if host_blocks:
            # The eviction loop's demotions keep blocks in flight until their copies ran, at moments the
            # machine cannot see; the exact room checks of appends and swap-ins need none in flight. The
            # evict rule exercises those held demotions at known points instead.
            watermarks = (0.0, 0.0)
        note(f"start: {num_shards} shards, watermarks {watermarks}, policy {policy}, {backend}, host {host_blocks}")
        event(f"{backend}, {num_shards} shards")
        event("host tier" if host_blocks else "no host tier")
        self.num_shards = num_shards
        self.host_blocks = host_blocks
        config = self.make_config(
            num_shards=num_shards, watermarks=watermarks, eviction_policy=policy, host_blocks=host_blocks
        )
        self._portal_cm = anyio.from_thread.start_blocking_portal(backend)
        self._portal = self._portal_cm.__enter__()
        self.kv = self.make_manager(config)
        self._kv_cm = self._portal.wrap_async_context_manager(self.kv)
        self._kv_cm.__enter__()

    # ---------------------------------------------------------------- drawing
    def _draw_prompt(self, data: st.DataObject) -> list[int]:
        return draw_prompt(data, self.num_blocks * self.block_size // self.num_shards)

    def _draw_tokens(self, data: st.DataObject) -> Any:
        return draw_tokens(data, self.num_blocks * self.block_size + 1)

    def _draw_plan(self, data: st.DataObject) -> StepPlan:
        return draw_plan(
            data,
            self.model,
            self.preempted,
            live=self._live(),
            new_id=self._fresh_id,
            max_sequences=self.max_sequences,
            namespaces=self.namespaces,
            prompt=self._draw_prompt,
            tokens=self._draw_tokens,
        )

    # ---------------------------------------------------------------- rules
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler step of every kind of item, drawn together."""
        plan = self._draw_plan(data)
        note(f"step {plan}")
        result = self._call(
            self.kv.step,
            frees=plan.frees,
            preempted=plan.preempted,
            commits=plan.commits,
            forks=plan.forks,
            appends=plan.appends,
            admits=plan.admits,
        )
        self._run_step(plan, result, data)

    @precondition(lambda self: self.model.sequences)
    @rule(data=st.data(), token=st.sampled_from([0, 1, 2]))
    def decode(self, data: st.DataObject, token: int) -> None:
        """A decode-loop step: commit what each sequence wrote, append one int token to every one."""
        live = self._live()
        plan = StepPlan(
            commits={s: len(self.model.sequences[s].tokens) - self.model.sequences[s].committed for s in live},
            appends=dict.fromkeys(live, token),
        )
        note(f"decode {plan}")
        result = self._call(self.kv.step, commits=plan.commits, appends=plan.appends)
        self._run_step(plan, result, data)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        """A router's lookup: the hit must be one the model allows; a short one reveals evictions."""
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        histories = [seq.tokens for seq in self.model.sequences.values()] + [h for _, h in self.preempted.values()]
        histories += [seq.tokens for seq in self.model.swapped.values()]
        tokens = data.draw(st.sampled_from(histories), label="history") if histories else []
        tokens = tokens[: data.draw(st.integers(1, 40), label="cut")] if tokens else self._draw_prompt(data)
        cached = self._call(self.kv.lookup, tokens, namespace=namespace)
        note(f"lookup ns={namespace!r} {tokens} -> {cached}")
        assert cached % self.block_size == 0, f"lookup returned {cached} tokens, not whole blocks"
        limit = (len(tokens) - 1) // self.block_size
        self.model.observe_lookup(namespace, tokens, limit, cached // self.block_size, self.num_shards)
        event("lookup hit" if cached else "lookup miss")

    @rule()
    def wait_copies(self) -> None:
        """``wait_copies`` completes every copy-on-write copy submitted so far."""
        self._call(self.kv.wait_copies)
        assert all(c.done() for c in self._copies), "wait_copies returned with a copy still pending"
        self._copies.clear()

    @rule(
        data=st.data(),
        kind=st.sampled_from(["add_sequence", "append", "commit", "fork", "free", "free cancelled", "preempt"]),
    )
    def one_sequence(self, data: st.DataObject, kind: str) -> None:
        """One of the one-sequence helpers (each is a one-item step)."""
        live = self._live()
        if kind == "add_sequence" or not live:
            if len(live) < self.max_sequences:
                self._add_sequence(data)
            return
        sid = data.draw(st.sampled_from(live), label="seq")
        seq = self.model.sequences[sid]
        note(f"{kind} {sid}")
        if kind == "append":
            tokens = self._draw_tokens(data)
            try:
                result = self._call(self.kv.append, sid, tokens)
            except (PoolExhausted, RequestTooLarge) as err:
                k = 1 if isinstance(tokens, int) else len(tokens)
                if self._check_append_room(sid, k, err):
                    self._retry_append(sid, tokens, err, data)
                    return
                self._check_rejection(sid, err, len(seq.tokens) + k, seq.shard)
                return
            self._run_step(StepPlan(appends={sid: tokens}), result, data)
        elif kind == "commit":
            n = len(seq.tokens) - seq.committed
            self._call(self.kv.commit, sid, n)
            self.model.commit({sid: n}, lambda s: self._call(self.kv.sequence, s).num_published_blocks)
        elif kind == "fork":
            if len(live) < self.max_sequences:
                kid = self._fresh_id()
                self._call(self.kv.fork, sid, [kid])
                self.model.fork(sid, [kid])
        else:
            free = _free_in_cancelled_scope if kind == "free cancelled" else type(self.kv).free
            assert self._call(free, self.kv, sid, preempted=kind == "preempt") is True, f"{sid} was live"
            assert self._call(self.kv.free, sid) is False, f"a second free of {sid} found it live"
            self.model.sequences.pop(sid)
            if kind == "preempt":
                self.preempted[sid] = (seq.namespace, seq.tokens)

    def _add_sequence(self, data: st.DataObject) -> None:
        """``add_sequence``; then write the prompt's K/V through the block table (it returns no slot mapping)."""
        bs = self.block_size
        sid = self._fresh_id()
        ns = data.draw(st.sampled_from(self.namespaces), label="namespace")
        prompt = self._draw_prompt(data)
        note(f"add_sequence {sid} ns={ns!r} {prompt}")
        try:
            cached = self._call(self.kv.add_sequence, sid, prompt, namespace=ns)
        except (PoolExhausted, RequestTooLarge) as err:
            self._check_rejection(sid, err, len(prompt), None)
            return
        self._admitted(Admit(seq_id=sid, prompt=prompt, namespace=ns), cached)
        table = self._call(self.kv.sequence, sid).block_ids
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached, len(prompt))], dtype=torch.int64)
        self.write_kv(slots, self.expected_kv(ns, prompt)[:, :, cached:])

    @rule(data=st.data(), kind=st.sampled_from(sorted(INVALID)))
    def invalid_step(self, data: st.DataObject, kind: str) -> None:
        """A step with one bad item (and a valid admission beside it) raises its typed error and applies nothing."""
        live = self._live()
        sid = data.draw(st.sampled_from(live), label="seq") if live else None
        if sid is None and kind not in ("commit unknown", "fork unknown", "empty prompt", "negative token"):
            kind = "commit unknown"
        error, items = INVALID[kind]
        kw = items(sid, self.model.sequences.get(sid), self.kv.config.vocab_size)
        bystander = Admit(seq_id=self._fresh_id(), prompt=[1, 2, 3, 4, 5])
        kw["admits"] = [bystander, *kw.get("admits", [])]
        note(f"invalid step ({kind}): {kw}")
        try:
            self._call(self.kv.step, **kw)
        except error as err:
            event(f"invalid step: {type(err).__name__}")
        else:
            raise AssertionError(f"{kind}: expected {error.__name__}")
        try:
            self._call(self.kv.sequence, bystander.seq_id)
        except UnknownSequence:
            pass
        else:
            raise AssertionError(f"{kind}: the valid admission beside the bad item was applied")


ManagerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerMachine = ManagerMachine.TestCase
