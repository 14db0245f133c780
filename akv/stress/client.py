"""One stress task's handle on the manager: timed calls, K/V writes, reads checked against the oracle.

A :class:`Client` keeps a :class:`SeqModel` per sequence it owns (token
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
from akv.stress.gate import Gate
from akv.stress.metrics import Metrics
from akv.stress.oracle import KVOracle, extend_hashes

_call_tokens = itertools.count()


class GiveUp(Exception):
    """A program could not get blocks after its retries; it frees what it holds and ends."""


class SeqModel:
    """What a task knows about one of its sequences.

    Attributes:
        seq_id: The sequence id.
        tokens: Token history (prompt plus appended tokens).
        hashes: Rolling hash of each token's history (:mod:`akv.stress.oracle`).
        committed: Leading tokens whose K/V is known good: written by this
            task and committed, or served from the prefix cache.
    """

    __slots__ = ("_chunks", "committed", "hashes", "namespace", "recorded_blocks", "seq_id", "tokens")

    def __init__(
        self,
        seq_id: Hashable,
        tokens: list[int],
        hashes: list[int],
        committed: int = 0,
        *,
        namespace: Hashable = None,
        recorded_blocks: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.tokens = tokens
        self.hashes = hashes
        self.committed = committed
        #: Prefix-cache namespace (tenant) of the sequence.
        self.namespace = namespace
        #: Leading full blocks already in the :class:`~akv.stress.audit.PublishRecord`.
        self.recorded_blocks = recorded_blocks
        # Expected K/V of the leading positions, (L, 2, n_i, H, D) chunks in order; computed once per token.
        self._chunks: list[torch.Tensor] = []

    def fork(self, child_id: Hashable) -> SeqModel:
        """The model of a child forked from this sequence now."""
        child = SeqModel(
            child_id,
            list(self.tokens),
            list(self.hashes),
            self.committed,
            namespace=self.namespace,
            recorded_blocks=self.recorded_blocks,
        )
        child._chunks = list(self._chunks)  # tensors are never modified in place: sharing is safe
        return child

    def extend(self, tokens: list[int]) -> None:
        """Record appended tokens (not yet committed)."""
        self.tokens.extend(tokens)
        extend_hashes(self.hashes, tokens)

    def expected(self, oracle: KVOracle, start: int, stop: int) -> torch.Tensor:
        """Expected K/V of positions ``[start, stop)``: ``(L, 2, stop - start, H, D)``, K then V."""
        have = sum(c.shape[2] for c in self._chunks)
        if have < stop:
            self._chunks.append(oracle.values(self.hashes[have:stop]))
        if len(self._chunks) > 1:
            self._chunks = [torch.cat(self._chunks, dim=2)]
        return self._chunks[0][:, :, start:stop]


class Client:
    """A task's access to the shared manager.

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
        self._ids = itertools.count()

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
    async def admit(self, prompt: list[int], *, commit: bool = True, write_fraction: float = 1.0) -> SeqModel:
        """Add a sequence, write its prefill's K/V (the non-cached tokens) and commit it.

        Half of the admissions go through ``step(admits=...)`` and its slot
        mapping, the other half through ``add_sequence`` plus ``sequence()``
        (slots computed from the block table).

        Args:
            prompt: Token ids.
            commit: Commit the prefill (``False``: an abort before commit).
            write_fraction: Fraction of the prefill tokens actually written
                (an aborted prefill may stop early).

        Raises:
            GiveUp: The pool stayed exhausted.
        """
        seq_id = self.new_id("s")
        self.owned.add(seq_id)
        ns = self.rng.choice(self.namespaces)
        seq = SeqModel(seq_id, list(prompt), [], namespace=ns)
        extend_hashes(seq.hashes, prompt)
        arr = np.asarray(prompt, dtype=np.int32)
        if self.rng.random() < 0.5:

            async def attempt() -> tuple[int, torch.Tensor]:
                admit = Admit(seq_id=seq_id, prompt=arr, namespace=ns)
                result = await self.call("add", self.kv.step, admits=[admit])
                if seq_id in result.rejected:
                    raise result.rejected[seq_id]
                return result.cached_tokens[seq_id], result.slot_mapping

            cached, slots = await self.retrying("add", attempt)
        else:
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
        if not was_live:
            self.unexpected("free_of_live_sequence_returned_false", seq_id=seq.seq_id)

    async def free_many(self, seqs: list[SeqModel]) -> None:
        """Finish several sequences in one step (they may share blocks); each must have been live."""
        ids = [s.seq_id for s in seqs]
        result = await self.call("free_many", self.kv.step, frees=ids, want_metadata=False)
        self.owned.difference_update(ids)
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
            self.freed_when_cancelled.clear()

    # ---------------------------------------------------------- verifying
    async def verify(self, seq: SeqModel) -> None:
        """Read the sequence's committed K/V back through its block table and compare with the oracle.

        Every mismatching block is one corrupted read, logged with the
        sequence id, the first bad position and the block id.
        """
        info = await self.call("sequence", self.kv.sequence, seq.seq_id)
        m = self.metrics
        m.verifications += 1
        if info.token_ids != tuple(seq.tokens):
            m.corrupted_reads += 1
            self._corrupt(seq, position=_first_difference(info.token_ids, seq.tokens), block_id=None, what="token_ids")
            return
        n = seq.committed
        if info.num_computed < n:
            self.unexpected("num_computed", seq_id=seq.seq_id, num_computed=info.num_computed, committed=n)
        if n == 0:
            return
        table = torch.tensor(info.block_ids, dtype=torch.int64)
        expected = seq.expected(self.oracle, 0, n)  # (L, 2, n, H, D)
        bad = torch.zeros(n, dtype=torch.bool)
        storage = self.kv.storage
        for layer in range(storage.num_layers):
            key, value = storage.gather(layer, table, n)  # each (n, H, D)
            bad |= (key != expected[layer, 0]).flatten(1).any(1)
            bad |= (value != expected[layer, 1]).flatten(1).any(1)
        m.verified_tokens += n
        if not bool(bad.any()):
            return
        bs = self.block_size
        positions = torch.nonzero(bad).flatten().tolist()
        seen_blocks: set[int] = set()
        for p in positions:
            if p // bs in seen_blocks:
                continue
            seen_blocks.add(p // bs)
            m.corrupted_reads += 1
            self._corrupt(seq, position=p, block_id=info.block_ids[p // bs], what="kv")

    def _corrupt(self, seq: SeqModel, *, position: int | None, block_id: int | None, what: str) -> None:
        event = {
            "event": "corrupted_read",
            "what": what,
            "seq_id": str(seq.seq_id),
            "position": position,
            "block_id": block_id,
        }
        self.metrics.sample(event)
        self.log.error("stress.corrupted_read", what=what, seq_id=seq.seq_id, position=position, block_id=block_id)

    def unexpected(self, what: str, **details: Any) -> None:
        """Count and log something the manager's contract rules out."""
        self.metrics.unexpected_errors += 1
        self.metrics.sample({"event": "unexpected", "what": what, **{k: repr(v) for k, v in details.items()}})
        self.log.error("stress.unexpected", what=what, **details)


def _first_difference(a: tuple[int, ...], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
