"""What a stress task knows about one of its sequences, and the check of what it reads back.

:class:`SeqModel` holds a sequence's token history, rolling hashes and
committed count, and computes the K/V the oracle (:mod:`akv.stress.oracle`)
says it must read back; :class:`ClientReads` (a mixin of
:class:`~akv.stress.client.Client`) reads a sequence through its block
table and counts every block that differs as a corrupted read.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from akv.stress.oracle import KVOracle, extend_hashes


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


class ClientReads:
    """Verification of :class:`~akv.stress.client.Client` (a mixin; uses its attributes)."""

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
