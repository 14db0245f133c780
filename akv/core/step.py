"""Step messages: what a scheduler asks of a shard in one step, and what it gets back.

Pure data (numpy arrays, no torch). The manager validates and converts token
ids to int32 arrays before building these.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from akv.core.ids import describe, plain_id
from akv.errors import InvalidInput


@dataclass(frozen=True, kw_only=True, slots=True)
class Admit:
    """Add a sequence from a prompt.

    The ids and flags are checked (and numpy scalars normalized) when the item
    is built; the manager checks the prompt against the vocabulary.

    Args:
        seq_id: New, caller-chosen sequence id: a plain value (an exact
            ``str``, ``int`` or ``bytes``, a numpy integer, or a tuple of
            these; see :mod:`akv.core.ids`), never ``None``.
        prompt: Token ids as the caller gives them (a list or tuple of ints,
            a numpy integer array or a torch integer tensor; 1-D, non-empty),
            stored here unchanged and unchecked. :meth:`KVCacheManager.step
            <akv.manager.KVCacheManager.step>` validates them and converts them
            once, to an int32 array of shape ``(num_prompt_tokens,)``, in the
            copy of the item it sends to a shard.
        namespace: Prefix-cache namespace; prompts only hit blocks of an equal
            one. ``None`` (the default) or a plain value; values of different
            types never merge (``True`` and ``1.0`` are refused). A tagged
            tuple such as ``("lora", 7)`` is recommended.
        prefill_done: A bool (``numpy.bool_`` is accepted and made ``bool``,
            as for ``resumed``): the runner computes the whole prompt in this very step
            (a simulation shortcut): the prompt is committed at once and its
            full blocks published before the next admission of the step.
        resumed: A re-admission of a sequence preempted earlier (its prompt
            plus the tokens it had generated). Its prompt and cached tokens go
            to the ``resumed_*`` counters, so the prefix-cache hit ratio counts
            each request's first admission only.
        max_new_tokens: Reserve room for this many tokens after the prompt
            (an ``int >= 0``), so appends up to ``len(prompt) + max_new_tokens``
            tokens never lack blocks; the admission is rejected instead when
            that room is not there. ``None``: no reservation. See
            :mod:`akv.core.reservation`.

    Raises:
        InvalidInput: ``seq_id`` or ``namespace`` is not a plain value, or
            ``prefill_done`` or ``resumed`` is not a bool.
    """

    seq_id: Hashable
    prompt: np.ndarray
    namespace: Hashable = None
    prefill_done: bool = False
    resumed: bool = False
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        seq_id = plain_id(self.seq_id, "seq_id of Admit")
        namespace = plain_id(self.namespace, f"namespace of Admit {seq_id!r}", allow_none=True)
        if seq_id is not self.seq_id:
            object.__setattr__(self, "seq_id", seq_id)  # a numpy scalar made plain (frozen dataclass)
        if namespace is not self.namespace:
            object.__setattr__(self, "namespace", namespace)
        flags = (type(self.prefill_done), type(self.resumed))
        if not {*flags} <= {bool, np.bool_}:
            raise InvalidInput(
                f"Admit {seq_id!r}: prefill_done and resumed must be bools, "
                f"got {describe(self.prefill_done)} and {describe(self.resumed)}"
            )
        if np.bool_ in flags:
            object.__setattr__(self, "prefill_done", bool(self.prefill_done))
            object.__setattr__(self, "resumed", bool(self.resumed))


@dataclass(kw_only=True, slots=True)
class StepRequest:
    """One scheduler step for one shard, applied in this order.

    Not frozen (a frozen dataclass's ``__init__`` costs 3x more, on every
    step), but never changed once built: the manager builds it and the shard
    only reads it.

    1. ``frees``: release sequences (unknown ids are a no-op: free is idempotent);
       those also in ``preempted`` are counted as preemptions.
    2. ``commits``: the runner wrote K/V for the next ``n`` tokens of a sequence;
       full committed blocks are published to the prefix cache.
    3. ``forks``: ``(parent_id, child_ids)``: children share every parent block.
    4. ``appends``: new tokens per sequence (decode); copy-on-write of a shared
       partial tail block first.
    5. ``admits``: new sequences, in order.

    Args:
        frees: Sequence ids to free.
        preempted: The ids among ``frees`` that the scheduler preempts (to
            re-admit later) rather than finishes; counted, freed the same way.
        commits: Sequence id -> tokens committed (>= 0).
        forks: ``(parent_id, child_ids)`` pairs.
        appends: Sequence id -> int32 token array, shape ``(k,)``, ``k >= 1``,
            or one validated ``int`` token (the decode fast path).
        admits: Admissions.
        want_metadata: Build block tables and slot mapping for the scheduled
            sequences (skip for pure bookkeeping calls).
        block_table_updates: With ``want_metadata``, return the changes to
            the scheduled rows' block tables (``StepOutcome.block_table_updates``)
            instead of the padded tables.
    """

    frees: Sequence[Hashable] = ()
    preempted: frozenset = frozenset()
    commits: Mapping[Hashable, int] = field(default_factory=dict)
    forks: Sequence[tuple[Hashable, Sequence[Hashable]]] = ()
    appends: Mapping[Hashable, np.ndarray | int] = field(default_factory=dict)
    admits: Sequence[Admit] = ()
    want_metadata: bool = True
    block_table_updates: bool = False

    @property
    def frees_only(self) -> bool:
        """Nothing but frees (a serving stack's end-of-request step)."""
        return not (self.commits or self.forks or self.appends or self.admits)


@dataclass(kw_only=True, slots=True)
class StepOutcome:
    """What a shard did in one step (numpy arrays; the manager wraps them in torch).

    Attributes:
        seq_ids: Scheduled sequences (successful appends, then admissions), in
            the order of the metadata rows.
        block_tables: int32 ``(batch, max_blocks)`` padded with the null
            block id beyond each row's ``ceil(context_len / block_size)`` blocks
            (None when the request asked for ``block_table_updates``).
        block_table_updates: int32 ``(num_entries, 3)`` ``(row, column,
            block id)`` entries to write into a runner's own copy of the
            scheduled rows' tables (see
            :meth:`~akv.core.block_table.BlockTables.updates`), when the request
            asked for them; else None.
        context_lens: int32 ``(batch,)`` tokens per scheduled sequence after this step.
        query_start_loc: int32 ``(batch + 1,)`` offsets of each row's new tokens
            in ``slot_mapping`` (the flash-attention varlen convention).
        slot_mapping: int64 ``(num_new_tokens,)``, ``block_id * block_size + offset``
            for every token to compute this step (vLLM's ``slot_mapping``).
        cached_tokens: Admitted sequence id -> prompt tokens served from the cache.
        rejected: Sequence id -> error (:class:`~akv.errors.PoolExhausted` or
            :class:`~akv.errors.RequestTooLarge`) for appends and admissions that
            were not applied; their state is unchanged.
        copies: ``(src_block_id, dst_block_id)`` copy-on-write pairs to run
            before the runner writes or reads this step's blocks.
        copy_seq_ids: The sequence whose append caused each pair of ``copies``.
        freed: Sequence ids actually freed (known ones).
        evicted_blocks: Blocks evicted on demand during this step.
        stored_block_ids: Blocks this step added to the prefix cache (newly
            published), in insertion order.
        removed_block_ids: Blocks this step's evictions removed from the
            prefix cache, in removal order (host-tier ids too: the host tier
            dropped them). A block removed and then reused
            and published in the same step is in both lists; no block stored
            is removed in the same step (it is referenced).
        demoted, demoted_to: Each block demoted to the host tier
            (:mod:`akv.core.tiers`) and its host id, in order (two parallel
            lists; :attr:`demotes` pairs them): the copies to run first in
            the step's copy batch.
        promoted, promoted_to: Each host block promoted back and its new
            device block (:attr:`promotes`): the copies to run last.
        swap_outs: ``(device block, host id)`` copies of a swap-out
            (:mod:`akv.core.swap`); they run with the demotions.
        swap_ins: ``(host id, device block)`` copies of a swap-in; they run
            with the promotions.
        transfer: The shard's :class:`~akv.core.tiers.TierTransfer` id that
            waits for those copies (None: nothing waits; metadata mode).
        wait_transfer: The newest *earlier* transfer whose pending copy
            still reads a block this step handed out (a block an earlier
            step demoted on demand and did not take), or None: the runner
            must wait for that copy too before writing (the pool shard
            actor gives a step without copies of its own that batch's
            ticket; see :mod:`akv.core.tiers`).
    """

    seq_ids: list = field(default_factory=list)
    block_tables: np.ndarray | None = None
    block_table_updates: np.ndarray | None = None
    context_lens: np.ndarray | None = None
    query_start_loc: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    cached_tokens: dict = field(default_factory=dict)
    rejected: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)
    copy_seq_ids: list = field(default_factory=list)
    freed: list = field(default_factory=list)
    evicted_blocks: int = 0
    stored_block_ids: list = field(default_factory=list)
    removed_block_ids: list = field(default_factory=list)
    demoted: list = field(default_factory=list)
    demoted_to: list = field(default_factory=list)
    promoted: list = field(default_factory=list)
    promoted_to: list = field(default_factory=list)
    swap_outs: list = field(default_factory=list)
    swap_ins: list = field(default_factory=list)
    transfer: int | None = None
    wait_transfer: int | None = None

    @property
    def demotes(self) -> list[tuple[int, int]]:
        """``(device block, host id)`` of each demotion, in order."""
        return list(zip(self.demoted, self.demoted_to))

    @property
    def promotes(self) -> list[tuple[int, int]]:
        """``(host id, device block)`` of each promotion, in order."""
        return list(zip(self.promoted, self.promoted_to))


def empty_metadata() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Metadata of a step that scheduled nothing.

    Returns:
        ``(block_tables, context_lens, query_start_loc, slot_mapping)``: int32
        ``(0, 0)``, int32 ``(0,)``, int32 ``[0]`` and int64 ``(0,)``.
    """
    return (
        np.zeros((0, 0), dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(1, dtype=np.int32),
        np.zeros(0, dtype=np.int64),
    )
