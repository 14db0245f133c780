"""ShardMap: which shard owns each sequence, how a step splits over shards, how their outcomes merge.

Pure and synchronous (no anyio, no torch): the manager asks the shards; this
object only decides what each shard is sent and puts the replies back together.

- **Split** (:meth:`ShardMap.split`): frees, commits, forks and appends go to the
  shard that owns the sequence (a fork child to its parent's shard); each
  admission is placed by :meth:`ShardMap.place`.
- **Place** (:meth:`ShardMap.place`): prefix-affine. A prompt of at least one
  full block goes to its *affine shard*, picked by the content key of its
  first block (:func:`~akv.core.block_key.chain_keys_raw` of the namespace and
  the first ``block_size`` token ids, xxh3_128; never Python's ``hash()``),
  so the same prefix always lands where its blocks are cached, in every
  process. Prompts shorter than a block, and prompts whose affine shard
  cannot hold them (fewer unreserved free plus cached blocks there than the
  prompt and its reservation need, less what the step's earlier admissions
  there take), spill to the shard with the largest unreserved free fraction
  left (placement by free blocks). ``KVCacheManager.lookup`` routes the same
  way, so it predicts what an admission gets unless the pool changes in
  between or the admission spills for its ``max_new_tokens`` (which a
  lookup does not know): then the lookup may over-promise.
- **Record** (:meth:`ShardMap.record`): after every part is applied, freed
  sequences leave the map, fork children and admitted sequences join it.
- **Merge** (:meth:`ShardMap.merge`): the shards' :class:`~akv.core.step.StepOutcome`
  become one, rows back in request order (appends, then admissions), block
  tables padded with the null block.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from akv.core.block_key import chain_keys_raw, chain_suffix
from akv.core.step import StepOutcome, StepRequest, empty_metadata
from akv.errors import DuplicateSequence, UnknownSequence

__all__ = ["ShardMap"]


class ShardMap:
    """Owner shard of every live sequence of a manager with several shards.

    Args:
        shard_num_blocks: Usable blocks of each shard, by shard index.
        block_size: Tokens per block.
        null_block_id: The block id that pads merged block tables.
    """

    def __init__(self, shard_num_blocks: Sequence[int], block_size: int, null_block_id: int) -> None:
        self._num_blocks = list(shard_num_blocks)
        self._block_size = block_size
        self._null_block_id = null_block_id
        self._owner: dict[Hashable, int] = {}

    def owner(self, seq_id: Hashable) -> int:
        """Index of the shard that owns ``seq_id``.

        Raises:
            UnknownSequence: ``seq_id`` is not live.
        """
        try:
            return self._owner[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def affine_shard(self, namespace: Hashable, prompt: np.ndarray) -> int | None:
        """The shard a prompt's first full block belongs to, or None for a prompt shorter than a block.

        Args:
            namespace: The prompt's namespace (a plain value, :mod:`akv.core.ids`).
            prompt: Token ids, int32 ``(n,)``.

        Returns:
            The first 8 bytes of the first block's content key (big-endian)
            modulo the number of shards; the same in every process.
        """
        bs = self._block_size
        if len(prompt) < bs:
            return None
        raw = prompt[:bs].astype("<i4", copy=False).tobytes()
        key = chain_keys_raw(raw, bs, chain_suffix(namespace))[0]
        return int.from_bytes(key[:8], "big") % len(self._num_blocks)

    def place(
        self,
        namespace: Hashable,
        prompt: np.ndarray,
        num_blocks: int,
        free_fraction: Sequence[float],
        num_available: Sequence[int],
    ) -> int:
        """The shard an admission goes to (see the module docstring, "Place").

        Args:
            namespace: The prompt's namespace.
            prompt: Token ids, int32 ``(n,)``.
            num_blocks: Blocks the admission needs at most (prompt plus reservation).
            free_fraction: Unreserved free fraction of each shard, by shard index.
            num_available: Unreserved free plus cached blocks of each shard.

        Returns:
            The affine shard if it can hold ``num_blocks``, else the shard with
            the largest free fraction (ties: the lowest index).
        """
        shard = self.affine_shard(namespace, prompt)
        if shard is None or num_available[shard] < num_blocks:
            shard = max(range(len(free_fraction)), key=free_fraction.__getitem__)
        return shard

    def split(
        self, request: StepRequest, num_free: Sequence[int], num_available: Sequence[int] | None = None
    ) -> tuple[list[tuple[int, StepRequest]], dict[Hashable, int]]:
        """Split a validated step into one part per shard it touches (all checks before any part is sent).

        Args:
            request: The whole step.
            num_free: Unreserved free blocks of each shard now, by shard index.
            num_available: Unreserved free plus cached blocks of each shard
                now (default: ``num_free``, no block cached).

        Returns:
            ``(parts, children)``: ``(shard index, StepRequest)`` pairs in shard
            order, and the fork children's shards (for :meth:`record`).

        Raises:
            UnknownSequence: A commit, fork parent or append names no live sequence.
            DuplicateSequence: A fork child or admission id is live (and not
                freed by this step) or repeated.
        """
        owner = self._owner
        parts: dict[int, dict] = {}

        def part(shard: int) -> dict:
            return parts.setdefault(
                shard, {"frees": [], "preempted": frozenset(), "commits": {}, "forks": [], "appends": {}, "admits": []}
            )

        freed = {seq_id for seq_id in request.frees if seq_id in owner}
        for seq_id in request.frees:
            if seq_id in owner:
                part(owner[seq_id])["frees"].append(seq_id)
        for fields in parts.values():
            fields["preempted"] = frozenset(s for s in fields["frees"] if s in request.preempted)
        for seq_id, n in request.commits.items():
            part(self.owner(seq_id))["commits"][seq_id] = n
        children: dict[Hashable, int] = {}
        for parent, kids in request.forks:
            shard = children[parent] if parent in children else self.owner(parent)
            part(shard)["forks"].append((parent, kids))
            for kid in kids:
                if (kid in owner and kid not in freed) or kid in children:
                    raise DuplicateSequence(kid)
                children[kid] = shard
        for seq_id, tokens in request.appends.items():
            shard = children[seq_id] if seq_id in children else self.owner(seq_id)
            part(shard)["appends"][seq_id] = tokens
        self._place(request, num_free, num_free if num_available is None else num_available, freed, children, part)
        subs = [
            (
                shard,
                StepRequest(
                    **parts[shard],
                    want_metadata=request.want_metadata,
                    block_table_updates=request.block_table_updates,
                ),
            )
            for shard in sorted(parts)
        ]
        return subs, children

    def _place(
        self,
        request: StepRequest,
        num_free: Sequence[int],
        num_available: Sequence[int],
        freed: set,
        children: dict,
        part,
    ) -> None:
        """Place each admission (:meth:`place`), less what the step's earlier admissions take (see :meth:`split`)."""
        owner, bs = self._owner, self._block_size
        free_now = [n / total for n, total in zip(num_free, self._num_blocks, strict=True)]
        available = list(num_available)
        admitted: set[Hashable] = set()
        for adm in request.admits:
            if (adm.seq_id in owner and adm.seq_id not in freed) or adm.seq_id in children or adm.seq_id in admitted:
                raise DuplicateSequence(adm.seq_id)
            admitted.add(adm.seq_id)
            num_tokens = len(adm.prompt) + (adm.max_new_tokens or 0)
            need = -(-num_tokens // bs)
            shard = self.place(adm.namespace, adm.prompt, need, free_now, available)
            free_now[shard] -= num_tokens / (bs * self._num_blocks[shard])
            available[shard] -= need
            part(shard)["admits"].append(adm)

    def record(self, outcomes: Sequence[tuple[int, StepOutcome]], children: dict[Hashable, int]) -> None:
        """Update the owners once every part of a step is applied.

        Args:
            outcomes: ``(shard index, outcome)`` of every part.
            children: The fork children's shards from :meth:`split`.
        """
        owner = self._owner
        for _, outcome in outcomes:
            for seq_id in outcome.freed:
                owner.pop(seq_id, None)
        owner.update(children)
        for shard, outcome in outcomes:
            for seq_id in outcome.cached_tokens:
                owner[seq_id] = shard

    def merge(self, outcomes: Sequence[StepOutcome], order: Sequence[Hashable], *, want_metadata: bool) -> StepOutcome:
        """One outcome from the shards' outcomes, rows in request order.

        Args:
            outcomes: The parts' outcomes, in shard order.
            order: The step's appended then admitted ids (rows not scheduled
                are skipped).
            want_metadata: The step asked for metadata: with no row scheduled
                anywhere, the result still has empty metadata arrays.

        Returns:
            A :class:`StepOutcome`: ``seq_ids``, int32 ``block_tables``
            ``[rows, max width]`` padded with the null block (or the parts'
            ``block_table_updates``, their row indices made the merged rows'), ``context_lens``
            ``[rows]``, int32 ``query_start_loc`` ``[rows + 1]``, ``slot_mapping``
            ``[tokens]``, and the merged ``cached_tokens``, ``rejected``,
            ``freed`` and ``evicted_blocks`` (no ``copies``: the manager keeps
            the tickets).
        """
        seq_ids, cached, rejected, freed = [], {}, {}, []
        for o in outcomes:
            seq_ids.extend(o.seq_ids)
            cached.update(o.cached_tokens)
            rejected.update(o.rejected)
            freed.extend(o.freed)
        with_meta = [o for o in outcomes if o.context_lens is not None]
        tables = updates = context = qsl = slots = None
        if with_meta:
            seq_ids, tables, updates, context, qsl, slots = self._merge_metadata(with_meta, seq_ids, order)
        else:
            position = {seq_id: i for i, seq_id in enumerate(seq_ids)}
            seq_ids = [x for x in order if x in position]
        if want_metadata and context is None:  # no shard scheduled anything: empty, as one shard gives
            tables, context, qsl, slots = empty_metadata()
            if any(o.block_table_updates is not None for o in outcomes):
                tables, updates = None, np.zeros((0, 3), dtype=np.int32)
        return StepOutcome(
            seq_ids=seq_ids,
            block_tables=tables,
            block_table_updates=updates,
            context_lens=context,
            query_start_loc=qsl,
            slot_mapping=slots,
            cached_tokens=cached,
            rejected=rejected,
            freed=freed,
            evicted_blocks=sum(o.evicted_blocks for o in outcomes),
        )

    def _merge_metadata(self, with_meta: list[StepOutcome], seq_ids: list, order: Sequence[Hashable]) -> tuple:
        """Concatenate the parts' metadata arrays and permute the rows (and their slots) into ``order``."""
        tables = updates = None
        if with_meta[0].block_tables is not None:
            width = max(o.block_tables.shape[1] for o in with_meta)
            rows = sum(o.block_tables.shape[0] for o in with_meta)
            tables = np.full((rows, width), self._null_block_id, dtype=np.int32)
            row = 0
            for o in with_meta:
                b, w = o.block_tables.shape
                tables[row : row + b, :w] = o.block_tables
                row += b
        else:
            updates = np.concatenate([o.block_table_updates for o in with_meta])
            firsts = np.cumsum([0] + [len(o.context_lens) for o in with_meta[:-1]])
            updates[:, 0] += np.repeat(firsts, [len(o.block_table_updates) for o in with_meta]).astype(np.int32)
        context = np.concatenate([o.context_lens for o in with_meta])
        slots = np.concatenate([o.slot_mapping for o in with_meta])
        lens = np.concatenate([np.diff(o.query_start_loc) for o in with_meta]).astype(np.int64)
        starts = np.zeros(len(lens), dtype=np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        position = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        perm = np.array([position[x] for x in order if x in position], dtype=np.intp)
        seq_ids = [seq_ids[i] for i in perm]
        context, lens, starts = context[perm], lens[perm], starts[perm]
        if tables is not None:
            tables = tables[perm]
        else:  # each entry's row becomes its row's merged position; entries stay grouped by row, columns ascending
            new_row = np.empty(len(perm), dtype=np.int32)
            new_row[perm] = np.arange(len(perm), dtype=np.int32)
            updates[:, 0] = new_row[updates[:, 0]]
            updates = updates[np.argsort(updates[:, 0], kind="stable")]
        total = int(lens.sum())
        row_of = np.repeat(np.arange(len(lens)), lens)
        offsets = np.zeros(len(lens), dtype=np.int64)
        np.cumsum(lens[:-1], out=offsets[1:])
        slots = slots[starts[row_of] + (np.arange(total) - offsets[row_of])]
        qsl = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        return seq_ids, tables, updates, context, qsl, slots
