"""One instance's cached keys as a router knows them, rebuilt from its event batches.

An :class:`InstanceIndex` applies an instance's batches in sequence order and
keeps, per ``(medium, key)``, a holder count (two shards of one manager may
cache the same key), the parent key and the namespace. It refuses, with the
index unchanged, a batch that repeats or goes back in sequence or that does
not fit the index (a removal of a key it does not hold). A gap (an
:class:`~akv.events.types.EventsDropped` marker, or a batch that skips
numbers) makes it **stale**: its keys are dropped, so it answers 0 until
:meth:`InstanceIndex.resync` loads a snapshot; the batches that arrive in
between are kept and applied on top of the snapshot (those after its
``as_of_seq``). See docs/events.md, "Resync".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

from akv.core.ids import describe
from akv.errors import EventsGap, InvalidInput

from .types import AllBlocksCleared, BlockRemoved, BlockStored, CachedKey, EventBatch

__all__ = ["DEFAULT_MAX_PENDING", "InstanceIndex"]

#: Batches a stale index keeps for its resync before it forgets the oldest.
DEFAULT_MAX_PENDING = 4096


def _apply(batch: EventBatch, entries: dict, present: dict, block_size: int, undo: list | None) -> None:
    """Apply a batch's events to ``entries`` / ``present``, logging old values in ``undo`` (if given).

    Raises:
        InvalidInput: A removal of a key not held, or a block size that is not the router's.
    """
    for event in batch.events:
        kind = type(event)
        if kind is BlockStored:
            if event.block_size != block_size:
                raise InvalidInput(f"batch {batch.seq}: block_size {event.block_size}, the router's is {block_size}")
            parent, medium, namespace = event.parent_block_hash, event.medium, event.namespace
            for key in event.block_hashes:
                slot = (medium, key)
                old = entries.get(slot)
                if undo is not None:
                    undo.append((slot, old, key, present.get(key)))
                entries[slot] = (old[0] + 1, old[1], old[2]) if old else (1, parent, namespace)
                present[key] = present.get(key, 0) + 1
                parent = key
        elif kind is BlockRemoved:
            medium = event.medium
            for key in event.block_hashes:
                slot = (medium, key)
                old = entries.get(slot)
                if old is None:
                    raise InvalidInput(f"batch {batch.seq}: BlockRemoved of {key.hex()} ({medium}), not in the index")
                if undo is not None:
                    undo.append((slot, old, key, present[key]))
                if old[0] == 1:
                    del entries[slot]
                else:
                    entries[slot] = (old[0] - 1, old[1], old[2])
                if present[key] == 1:
                    del present[key]
                else:
                    present[key] -= 1
        elif kind is AllBlocksCleared:
            if undo is not None:
                undo.append((None, dict(entries), None, dict(present)))
            entries.clear()
            present.clear()


def _rollback(undo: list, entries: dict, present: dict) -> None:
    """Undo what :func:`_apply` logged, newest first."""
    for slot, old, key, count in reversed(undo):
        if slot is None:  # an AllBlocksCleared: the whole dicts
            entries.clear()
            entries.update(old)
            present.clear()
            present.update(count)
            continue
        if old is None:
            entries.pop(slot, None)
        else:
            entries[slot] = old
        if count is None:
            present.pop(key, None)
        else:
            present[key] = count


class InstanceIndex:
    """The cached keys of one instance, kept current from its batches (see the module docstring).

    Attributes:
        applied_seq: The sequence number the index is current as of (0:
            nothing applied; while stale, the last one before the gap).
        last_seq_seen: The highest sequence number received (applied,
            skipped as covered by a snapshot, or kept while stale).
        stale: Whether a gap was seen and no resync has followed.

    Args:
        block_size: Tokens per block of the instance.
        max_pending: Batches kept while stale (an int >= 0).

    Raises:
        InvalidInput: ``block_size`` is not an int >= 1 or ``max_pending`` not an int >= 0.
    """

    __slots__ = ("_entries", "_lost_to", "_pending", "_present", "applied_seq", "block_size", "last_seq_seen", "stale")

    def __init__(self, block_size: int, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if type(block_size) is not int or block_size < 1:
            raise InvalidInput(f"block_size must be an int >= 1, got {describe(block_size)}")
        if type(max_pending) is not int or max_pending < 0:
            raise InvalidInput(f"max_pending must be an int >= 0 (batches), got {describe(max_pending)}")
        self.block_size = block_size
        self._entries: dict[tuple[str, bytes], tuple[int, bytes | None, Hashable]] = {}
        self._present: dict[bytes, int] = {}  # key -> holders over every medium
        self._pending: deque[EventBatch] = deque(maxlen=max_pending)
        self._lost_to = 0  # highest seq a full pending buffer forgot
        self.applied_seq = 0
        self.last_seq_seen = 0
        self.stale = False

    def apply(self, batch: EventBatch) -> bool:
        """Apply the next batch of the instance's stream; O(events).

        Returns:
            Whether the index is current (``False``: stale, waiting for a resync).

        Raises:
            InvalidInput: Not a batch; a sequence number not above
                :attr:`last_seq_seen` (a duplicate or out of order); or events
                that do not fit the index. The index is unchanged.
        """
        if type(batch) is not EventBatch:
            raise InvalidInput(f"apply() takes an EventBatch, got {describe(batch)}")
        if batch.seq <= self.last_seq_seen:
            raise InvalidInput(
                f"batch {batch.seq} is a duplicate or out of order: batch {self.last_seq_seen} came already"
            )
        if self.stale:
            self._keep(batch)
            return False
        dropped = batch.dropped
        if batch.seq <= self.applied_seq:
            self.last_seq_seen = batch.seq  # already in the snapshot the index was loaded from
            return True
        if dropped or batch.seq > self.applied_seq + 1:
            self._entries.clear()
            self._present.clear()
            self.stale = True
            self._keep(batch)
            return False
        undo: list = []
        try:
            _apply(batch, self._entries, self._present, self.block_size, undo)
        except InvalidInput:
            _rollback(undo, self._entries, self._present)
            raise
        self.applied_seq = self.last_seq_seen = batch.seq
        return True

    def _keep(self, batch: EventBatch) -> None:
        """Keep a batch that arrived while stale (forgetting the oldest when full)."""
        pending = self._pending
        if pending.maxlen == 0 or len(pending) == pending.maxlen:
            self._lost_to = pending.popleft().seq if pending else batch.seq
        if pending.maxlen:
            pending.append(batch)
        self.last_seq_seen = batch.seq

    def resync(self, cached_keys: Iterable[CachedKey], as_of_seq: int) -> None:
        """Replace the index by a snapshot, then apply the kept batches after ``as_of_seq``.

        All or nothing: on an error the index (and its staleness) is unchanged.

        Args:
            cached_keys: The instance's snapshot (``cached_keys()``): every
                cached key with its parent, namespace and medium.
            as_of_seq: The sequence number the snapshot is current as of.

        Raises:
            EventsGap: The snapshot is older than batches this index already
                applied or forgot, or a kept batch or gap marker leaves a hole
                after it: take a newer snapshot.
            InvalidInput: ``as_of_seq`` is not an int >= 0, an entry is not a
                :class:`CachedKey`, or a kept batch does not fit.
        """
        if type(as_of_seq) is not int or as_of_seq < 0:
            raise InvalidInput(f"as_of_seq must be an int >= 0, got {describe(as_of_seq)}")
        floor = max(self.applied_seq, self._lost_to) if self.stale else self.last_seq_seen
        if as_of_seq < floor:
            raise EventsGap(as_of_seq + 1, floor, "the snapshot is older than batches this index applied or forgot")
        entries, present = self._load(cached_keys)
        expected = as_of_seq + 1
        for batch in self._pending:
            if batch.seq < expected:
                continue
            dropped = batch.dropped
            if dropped:
                raise EventsGap(max(dropped.from_seq, expected), dropped.to_seq, "dropped after the snapshot")
            if batch.seq != expected:
                raise EventsGap(expected, batch.seq - 1, "never received after the snapshot")
            _apply(batch, entries, present, self.block_size, None)
            expected += 1
        self._entries, self._present = entries, present
        self._pending.clear()
        self._lost_to = 0
        self.applied_seq = expected - 1  # >= last_seq_seen: a stream behind the snapshot is skipped up to it
        self.stale = False

    def _load(self, cached_keys: Iterable[CachedKey]) -> tuple[dict, dict]:
        """The entries and holder counts of a snapshot."""
        entries: dict = {}
        present: dict = {}
        for item in cached_keys:
            if type(item) is not CachedKey:
                raise InvalidInput(f"a snapshot holds CachedKey entries, got {describe(item)}")
            slot = (item.medium, item.block_hash)
            old = entries.get(slot)
            entries[slot] = (old[0] + 1, old[1], old[2]) if old else (1, item.parent_block_hash, item.namespace)
            present[item.block_hash] = present.get(item.block_hash, 0) + 1
        return entries, present

    def prefix_blocks(self, keys: Sequence[bytes], medium: str | None = None) -> int:
        """Leading ``keys`` held (in ``medium``, or in any medium for ``None``); O(blocks matched)."""
        count = 0
        if medium is None:
            present = self._present
            for key in keys:
                if key not in present:
                    break
                count += 1
        else:
            entries = self._entries
            for key in keys:
                if (medium, key) not in entries:
                    break
                count += 1
        return count

    def keys(self, medium: str | None = None) -> set[bytes]:
        """The keys held (in ``medium``, or in any medium)."""
        if medium is None:
            return set(self._present)
        return {key for m, key in self._entries if m == medium}

    def entries(self) -> dict[tuple[str, bytes], tuple[int, bytes | None, Hashable]]:
        """A copy of ``(medium, key) -> (holders, parent key, namespace)``."""
        return dict(self._entries)
