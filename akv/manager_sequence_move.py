"""Moving one running sequence between managers: ``snapshot_sequence`` / ``restore_sequence`` (a mixin).

The blob (:mod:`akv.storage.sequence_blob`) holds the sequence's namespace,
token history and the K/V of its computed tokens, checksummed and
fingerprinted. Restoring admits the history as a prompt in the same namespace
(cached prefix blocks are shared, not rewritten), writes the K/V of the
positions the prefix cache did not serve through the slot mapping, and
commits them, so the sequence continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from akv.actors.snapshot_messages import ExportSequence
from akv.core.ids import plain_id
from akv.storage.sequence_blob import SequenceBlob, decode_sequence, encode_sequence


class SequenceMoves:
    """A mixin of :class:`~akv.manager.KVCacheManager` (uses its attributes)."""

    __slots__ = ()

    async def snapshot_sequence(self, seq_id: Hashable) -> bytes:
        """A live sequence's tokens and computed K/V as checksummed, fingerprinted bytes.

        Call it at a step boundary (after the model runner wrote the K/V of
        every committed token); pending copy-on-write copies are waited for.

        Args:
            seq_id: A live sequence.

        Returns:
            The blob (its layout: :mod:`akv.storage.sequence_blob`); in
            metadata mode, tokens only.

        Raises:
            InvalidInput: ``seq_id`` is not a plain value.
            UnknownSequence: ``seq_id`` is not live.
            ManagerClosed, ActorCrashed: The manager is not running.
        """
        seq_id = plain_id(seq_id, "seq_id of snapshot_sequence()")
        self._check_running()
        shard = self._shards[0] if len(self._shards) == 1 else self._shards[self._shard_map.owner(seq_id)]
        with self._tracer.span("akv.snapshot_sequence", attributes={"akv.seq_id": str(seq_id)}):
            await self.wait_copies()
            namespace, tokens, computed, block_ids = await self._ask(shard, ExportSequence(seq_id))
            layers = None
            if self.storage is not None:
                table = torch.tensor(block_ids, dtype=torch.int64)
                layers = [self.storage.gather(layer, table, computed) for layer in range(self.config.model.num_layers)]
            blob = SequenceBlob(namespace=namespace, tokens=tokens, num_computed=computed, layers=layers)
            data = encode_sequence(self.config, blob)
        self.log.info("sequence.snapshot", seq_id=seq_id, num_tokens=len(tokens), bytes=len(data))
        return data

    async def restore_sequence(self, seq_id: Hashable, data: bytes) -> int:
        """Add ``seq_id`` from a :meth:`snapshot_sequence` blob: its history, K/V and computed count.

        Args:
            seq_id: A new sequence id.
            data: The blob.

        Returns:
            Tokens of the history served from the prefix cache here (their
            K/V are the cache's; the rest are written from the blob).

        Raises:
            SnapshotError: A corrupt, truncated or foreign blob (nothing is added).
            InvalidInput, DuplicateSequence, PoolExhausted, RequestTooLarge:
                As :meth:`add_sequence` (nothing is added).
            ManagerClosed, ActorCrashed: The manager is not running.
        """
        seq_id = plain_id(seq_id, "seq_id of restore_sequence()")
        blob = decode_sequence(self.config, data)
        with self._tracer.span("akv.restore_sequence", attributes={"akv.seq_id": str(seq_id)}):
            cached = await self.add_sequence(seq_id, blob.tokens, namespace=blob.namespace)
            try:
                if self.storage is not None and blob.num_computed > cached:
                    await self._write_history(seq_id, blob, cached)
                if blob.num_computed > cached:
                    await self.commit(seq_id, blob.num_computed - cached)
            except BaseException:
                await self.free(seq_id)  # shielded: nothing of a failed restore stays
                raise
        self.log.info("sequence.restored", seq_id=seq_id, num_tokens=len(blob.tokens), cached_tokens=cached)
        return cached

    async def _write_history(self, seq_id: Hashable, blob: SequenceBlob, start: int) -> None:
        """Write the blob's K/V of positions ``start..num_computed`` through the sequence's slot mapping."""
        storage, bs = self.storage, self.config.block_size
        block_ids = (await self.sequence(seq_id)).block_ids
        positions = torch.arange(start, blob.num_computed, dtype=torch.int64)
        slots = (torch.tensor(block_ids, dtype=torch.int64)[positions // bs] * bs + positions % bs).to(storage.device)
        for layer, (key, value) in enumerate(blob.layers):
            storage.write(layer, slots, key[start:].to(storage.device), value[start:].to(storage.device))
