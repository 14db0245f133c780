"""One stress task's handle on the manager: timed calls, K/V writes, reads checked against the oracle.

A :class:`Client` keeps a :class:`~akv.stress.seq_model.SeqModel` per sequence it owns (token
history, rolling hashes, committed count) and drives the manager the way a
model runner would: admit, write the prefill's K/V through the slot mapping,
commit; append, wait for copy-on-write copies, write, commit; fork; free. It
verifies a sequence by gathering its K/V through its block table and
comparing with :class:`~akv.stress.oracle.KVOracle`.

Ids the client may have created are in :attr:`Client.owned` *before* the call
that creates them is sent, so cleanup by id (``free`` is idempotent) after a
cancellation at any await point leaves nothing behind.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

from akv.core.step import Admit
from akv.errors import PoolExhausted
from akv.manager import KVCacheManager
from akv.stress.audit import PublishRecord
from akv.stress.client_swaps import ClientSwaps
from akv.stress.gate import Gate
from akv.stress.metrics import Metrics
from akv.stress.oracle import KVOracle, extend_hashes
from akv.stress.seq_model import ClientReads, SeqModel

_call_tokens = itertools.count()


class GiveUp(Exception):
    """A program could not get blocks after its retries; it frees what it holds and ends."""


class Client(ClientReads, ClientSwaps):
    """A task's access to the shared manager (reads: :class:`~akv.stress.seq_model.ClientReads`; swap calls:
    :class:`~akv.stress.client_swaps.ClientSwaps`).

    Args:
        kv: The manager (entered; storage must be ``"tensors"``).
        oracle: Expected K/V of token histories.
        metrics: Shared counters.
        rng: The task's own random generator.
        max_retries: ``PoolExhausted`` retries before :class:`GiveUp`.
        log: structlog logger bound to this task.
        name: Prefix of the sequence ids this client creates.
        deadline: ``anyio.current_time()`` after which programs wrap up early.
        call_timeout_s: Seconds after which a pending call raises ``TimeoutError``.
        record: The run's record of committed prefixes (updated right before
            each commit is sent; every admission's hit is checked against it).
        namespaces: Tenants to admit prompts under (one picked per request).
        gate: Closed while the harness audits a quiescent point; every call
            waits for it to open before it is sent.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        oracle: KVOracle,
        metrics: Metrics,
        rng: random.Random,
        *,
        max_retries: int,
        log: Any,
        name: str,
        deadline: float = float("inf"),
        call_timeout_s: float = 30.0,
        record: PublishRecord | None = None,
        namespaces: tuple[Hashable, ...] = (None,),
        gate: Gate | None = None,
    ) -> None:
        self.kv = kv
        self.oracle = oracle
        self.metrics = metrics
        self.rng = rng
        self.max_retries = max_retries
        self.log = log
        self.name = name
        self.deadline = deadline
        self.call_timeout_s = call_timeout_s
        self.block_size = kv.config.block_size
        self.record = record if record is not None else PublishRecord(self.block_size)
        self.namespaces = namespaces
        self.gate = gate if gate is not None else Gate()
        #: Ids freed from inside a cancelled scope: they must not be live any more.
        self.freed_when_cancelled: set[Hashable] = set()
        #: Ids that may be live in the manager (cleanup frees them all).
        self.owned: set[Hashable] = set()
        #: Swapped-out id -> host blocks it holds (see :class:`~akv.stress.client_swaps.ClientSwaps`).
        self.swapped: dict[Hashable, int] = {}
        #: ``(namespace, token history)`` of this task's finished chats, newest last (continued by later prompts).
        self.conversations: list[tuple[Hashable, list[int]]] = []
        self._ids = itertools.count()

    @property
    def host_tier(self) -> bool:
        """Whether the manager has a host-memory tier (swaps and continuations are then part of the programs)."""
        return self.kv.config.num_host_blocks > 0

    def expired(self) -> bool:
        """Whether the run's deadline has passed (programs then skip their remaining rounds)."""
        return anyio.current_time() >= self.deadline

    def new_id(self, tag: str) -> str:
        """A sequence id unique in the run."""
        return f"{self.name}-{tag}{next(self._ids)}"

    # --------------------------------------------------------------- calls
    async def call(
        self,
        op: str,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        before: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Await ``fn(*args, **kwargs)``, timing it as operation ``op`` (also when it fails).

        The call first waits while the audit gate is closed, then runs
        ``before()`` (what must be recorded before the manager sees the call).
        """
        await self.gate.enter()
        if before is not None:
            before()
        token = next(_call_tokens)
        start = time.perf_counter()
        self.metrics.in_flight[token] = (op, start)
        try:
            # A hang becomes a TimeoutError where the await can be interrupted; the
            # manager's shielded actor asks cannot be, so the runner's monitor also
            # counts every call pending longer than the hang timeout.
            with anyio.fail_after(self.call_timeout_s):
                return await fn(*args, **kwargs)
        finally:
            del self.metrics.in_flight[token]
            self.metrics.record(op, time.perf_counter() - start)
            self.gate.leave()

    async def retrying(self, what: str, attempt: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``attempt`` until it does not raise ``PoolExhausted``; back off with jitter between tries.

        Raises:
            GiveUp: Still exhausted after ``max_retries`` retries.
        """
        for i in itertools.count():
            try:
                return await attempt()
            except PoolExhausted:
                if i >= self.max_retries:
                    raise GiveUp(what) from None
                self.metrics.retries += 1
                await anyio.sleep(self.rng.uniform(0.0005, 0.002) * min(i + 1, 10))
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------ writing
    def write(self, seq: SeqModel, slots: torch.Tensor, start: int, stop: int) -> None:
        """Write the K/V of positions ``[start, stop)`` of ``seq`` to ``slots`` in every layer."""
        if stop <= start:
            return
        expected = seq.expected(self.oracle, start, stop)  # (L, 2, n, H, D), K then V
        self.kv.storage.write_all_layers(slots, expected[:, 0], expected[:, 1])

    # ---------------------------------------------------------- operations
    async def admit(
        self, prompt: list[int], *, commit: bool = True, write_fraction: float = 1.0, namespace: Hashable = ...
    ) -> SeqModel:
        """Add a sequence, write its prefill's K/V (the non-cached tokens) and commit it.

        Half of the admissions go through ``step(admits=...)`` and its slot
        mapping, the other half through ``add_sequence`` plus ``sequence()``
        (slots computed from the block table).

        Args:
            prompt: Token ids.
            commit: Commit the prefill (``False``: an abort before commit).
            write_fraction: Fraction of the prefill tokens actually written
                (an aborted prefill may stop early).
            namespace: The tenant (default: one at random).

        Raises:
            GiveUp: The pool stayed exhausted.
        """
        seq_id = self.new_id("s")
        self.owned.add(seq_id)
        ns = self.rng.choice(self.namespaces)  # drawn either way: the same draws as without a namespace
        if namespace is not ...:
            ns = namespace
        seq = SeqModel(seq_id, list(prompt), [], namespace=ns)
        extend_hashes(seq.hashes, prompt)
        arr = np.asarray(prompt, dtype=np.int32)
        if self.rng.random() < 0.5:

            async def attempt() -> tuple[int, torch.Tensor, Any]:
                admit = Admit(seq_id=seq_id, prompt=arr, namespace=ns)
                result = await self.call("add", self.kv.step, admits=[admit])
                if seq_id in result.rejected:
                    raise result.rejected[seq_id]
                return result.cached_tokens[seq_id], result.slot_mapping, result.copies

            cached, slots, copies = await self.retrying("add", attempt)
            if copies.tickets:  # host tier: promotions into its blocks, demotions for its room
                await self.call("copy_wait", copies.wait)
        else:  # add_sequence returns once its copies ran
            cached = await self.retrying(
                "add", lambda: self.call("add_sequence", self.kv.add_sequence, seq_id, arr, namespace=ns)
            )
            info = await self.call("sequence", self.kv.sequence, seq_id)
            bs = self.block_size
            table = torch.tensor(info.block_ids, dtype=torch.int64)
            pos = torch.arange(cached, len(prompt), dtype=torch.int64)
            slots = table[pos // bs] * bs + pos % bs
        self._check_cached(seq, cached)
        seq.committed = cached
        seq.recorded_blocks = cached // self.block_size
        n_write = len(prompt) - cached
        if write_fraction < 1.0:
            n_write = int(n_write * write_fraction)
        if commit and n_write > 1 and self.rng.random() < 0.3:  # chunked prefill: commit in two parts
            half = n_write // 2
            self.write(seq, slots[:half], cached, cached + half)
            await self.commit(seq, cached + half)
            await self.lookup(seq.tokens, namespace=seq.namespace)  # no hit beyond what was committed
            await anyio.lowlevel.checkpoint()  # others may admit the same prompt meanwhile
            self.write(seq, slots[half:n_write], cached + half, cached + n_write)
        else:
            self.write(seq, slots[:n_write], cached, cached + n_write)
        if commit:
            await self.commit(seq, len(prompt))
        return seq

    def _check_cached(self, seq: SeqModel, cached: int) -> None:
        """An admission's hit: whole blocks, never the last token, and only a prefix some task committed."""
        bs, length = self.block_size, len(seq.tokens)
        if cached % bs or cached > (length - 1) // bs * bs:
            self.unexpected("cached_tokens", seq_id=seq.seq_id, cached=cached, prompt_len=length)
        elif not self.record.allows(seq.namespace, seq.tokens, cached):
            self.unexpected("hit_never_committed", seq_id=seq.seq_id, namespace=seq.namespace, cached=cached)

    async def commit(self, seq: SeqModel, upto: int) -> None:
        """Commit ``seq`` up to ``upto`` tokens, recording its newly committed full blocks just before."""
        full = upto // self.block_size

        def record() -> None:
            if full > seq.recorded_blocks:
                self.record.add(seq.namespace, seq.tokens, seq.recorded_blocks, full)
                seq.recorded_blocks = full

        await self.call("commit", self.kv.commit, seq.seq_id, upto - seq.committed, before=record)
        seq.committed = upto

    async def append(self, seq: SeqModel, tokens: list[int]) -> None:
        """Append tokens, wait for copy-on-write copies, write their K/V, commit.

        Raises:
            GiveUp: The pool stayed exhausted.
        """
        payload: Any = tokens[0] if len(tokens) == 1 and self.rng.random() < 0.5 else tokens
        result = await self.retrying("append", lambda: self.call("append", self.kv.append, seq.seq_id, payload))
        if result.copies.tickets:
            await self.call("copy_wait", result.copies.wait)
        seq.extend(tokens)
        self.write(seq, result.slot_mapping, len(seq.tokens) - len(tokens), len(seq.tokens))
        await self.commit(seq, len(seq.tokens))

    def remember(self, seq: SeqModel) -> None:
        """Keep a finished chat's namespace and history for a later prompt to continue (the last four)."""
        self.conversations = [*self.conversations[-3:], (seq.namespace, list(seq.tokens))]

    async def fork(self, parent: SeqModel, n: int) -> list[SeqModel]:
        """Fork ``parent`` into ``n`` children (one step) and return their models."""
        children = [parent.fork(self.new_id("f")) for _ in range(n)]
        self.owned.update(c.seq_id for c in children)
        await self.call("fork", self.kv.fork, parent.seq_id, [c.seq_id for c in children])
        return children

    async def free(self, seq: SeqModel) -> None:
        """Finish a sequence; it must have been live."""
        was_live = await self.call("free", self.kv.free, seq.seq_id)
        self.owned.discard(seq.seq_id)
        if self.swapped.pop(seq.seq_id, None) is not None:
            self.metrics.swapped_frees += 1
        if not was_live:
            self.unexpected("free_of_live_sequence_returned_false", seq_id=seq.seq_id)

    async def free_many(self, seqs: list[SeqModel]) -> None:
        """Finish several sequences in one step (they may share blocks); each must have been live."""
        ids = [s.seq_id for s in seqs]
        result = await self.call("free_many", self.kv.step, frees=ids, want_metadata=False)
        self.owned.difference_update(ids)
        for seq_id in ids:
            if self.swapped.pop(seq_id, None) is not None:
                self.metrics.swapped_frees += 1
        if set(result.freed) != set(ids):
            self.unexpected("multi_free_missed", seq_ids=ids, freed=result.freed)

    async def lookup(self, prompt: list[int], *, namespace: Hashable = ...) -> None:
        """A pure lookup (what a cache-aware router asks); checks its bounds and the record.

        Args:
            prompt: Token ids.
            namespace: The tenant to look up in (default: one at random).
        """
        ns = self.rng.choice(self.namespaces) if namespace is ... else namespace
        hit = await self.call("lookup", self.kv.lookup, prompt, namespace=ns)
        if hit % self.block_size or hit > (len(prompt) - 1) // self.block_size * self.block_size:
            self.unexpected("lookup_bounds", hit=hit, prompt_len=len(prompt))
        elif not self.record.allows(ns, prompt, hit):
            self.unexpected("lookup_hit_never_committed", namespace=ns, hit=hit)

    async def free_cancelled(self) -> None:
        """From inside a cancelled scope: free every owned id with ``kv.free`` alone (akv shields it).

        The harness adds no shield of its own but for the audit gate, so a
        free that is not applied shows: :meth:`cleanup` then finds the id live.
        """
        with anyio.CancelScope(shield=True):
            await self.gate.enter()
        try:
            for seq_id in list(self.owned):
                self.freed_when_cancelled.add(seq_id)
                if await self.kv.free(seq_id):
                    self.metrics.frees_when_cancelled += 1
                if self.swapped.pop(seq_id, None) is not None:
                    self.metrics.swapped_frees += 1
        finally:
            self.gate.leave()

    async def cleanup(self) -> None:
        """Free every id this client may own (idempotent), shielded from cancellation.

        An id freed from a cancelled scope before must be gone already.
        """
        with anyio.CancelScope(shield=True):
            for seq_id in list(self.owned):
                was_live = await self.call("free", self.kv.free, seq_id)
                if was_live and seq_id in self.freed_when_cancelled:
                    self.unexpected("free_in_cancelled_task_not_applied", seq_id=seq_id)
                self.owned.discard(seq_id)
                if self.swapped.pop(seq_id, None) is not None:
                    self.metrics.swapped_frees += 1
            self.freed_when_cancelled.clear()
