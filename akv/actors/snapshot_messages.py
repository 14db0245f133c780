"""Messages of snapshot save and load to a pool shard: each runs one :mod:`akv.core.shard_export` method.

A pool shard serves any :class:`SnapshotCall` by calling :meth:`SnapshotCall.apply`
on its :class:`~akv.core.shard_state.ShardState` (synchronously, between two
steps): the save's export is a consistent cut at that message boundary.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np


class SnapshotCall:
    """Base of the snapshot messages: ``apply(state)`` is the shard's reply."""

    __slots__ = ()

    def apply(self, state: Any) -> Any:
        """Run on the shard's state; the return value is the reply."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ExportSnapshot(SnapshotCall):
    """Reply the shard's :class:`~akv.core.shard_export.ShardExport`; ``hold`` holds the blocks for a K/V copy."""

    hold: bool

    def apply(self, state: Any) -> Any:
        """See :meth:`~akv.core.shard_export.ShardExports.export_snapshot`."""
        return state.export_snapshot(hold=self.hold)


@dataclass(frozen=True, slots=True)
class ReleaseHold(SnapshotCall):
    """Stop holding ``block_ids`` (``None``: all) once their K/V are copied out."""

    block_ids: list[int] | None = None

    def apply(self, state: Any) -> None:
        """See :meth:`~akv.core.shard_export.ShardExports.release_hold`."""
        state.release_hold(self.block_ids)


@dataclass(frozen=True, slots=True)
class ImportReserve(SnapshotCall):
    """Allocate blocks for ``tokens`` (``(m, block_size)`` int32) to load, ``on_host`` rows on the host tier; reply their ids."""

    tokens: np.ndarray
    on_host: np.ndarray | None = None

    def apply(self, state: Any) -> list[int]:
        """See :meth:`~akv.core.shard_export.ShardExports.import_reserve`."""
        return state.import_reserve(self.tokens, self.on_host)


@dataclass(frozen=True, slots=True)
class ImportAbort(SnapshotCall):
    """Free the blocks an :class:`ImportReserve` allocated."""

    block_ids: list[int]

    def apply(self, state: Any) -> None:
        """See :meth:`~akv.core.shard_export.ShardExports.import_abort`."""
        state.import_abort(self.block_ids)


@dataclass(frozen=True, slots=True)
class ImportPublish(SnapshotCall):
    """Publish reserved blocks into the prefix cache in the saved eviction order; reply how many."""

    block_ids: list[int]
    parent: np.ndarray
    namespaces: list[Hashable]
    num_hits: np.ndarray
    last_release: np.ndarray
    tokens: np.ndarray

    def apply(self, state: Any) -> int:
        """See :meth:`~akv.core.shard_export.ShardExports.import_publish`."""
        return state.import_publish(
            self.block_ids, self.parent, self.namespaces, self.num_hits, self.last_release, self.tokens
        )


@dataclass(frozen=True, slots=True)
class ExportSequence(SnapshotCall):
    """Reply ``(namespace, token ids, num_computed, block ids)`` of live sequence ``seq_id``."""

    seq_id: Hashable

    def apply(self, state: Any) -> tuple[Hashable, np.ndarray, int, list[int]]:
        """Raises :class:`~akv.errors.UnknownSequence` if ``seq_id`` is not live."""
        seq = state.get(self.seq_id)
        return seq.namespace, state.token_ids(seq), seq.num_computed, seq.block_ids.tolist()
