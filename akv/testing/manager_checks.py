"""The runner side of :class:`~akv.testing.manager_machine.ManagerMachine`: hooks, steps applied, invariants.

:class:`ManagerMachineBase` holds the manager under test (in an anyio
blocking portal), the hooks an embedder overrides, the model-runner part (apply
a step's result to :class:`~akv.testing.prefix_model.PrefixModel`, wait for
its copies, write its K/V) and the ``@invariant`` checks; the rules live in
:mod:`akv.testing.manager_machine`.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.core.step import Admit
from akv.errors import PoolExhausted
from akv.manager import KVCacheManager
from akv.results import StepResult
from akv.testing.prefix_model import PrefixModel, history_values
from akv.testing.step_plans import StepPlan, check_append_room, check_rejection

__all__ = ["ManagerMachineBase"]


class ManagerMachineBase(RuleBasedStateMachine):
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
        #: Blocks of the example's host tier (0: none).
        self.host_blocks = 0
        self._copies: list = []
        self._next_id = 0
        self._portal: Any = None
        self._portal_cm: Any = None
        self._kv_cm: Any = None

    # ---------------------------------------------------------------- hooks
    def make_config(
        self, *, num_shards: int, watermarks: tuple[float, float], eviction_policy: str, host_blocks: int = 0
    ) -> KVCacheConfig:
        """The configuration of one example's manager (tiny model, CPU tensors; ``host_blocks``: its host tier)."""
        return KVCacheConfig(
            host_blocks=host_blocks,
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

    def poison_kv(self, block_ids: list[int]) -> None:
        """Overwrite free blocks' K/V with NaN: what a freed block held is garbage to its next owner.

        Called after every rule, once no copy is pending, with the blocks
        that are free then, so a missing or late copy (a promotion, a
        swap-in, a copy-on-write) cannot pass unseen because the block it
        lands in happens to hold the right K/V still.

        Args:
            block_ids: Free device blocks.
        """
        idx = torch.tensor(block_ids, dtype=torch.int64)
        for cache in self.kv.storage.kv_caches:  # (2, num_blocks + 1, block_size, num_kv_heads, head_dim)
            cache[:, idx] = float("nan")

    def _poison_free(self) -> int:
        """:meth:`poison_kv` the blocks free now (call once no copy is pending); return how many."""
        free = [b for b in range(self.num_blocks) if self._call(self.kv.block_info, b).state == "free"]
        if free:
            self.poison_kv(free)
        return len(free)

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
        retry = []
        for sid, tokens in plan.appends.items():
            seq = model.sequences[sid]
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            if not plan.admits and self._check_append_room(sid, len(tokens), result.rejected.get(sid)):
                retry.append((sid, tokens, result.rejected[sid]))  # no admission's hits are protected: room is exact
                continue
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
        for sid, tokens, err in retry:
            self._retry_append(sid, tokens, err, data)

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

    def _check_append_room(self, sid: Hashable, num_tokens: int, err: Exception | None) -> bool:
        """:func:`check_append_room`; True for a transient refusal (host tier) the caller must retry."""
        size = len(self.kv.config.shard_ranges()[self.model.sequences[sid].shard])
        transient = check_append_room(self.model, sid, num_tokens, size, err, transient=bool(self.host_blocks))
        if transient:
            note(f"  {sid} refused while host copies ran: {err!r}; retried once they ran")
            event("transient refusal: host tier copies pending")
        return transient

    def _retry_append(self, sid: Hashable, tokens: Any, err: Exception, data: st.DataObject) -> None:
        """A transient refusal's proof: retried once the pending copies ran, the same append succeeds."""
        result = self.retry_until_room(lambda: self.kv.append(sid, tokens), err, f"append to {sid}")
        self._run_step(StepPlan(appends={sid: tokens}), result, data)

    def retry_until_room(self, call: Any, err: Exception, what: str) -> Any:
        """Retry ``call`` (a coroutine function) after each wait for the pending copies until it is served.

        Each pass evicts what the host tier can take then (its demotions
        are in flight until their copies ran, and the blocks above them
        wait), so a request the model says fits may need several; every
        refusal must show progress (more free plus evictable blocks than
        the last), so this ends, and never claim room it lacks.

        Raises:
            AssertionError: A refusal without progress, or inconsistent numbers.
        """
        have = err.free_blocks + err.evictable_blocks
        while True:
            self._call(self.kv.wait_copies)
            try:
                return self._call(call)
            except PoolExhausted as again:
                now = again.free_blocks + again.evictable_blocks
                assert again.requested_blocks > now > have, f"{what}: refused again without progress: {again!r}"
                note(f"  {what} refused again while host copies ran: {again!r}")
                have = now

    def _check_rejection(self, sid: Hashable, err: Exception, num_tokens: int, shard: int | None) -> None:
        note(f"  {sid} rejected: {err!r}")
        sizes = [len(r) for r in self.kv.config.shard_ranges()]
        check_rejection(sid, err, self.model.num_blocks_needed(num_tokens), sizes, shard)

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
        # A cached block keeps its real id while idle, unless a host tier may have moved it (a demoted block
        # promoted again stands for the same model block in a fresh device block): then only held ones are kept.
        alive = set(held) if self.host_blocks else set(held) | set(self.model.cache.values())
        self.real_of = {m: r for m, r in self.real_of.items() if m in alive}

    @invariant()
    def counts_add_up(self) -> None:
        """Block states add up and match the model's refcounts and cache entries (after copies ran)."""
        self._call(self.kv.wait_copies)
        s = self._call(self.kv.stats)
        assert s.free + s.active + s.cached + s.in_flight == s.num_blocks, s
        assert self._poison_free() == s.free, f"blocks free by block_info differ from stats' {s.free}"

        assert s.in_flight == 0, f"{s.in_flight} blocks in flight after wait_copies"
        held = self.model.holders()
        assert s.active == len(held), f"{s.active} active blocks, the model holds {len(held)}"
        assert s.num_sequences == len(self.model.sequences)
        # Entries akv dropped but the model has not seen go yet: dropped minus forgotten. A demoted block is
        # evicted from the device but stays in the cache (on the host); the host tier's own evictions drop.
        dropped = s.blocks_evicted - s.demoted_blocks + s.host_evicted_blocks
        unseen = dropped - self.model.forgotten
        assert unseen >= 0, f"the model forgot {self.model.forgotten} entries, akv dropped {dropped}"
        idle = sum(1 for m in self.model.cache.values() if not held[m])
        cached = s.cached + s.host_cached
        assert cached + unseen == idle, f"{cached} cached (both tiers) + {unseen} dropped unseen != {idle} idle entries"
        assert s.prefix_cache_blocks + unseen == len(self.model.cache), (
            f"{s.prefix_cache_blocks} in the tree + {unseen} dropped unseen != {len(self.model.cache)} entries"
        )
        self._host_counts_add_up(s)
        if s.eviction_loop_blocks:
            event(f"eviction loop evicted ({self.num_shards} shards)")
        if self.model.forgotten:
            event("evictions seen by the model")

    def _host_counts_add_up(self, s: Any) -> None:
        """Host blocks by state add up, nothing in flight, the swapped-out ones exactly the model's."""
        assert s.host_blocks == self.host_blocks, f"{s.host_blocks} host blocks, configured {self.host_blocks}"
        assert s.host_free + s.host_cached + s.host_swapped + s.host_in_flight == s.host_blocks, s
        assert s.host_in_flight == 0, f"{s.host_in_flight} host blocks in flight after wait_copies"
        swapped = self.model.swapped
        assert s.num_swapped == len(swapped), f"{s.num_swapped} swapped out, the model has {len(swapped)}"
        held = sum(len(seq.blocks) for seq in swapped.values())
        assert s.host_swapped == held, f"{s.host_swapped} host blocks swapped, the model's hold {held}"
        if s.demoted_blocks:
            event("demoted")
        if s.promoted_blocks:
            event("promoted")
        if s.host_evicted_blocks:
            event("host tier evicted")

    @invariant()
    def passes_check(self) -> None:
        """The manager's own full consistency check."""
        self._call(self.kv.check)
