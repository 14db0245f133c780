"""Stateful property test of the whole manager: KVCacheManager, its actors and real K/V tensors.

:class:`ManagerMachine` runs a real :class:`~akv.manager.KVCacheManager` (pool
shards, eviction loop, stream worker) in an anyio blocking portal, so every
rule is a plain synchronous call, and keeps the plain model of
:mod:`akv.testing.prefix_model` beside it. Each example draws 1-4 shards, an
eviction policy, watermarks (the eviction loop off, or evicting in the
background between and during rules) and an event-loop backend.

Rules: scheduler steps mixing frees, preemptions, commits, forks, appends and
admissions (new and resumed), a decode step (one token for every sequence,
committing what was written), ``lookup``, ``wait_copies``. After each step
the machine plays the model runner: it waits for the copy-on-write copies and
writes each new token's K/V (a function of the namespace and the sequence's
own token history, from the model's record) through the slot mapping the
step returned. After every rule it checks that every live sequence reads back
exactly its own history's K/V through its block table, that the block states
add up and match the model's refcounts, that prefix hits and evictions are
ones the model allows, and that ``check()`` passes.

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

import functools
import importlib.util
from collections.abc import Hashable
from typing import Any

import anyio
import anyio.from_thread
import torch
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.core.eviction_policy import EVICTION_POLICIES
from akv.core.step import Admit
from akv.errors import (
    PoolExhausted,
    RequestTooLarge,
    UnknownSequence,
)
from akv.manager import KVCacheManager
from akv.results import StepResult
from akv.testing.prefix_model import PrefixModel, history_values
from akv.testing.step_plans import INVALID, WATERMARKS, StepPlan, draw_plan, draw_prompt, draw_tokens

__all__ = ["ManagerMachine", "TestManagerMachine"]


async def _free_in_cancelled_scope(kv: KVCacheManager, seq_id: Hashable, *, preempted: bool) -> bool:
    """``kv.free`` from a task whose scope is already cancelled (a request cancelled mid-flight)."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        return await kv.free(seq_id, preempted=preempted)


def _backends() -> tuple[str, ...]:
    return ("asyncio", "trio") if importlib.util.find_spec("trio") else ("asyncio",)


