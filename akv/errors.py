"""Typed errors raised by akv.

Every error a caller can provoke derives from :class:`AkvError`. Errors are
raised before any state is changed: after one of them the manager holds exactly
the blocks, sequences and cache entries it held before the call.

Expected shortage (the pool cannot serve a request right now) is
:class:`PoolExhausted`, a transient condition the scheduler handles by waiting,
preempting or retrying. Misuse (bad tokens, unknown sequences, a request that
can never fit) is permanent.
"""

from __future__ import annotations


class AkvError(Exception):
    """Base class of every error akv raises on purpose."""


class InvalidInput(AkvError, ValueError):
    """An argument is malformed (bad token ids, empty prompt, bad counts).

    Subclasses ``ValueError`` so generic input handling in a serving stack also
    catches it.
    """


class InvalidTokens(InvalidInput):
    """Token ids are not integers in ``[0, vocab_size)`` or the list is empty."""


class UnknownSequence(AkvError, KeyError):
    """The sequence id was never added or has already been freed (or is not live: swapped out).

    Args:
        seq_id: The id.
        state: What it is instead, for the message (e.g. ``"swapped out"``);
            ``None``: unknown or finished.
    """

    def __init__(self, seq_id: object, state: str | None = None) -> None:
        super().__init__(seq_id)
        self.seq_id = seq_id
        self.state = state

    def __str__(self) -> str:
        if self.state is not None:
            return f"sequence {self.seq_id!r} is {self.state}"
        return f"unknown or finished sequence {self.seq_id!r}"


class DuplicateSequence(InvalidInput):
    """A sequence with this id already exists."""

    def __init__(self, seq_id: object, detail: str = "") -> None:
        super().__init__(f"sequence {seq_id!r} already exists{detail}")
        self.seq_id = seq_id


class PoolExhausted(AkvError):
    """Transient: not enough free plus evictable blocks for this call right now.

    Attributes:
        requested_blocks: Blocks the call needed.
        free_blocks: Free blocks the call could use when it was made: those
            no reservation earmarks, plus the call's own sequence's earmark
            (see :mod:`akv.core.reservation`); fewer than the blocks on the
            free queue while other sequences hold reservations.
        evictable_blocks: Cached blocks with refcount 0 that eviction could
            have reclaimed (already counted as usable; the shortage remains).
        tier: ``"device"``, or ``"host"`` when the host tier is short (a
            swap-out); the numbers are then host blocks.
    """

    def __init__(self, requested_blocks: int, free_blocks: int, evictable_blocks: int, tier: str = "device") -> None:
        pool = "pool" if tier == "device" else f"{tier} tier"
        super().__init__(
            f"{pool} exhausted: requested {requested_blocks} blocks, {free_blocks} free, {evictable_blocks} evictable"
        )
        self.requested_blocks = requested_blocks
        self.free_blocks = free_blocks
        self.evictable_blocks = evictable_blocks
        self.tier = tier


class RequestTooLarge(InvalidInput):
    """Permanent: the request needs more blocks than the whole pool (or shard) holds."""

    def __init__(self, requested_blocks: int, num_blocks: int) -> None:
        super().__init__(
            f"request needs {requested_blocks} blocks but a shard of the pool holds only {num_blocks}; "
            "it can never be served"
        )
        self.requested_blocks = requested_blocks
        self.num_blocks = num_blocks


class ManagerClosed(AkvError, RuntimeError):
    """The manager is not running (not entered yet, shutting down, or closed)."""


class WrongTask(AkvError, RuntimeError):
    """The manager was left (``__aexit__``) in another task than the one that entered it.

    Its actors run in an anyio task group, and a task group belongs to the task
    that enters it. The actors are stopped all the same; leaving the manager
    again from the entering task ends the task group.
    """


class WrongExitOrder(AkvError, RuntimeError):
    """A manager was left while a manager entered after it, in the same task, was still open.

    The rule: leave managers in the reverse order of entering them (as nested
    ``async with`` blocks or an ``AsyncExitStack`` do), because each one's
    actors run in an anyio task group and task groups nest. The actors of the
    manager being left are stopped all the same; leaving it again once the
    later ones are left ends its task group.
    """


class ActorCrashed(AkvError, RuntimeError):
    """An actor raised an unexpected exception; the manager has failed.

    Every pending and later call raises this (or :class:`ManagerClosed`) instead
    of hanging. The original exception is chained as ``__cause__``.
    """

    def __init__(self, actor: str, cause: BaseException | None = None) -> None:
        super().__init__(f"actor {actor!r} crashed: {cause!r}")
        self.actor = actor
        self.cause = cause


class TraceError(AkvError, ValueError):
    """A request trace file is missing or malformed.

    Attributes:
        path: The trace file.
        line: 1-based line number of the offending record, or ``None``.
    """

    def __init__(self, path: object, line: int | None, reason: str) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


class SnapshotError(AkvError):
    """A snapshot cannot be written, or is refused whole when read back.

    Nothing is loaded from a refused snapshot, and a failed save leaves the
    snapshot directory's current generation as it was (see docs/persistence.md).

    Attributes:
        cause: One of :data:`SNAPSHOT_CAUSES`: ``"corrupt"`` (a checksum,
            header or structure check failed), ``"truncated"`` (a file is
            shorter than the manifest says), ``"missing"`` (no ``CURRENT``, or
            a generation or file it names is absent), ``"foreign"`` (written
            under another configuration fingerprint), ``"format"`` (not an akv
            snapshot, or a format version this akv does not read), ``"io"``
            (the operating system refused a read or write: permissions, a full
            disk, a file where a directory should be).
        path: The file or directory at fault.
        reason: What is wrong, in words.
    """

    def __init__(self, cause: str, path: object, reason: str) -> None:
        if cause not in SNAPSHOT_CAUSES:
            raise ValueError(f"unknown snapshot error cause {cause!r}; known: {', '.join(SNAPSHOT_CAUSES)}")
        super().__init__(f"snapshot {cause}: {path}: {reason}")
        self.cause = cause
        self.path = path
        self.reason = reason


#: The values of :attr:`SnapshotError.cause`.
SNAPSHOT_CAUSES = ("corrupt", "truncated", "missing", "foreign", "format", "io")


class EventsGap(AkvError):
    """Cache events a consumer needs are no longer available: it must resynchronize.

    Raised when a subscription asks to resume after a sequence number that fell
    out of the event log's replay window, or when a router is handed a
    snapshot older than the batches it has to follow. The consumer takes a
    fresh snapshot (``cached_keys()``) and applies the batches after it
    (docs/events.md, "Resync").

    Attributes:
        from_seq: First sequence number that cannot be supplied.
        to_seq: Last sequence number that cannot be supplied.
    """

    def __init__(self, from_seq: int, to_seq: int, reason: str) -> None:
        super().__init__(f"event batches {from_seq}..{to_seq} are not available: {reason}")
        self.from_seq = from_seq
        self.to_seq = to_seq
        self.reason = reason
