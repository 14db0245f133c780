"""Messages served by the pool shard actor (frozen, slotted dataclasses), and the vote shared by a multi-shard step's parts."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.core.step import StepRequest
from akv.errors import AkvError


@dataclass(frozen=True, slots=True)
class Step:
    """Apply a :class:`~akv.core.step.StepRequest`; reply ``StepOutcome`` plus a copy ticket.

    ``context`` is the caller's OpenTelemetry context: the shard's span is its child.

    Without a ``vote`` the shard validates and applies the request in one go
    (raising its input error with nothing applied). With one, the request is
    part ``part`` of a step split over several shards, each sent exactly one
    ``Step``: the shard validates its part, records the verdict in the shared
    :class:`StepVote` and replies None; the shard that casts the last vote
    applies every part, or none if a part was refused (:meth:`StepVote.finish`);
    the caller reads the outcomes (or the refusal) from the vote.
    """

    request: StepRequest
    context: Any = None
    vote: StepVote | None = None
    part: int = 0


class StepVote:
    """The all-or-nothing decision of one step split over several shards, shared by its ``Step`` parts.

    Each part's shard validates its part (on its own task, or on the caller's
    on the direct path) and calls :meth:`accept` or :meth:`refuse`. Nothing is
    applied before the last part has voted; the shard casting that vote calls
    :meth:`finish`, which applies every accepted part, in part order, each
    through the shard that accepted it, if no part was refused, and nothing
    if one was. No handler waits for this: a shard that has voted goes on
    serving other messages, which see it as it was before the step until the
    decision. The sender keeps every other step away from the shards until
    the vote is decided (the manager's sharded lock); the only other message
    that changes a shard, an eviction, only turns cached blocks into free
    ones, which no validated part can be hurt by.

    Attributes:
        num_parts: Parts of the step (one per shard it touches).
        error: The refusal of the lowest refused part (for the caller to raise), or None.
        results: Part index -> the ``(StepOutcome, copy ticket)`` its shard
            applied, filled by :meth:`finish` when no part was refused.
    """

    __slots__ = ("_accepted", "_error_part", "_voted", "error", "num_parts", "results")

    def __init__(self, num_parts: int) -> None:
        self.num_parts = num_parts
        self.error: AkvError | None = None
        self._error_part = num_parts
        self.results: dict[int, tuple[Any, Any]] = {}
        self._accepted: list[tuple[int, Any, Step]] = []
        self._voted = 0

    @property
    def complete(self) -> bool:
        """Whether every part has voted."""
        return self._voted == self.num_parts

    def accept(self, part: int, shard: Any, msg: Step) -> None:
        """Part ``part`` is valid on ``shard``, which applies ``msg`` (``shard.apply_step``) unless a part is refused."""
        self._accepted.append((part, shard, msg))
        self._voted += 1

    def refuse(self, part: int, error: AkvError) -> None:
        """Part ``part`` is invalid: the step applies nowhere; the lowest refused part's ``error`` is kept."""
        if part < self._error_part:
            self.error, self._error_part = error, part
        self._voted += 1

    def finish(self, current: Any) -> None:
        """Apply every accepted part through its shard unless a part was refused; the last voter calls it.

        Args:
            current: The shard casting the last vote: it publishes its snapshot
                once its own message is done; every other shard publishes right
                after its part is applied.
        """
        accepted, self._accepted = self._accepted, []
        if self.error is not None:
            return
        accepted.sort(key=lambda item: item[0])
        for part, shard, msg in accepted:
            self.results[part] = shard.apply_step(msg, publish=shard is not current)


@dataclass(frozen=True, slots=True)
class Evict:
    """Evict up to ``max_blocks`` cached blocks; reply the number evicted."""

    max_blocks: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Swap live ``seq_id`` out to the host tier; reply ``(blocks, copy ticket or None)`` (see :mod:`akv.core.swap`)."""

    seq_id: Hashable


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Swap ``seq_id`` back in from the host tier; reply ``(blocks, copy ticket or None)``."""

    seq_id: Hashable


@dataclass(frozen=True, slots=True)
class Retire:
    """Retire the prefix cache of ``namespace`` (``cache_reset.ALL_NAMESPACES``: all); reply ``(retired, freed)``.

    ``event`` says what the shard's cache events say (with events on):
    ``"removed"`` a ``BlockRemoved`` per retired key; ``"cleared"`` one
    ``AllBlocksCleared`` (only when every shard retires all, in one batch
    with no other change between the shards' parts); ``"silent"`` nothing
    (the other shards of such a batch: the first one's event covers them).
    """

    namespace: Hashable
    event: str = "removed"


@dataclass(frozen=True, slots=True)
class Lookup:
    """Reply the number of leading full blocks of ``prompt`` (int32 ``(n,)``) cached now; no side effects."""

    namespace: Hashable
    prompt: np.ndarray


@dataclass(frozen=True, slots=True)
class Inspect:
    """Reply a :class:`~akv.actors.pool_shard.SequenceInfo` snapshot of one sequence."""

    seq_id: Hashable


@dataclass(frozen=True, slots=True)
class InspectBlock:
    """Reply a :class:`~akv.results.BlockInfo` snapshot of one block this shard owns (read-only)."""

    block_id: int


@dataclass(frozen=True, slots=True)
class Room:
    """Reply ``(need, free, evictable)`` blocks for appending ``num_tokens`` to ``seq_id`` (see ``ShardState.room``)."""

    seq_id: Hashable
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Reply the shard's :class:`~akv.actors.shard_snapshot.ShardSnapshot`, published after settling finished copies."""


@dataclass(frozen=True, slots=True)
class SettleCopies:
    """Settle the copy batches that finished (what every message does first) and publish the snapshot; reply None.

    Served by the shard itself, on the event loop, when a batch finishes while
    it is idle (:meth:`~akv.actors.shard_copies.ShardCopies._copy_finished`).
    """


@dataclass(frozen=True, slots=True)
class PendingCopies:
    """Reply the copy tickets of the shard's batches not settled yet (steps', evictions', swaps'), oldest first."""


@dataclass(frozen=True, slots=True)
class Check:
    """Run the full consistency check of the shard and its prefix tree; reply None or raise."""