class ManagerMachine(RuleBasedStateMachine):
    """KVCacheManager with real tensors against :class:`~akv.testing.prefix_model.PrefixModel`.

    Sizes are class attributes; the manager, its configuration and the K/V
    reads and writes are hooks (:meth:`make_config`, :meth:`make_manager`,
    :meth:`write_kv`, :meth:`read_kv`) to override for another storage.
    """

    #: Tokens per block.
    block_size = 4
    #: Blocks in the pool (all shards): small, so exhaustion and eviction happen often.
    num_blocks = 32
    #: Live sequences at most.
    max_sequences = 8
    #: Prefix-cache namespaces the prompts use.
    namespaces: tuple[Hashable, ...] = (None, "tenant-b")

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.model = PrefixModel(self.block_size)
        #: Preempted sequence id -> (namespace, token history), to resume.
        self.preempted: dict[Hashable, tuple[Hashable, list[int]]] = {}
        #: Model block id -> the real block id last seen for it.
        self.real_of: dict[int, int] = {}
        self.num_shards = 1
        self._copies: list = []
        self._next_id = 0
        self._portal: Any = None
        self._portal_cm: Any = None
        self._kv_cm: Any = None

    # ---------------------------------------------------------------- hooks
    def make_config(self, *, num_shards: int, watermarks: tuple[float, float], eviction_policy: str) -> KVCacheConfig:
        """The configuration of one example's manager (tiny model, CPU tensors)."""
        return KVCacheConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            model=MODEL_SHAPES["tiny"],
            storage="tensors",
            num_shards=num_shards,
            low_watermark=watermarks[0],
            high_watermark=watermarks[1],
            eviction_batch_blocks=2,
            eviction_policy=eviction_policy,
        )

    def make_manager(self, config: KVCacheConfig) -> KVCacheManager:
        """The manager under test (entered by the machine in its portal)."""
        return KVCacheManager(config)

    def write_kv(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write new tokens' K/V as the model runner does.

        Args:
            slots: int64 ``(n,)`` slot mapping of the tokens.
            values: float32 ``(num_layers, 2, n, num_kv_heads, head_dim)``, K then V.
        """
        storage = self.kv.storage
        values = values.to(storage.kv_caches[0].dtype)
        storage.write_all_layers(slots, values[:, 0], values[:, 1])

    def read_kv(self, block_ids: tuple[int, ...], num_tokens: int) -> torch.Tensor:
        """Read a sequence's K/V back through its block table.

        Returns:
            ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` in the cache dtype.
        """
        storage = self.kv.storage
        table = torch.tensor(block_ids, dtype=torch.int64)
        layers = [torch.stack(storage.gather(layer, table, num_tokens)) for layer in range(storage.num_layers)]
        return torch.stack(layers)

    def expected_kv(self, namespace: Hashable, tokens: list[int]) -> torch.Tensor:
        """What :meth:`read_kv` must return for a history: :func:`history_values` in the cache dtype."""
        shape = self.kv.config.model
        values = history_values(
            namespace, tokens, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim
        )
        return values.to(self.kv.storage.kv_caches[0].dtype)

    # ---------------------------------------------------------------- plumbing
    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self._portal.call(functools.partial(fn, *args, **kwargs))

    def _fresh_id(self) -> str:
        self._next_id += 1
        return f"s{self._next_id}"

    def _live(self) -> list[Hashable]:
        return sorted(self.model.sequences, key=lambda s: int(str(s)[1:]))

    def teardown(self) -> None:
        try:
            if self._kv_cm is not None:
                self._kv_cm.__exit__(None, None, None)
        finally:
            if self._portal_cm is not None:
                self._portal_cm.__exit__(None, None, None)

    @initialize(
        num_shards=st.integers(1, 4),
        watermarks=st.sampled_from(WATERMARKS),
        policy=st.sampled_from(sorted(EVICTION_POLICIES)),
        backend=st.sampled_from(_backends()),
    )
    def start(self, num_shards: int, watermarks: tuple[float, float], policy: str, backend: str) -> None:
        """Enter a fresh manager in a blocking portal."""
        note(f"start: {num_shards} shards, watermarks {watermarks}, policy {policy}, {backend}")
        event(f"{backend}, {num_shards} shards")
        self.num_shards = num_shards
        config = self.make_config(num_shards=num_shards, watermarks=watermarks, eviction_policy=policy)
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
                self._check_append_room(sid, k, err)
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

    # ---------------------------------------------------------------- applying
    def _run_step(self, plan: StepPlan, result: StepResult, data: st.DataObject) -> None:
        """Apply a step's result to the model (in the step's order), then write its K/V."""
        model = self.model
        assert sorted(result.freed, key=str) == sorted(plan.frees + plan.preempted, key=str)
        for sid in plan.frees + plan.preempted:
            seq = model.sequences.pop(sid)
            if sid in plan.preempted:
                self.preempted[sid] = (seq.namespace, seq.tokens)
        model.commit(plan.commits, lambda sid: self._call(self.kv.sequence, sid).num_published_blocks)
        for parent, kids in plan.forks:
            model.fork(parent, kids)
        starts = {}
        for sid, tokens in plan.appends.items():
            seq = model.sequences[sid]
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            if not plan.admits:  # no admission's hits are protected: the room is exact
                self._check_append_room(sid, len(tokens), result.rejected.get(sid))
            if sid in result.rejected:
                self._check_rejection(sid, result.rejected[sid], len(seq.tokens) + len(tokens), seq.shard)
                continue
            starts[sid] = len(seq.tokens)
            if model.append(sid, tokens):
                event("copy-on-write")
        for adm in plan.admits:
            if adm.seq_id in result.rejected:
                event(f"admission rejected: {type(result.rejected[adm.seq_id]).__name__}")
                self._check_rejection(adm.seq_id, result.rejected[adm.seq_id], len(adm.prompt), None)
                if adm.resumed:
                    self.preempted[adm.seq_id] = (adm.namespace, list(adm.prompt))
                continue
            self._admitted(adm, result.cached_tokens[adm.seq_id])
            starts[adm.seq_id] = result.cached_tokens[adm.seq_id]
        self._write_rows(result, starts, data)

    def _admitted(self, adm: Admit, cached: int) -> None:
        """Check one admission's hit of ``cached`` tokens against the model and record the new sequence."""
        prompt = list(adm.prompt)
        assert cached % self.block_size == 0 and 0 <= cached < len(prompt), (
            f"{adm.seq_id}: cached {cached} tokens of a {len(prompt)}-token prompt"
        )
        info = self._call(self.kv.sequence, adm.seq_id)
        published = info.num_published_blocks if adm.prefill_done else None
        self.model.admit(adm.seq_id, adm.namespace, info.shard, prompt, cached // self.block_size, published)
        event("admission hit" if cached else "admission miss")

    def _check_append_room(self, sid: Hashable, num_tokens: int, err: Exception | None) -> None:
        """An append is rejected exactly when its new blocks exceed the shard's free plus evictable ones.

        Free plus evictable is the shard's size less the blocks live sequences
        hold, whatever the eviction loop did meanwhile.
        """
        seq = self.model.sequences[sid]
        size = len(self.kv.config.shard_ranges()[seq.shard])
        total, need = self.model.append_need(sid, num_tokens)
        room = size - self.model.held_on(seq.shard)
        if err is None:
            assert total <= size and need <= room, f"{sid}: appended needing {need} blocks with room for {room}"
        elif total > size:
            assert isinstance(err, RequestTooLarge), f"{sid}: {total} blocks of a {size}-block shard, got {err!r}"
        else:
            assert isinstance(err, PoolExhausted) and need > room, f"{sid}: {err!r} with room for {room}"
            assert (err.requested_blocks, err.free_blocks + err.evictable_blocks) == (need, room), (
                f"{sid}: {err!r}, the model expected {need} requested and {room} free or evictable"
            )

    def _check_rejection(self, sid: Hashable, err: Exception, num_tokens: int, shard: int | None) -> None:
        """A rejected append or admission gets the right error type with consistent numbers."""
        sizes = [len(r) for r in self.kv.config.shard_ranges()]
        total = self.model.num_blocks_needed(num_tokens)
        note(f"  {sid} rejected: {err!r}")
        if isinstance(err, RequestTooLarge):
            assert total > (sizes[shard] if shard is not None else min(sizes)), f"{sid}: {err!r} but {total} fit"
        else:
            assert isinstance(err, PoolExhausted), f"{sid}: unexpected rejection {err!r}"
            assert total <= (sizes[shard] if shard is not None else max(sizes)), f"{sid}: {err!r} for {total} blocks"
            assert err.requested_blocks > err.free_blocks + err.evictable_blocks, f"{sid}: {err!r} yet it fits"

    def _write_rows(self, result: StepResult, starts: dict, data: st.DataObject) -> None:
        """Play the model runner: wait for the copies, then write each scheduled row's new K/V."""
        bs = self.block_size
        assert list(result.seq_ids) == list(starts), f"rows {result.seq_ids}, expected {list(starts)}"
        if data.draw(st.booleans(), label="wait on the step's completion"):
            self._call(result.copies.wait)
        else:
            self._call(self.kv.wait_copies)
        self._copies.append(result.copies)
        qsl = result.query_start_loc.tolist()
        for i, sid in enumerate(result.seq_ids):
            seq = self.model.sequences[sid]
            start, end = starts[sid], len(seq.tokens)
            assert int(result.context_lens[i]) == end, f"{sid}: context length {int(result.context_lens[i])}, not {end}"
            slots = result.slot_mapping[qsl[i] : qsl[i + 1]]
            table = result.block_tables[i].tolist()
            expected = [table[p // bs] * bs + p % bs for p in range(start, end)]
            assert slots.tolist() == expected, f"{sid}: slot mapping {slots.tolist()} for block table {table}"
            self.write_kv(slots, self.expected_kv(seq.namespace, seq.tokens)[:, :, start:end])

    # ---------------------------------------------------------------- invariants
    @invariant()
    def reads_back_own_history(self) -> None:
        """Every live sequence's tokens, counts and K/V; model and real blocks correspond one to one."""
        held = self.model.holders()
        real_to_model: dict[int, int] = {}
        for sid, seq in self.model.sequences.items():
            info = self._call(self.kv.sequence, sid)
            assert list(info.token_ids) == seq.tokens, f"{sid}: token history differs from the model"
            assert info.num_computed == seq.committed, f"{sid}: {info.num_computed} computed, not {seq.committed}"
            assert len(info.block_ids) == len(seq.blocks), f"{sid}: {len(info.block_ids)} blocks, not {len(seq.blocks)}"
            for m, r in zip(seq.blocks, info.block_ids):
                assert self.real_of.setdefault(m, r) == r, f"{sid}: model block {m} moved from {self.real_of[m]} to {r}"
                assert real_to_model.setdefault(r, m) == m, f"{sid}: real block {r} stands for two model blocks"
            got = self.read_kv(info.block_ids, len(seq.tokens))
            want = self.expected_kv(seq.namespace, seq.tokens)
            assert torch.equal(got, want), f"{sid}: K/V read back differs from its own history's"
        alive = set(held) | set(self.model.cache.values())
        self.real_of = {m: r for m, r in self.real_of.items() if m in alive}

    @invariant()
    def counts_add_up(self) -> None:
        """Block states add up and match the model's refcounts and cache entries (after copies ran)."""
        self._call(self.kv.wait_copies)
        s = self._call(self.kv.stats)
        assert s.free + s.active + s.cached + s.in_flight == s.num_blocks, s
        assert s.in_flight == 0, f"{s.in_flight} blocks in flight after wait_copies"
        held = self.model.holders()
        assert s.active == len(held), f"{s.active} active blocks, the model holds {len(held)}"
        assert s.num_sequences == len(self.model.sequences)
        # Entries akv evicted but the model has not seen go yet: evicted minus forgotten.
        unseen = s.blocks_evicted - self.model.forgotten
        assert unseen >= 0, f"the model forgot {self.model.forgotten} entries, akv evicted {s.blocks_evicted}"
        idle = sum(1 for m in self.model.cache.values() if not held[m])
        assert s.cached + unseen == idle, f"{s.cached} cached + {unseen} evicted unseen != {idle} idle entries"
        assert s.prefix_cache_blocks + unseen == len(self.model.cache), (
            f"{s.prefix_cache_blocks} in the tree + {unseen} evicted unseen != {len(self.model.cache)} entries"
        )
        if s.eviction_loop_blocks:
            event(f"eviction loop evicted ({self.num_shards} shards)")
        if self.model.forgotten:
            event("evictions seen by the model")

    @invariant()
    def passes_check(self) -> None:
        """The manager's own full consistency check."""
        self._call(self.kv.check)


ManagerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerMachine = ManagerMachine.TestCase
