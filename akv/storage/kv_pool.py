"""The paged K/V tensors: one preallocated tensor per layer, addressed by block id.

Layout (per layer), the one vLLM's PagedAttention (Kwon et al., SOSP 2023) and
FlashAttention's paged-KV kernels (``flash_attn_with_kvcache`` with a
``block_table``) use::

    # (2, num_blocks + 1, block_size, num_kv_heads, head_dim), K then V

One block id names the same ``(block_size, num_kv_heads, head_dim)`` slab in
every layer, so a block table is shared by all layers. A slot is the flat token
index ``block_id * block_size + offset`` (vLLM's ``slot_mapping``).

Blocks ``0 .. num_blocks - 1`` are the usable ones; the extra last block,
``null_block_id = num_blocks``, is the null block that pads block tables
(vLLM pads with its null block 0). It is never allocated, so a model runner
may write garbage into its slots (:meth:`KVStorage.write` accepts them) and a
kernel may read it through padding; copies never touch it. It is the last
rather than block 0 so that the usable ids, and every shard's range, stay
``0 .. num_blocks - 1`` as before.

No asyncio here; :class:`akv.storage.stream_worker.CopyExecutor` runs
:meth:`KVStorage.copy_blocks` off the event loop.
"""

from __future__ import annotations

import sys

import torch

from akv.config import KVCacheConfig
from akv.errors import InvalidInput
from akv.storage.host_pool import HostKVStorage
from akv.storage.shared_memory import SharedArena, shared_memory_available
from akv.storage.tensor_args import (
    IndexLike,
    ids_and_list,
    index_tensor,
    torch_dtype,
)
from akv.storage.tensor_args import check_range as _check_range
from akv.storage.tensor_args import raw_bytes as _raw


class KVStorage:
    """Preallocated paged K/V tensors with batched write, copy and gather.

    Args:
        num_blocks: Usable blocks in the pool (every layer); one more, the
            null block, is allocated after them.
        block_size: Tokens per block.
        num_layers: Attention layers; one tensor each.
        num_kv_heads: Key/value heads per layer.
        head_dim: Elements per head.
        dtype: Element dtype of the cache.
        device: Device of the tensors (``"cpu"``, ``"cuda:0"``, ...).
        num_host_blocks: Slots of a host-memory tier to allocate beside the
            pool (0, the default: none); see :class:`HostKVStorage`.
        shared_memory: Allocate both pools in anonymous shared memory
            (:mod:`akv.storage.shared_memory`, CPU only, Linux), so that a
            copy process can run the cross-tier copies
            (:mod:`akv.storage.copy_process`). ``False``: private memory.

    Attributes:
        kv_caches: One tensor per layer,
            ``(2, num_blocks + 1, block_size, num_kv_heads, head_dim)``, K then
            V, zero-initialised; block ``num_blocks`` is the null block.
        null_block_id: ``num_blocks``: the block that pads block tables.
        host: The host tier's tensors (pinned when ``device`` is CUDA), or
            ``None`` without a tier. Copies between the tiers go through
            :meth:`~akv.storage.CopyExecutor.submit_tiers`.

    Raises:
        InvalidInput: A size is not a positive int (``num_host_blocks``: not
            a non-negative int), the dtype or device is bad, CUDA is
            requested where it is not available, or the tensors cannot be
            allocated.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_host_blocks: int = 0,
        shared_memory: bool = False,
    ) -> None:
        if not isinstance(num_host_blocks, int) or isinstance(num_host_blocks, bool) or num_host_blocks < 0:
            raise InvalidInput(f"num_host_blocks must be a non-negative int, got {num_host_blocks!r}")
        sizes = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"{name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise InvalidInput(f"dtype must be a torch.dtype, got {dtype!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInput(f"bad device {device!r}: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidInput("device 'cuda' requested but CUDA is not available on this machine")
        if shared_memory and (device.type != "cpu" or not shared_memory_available()):
            raise InvalidInput(f"shared_memory needs CPU pools on Linux, got device {device} on {sys.platform}")
        self.num_blocks = num_blocks
        self.null_block_id = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        # each: (2, num_blocks + 1, block_size, num_kv_heads, head_dim), K then V; the last block is the null block
        nbytes = num_layers * 2 * (num_blocks + 1) * block_size * num_kv_heads * head_dim * dtype.itemsize
        #: The shared memory behind :attr:`kv_caches` (``shared_memory=True``), else ``None``.
        self.arena = SharedArena(nbytes, "akv-device-pool") if shared_memory else None
        try:
            self.kv_caches: list[torch.Tensor] = (
                self.arena.tensors(num_layers, shape, dtype)  # zero-filled, like a fresh memfd
                if self.arena is not None
                else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            )
        except RuntimeError as exc:  # includes torch.OutOfMemoryError
            raise InvalidInput(f"cannot allocate the KV pool ({nbytes / 2**30:,.2f} GiB on {device}): {exc}") from None
        self.host: HostKVStorage | None = (
            HostKVStorage.like(self, num_host_blocks, shared_memory=shared_memory) if num_host_blocks else None
        )

    @classmethod
    def from_config(cls, config: KVCacheConfig) -> KVStorage | None:
        """Allocate the tensors a :class:`~akv.config.KVCacheConfig` describes.

        With ``config.num_host_blocks > 0`` the storage gets a host tier of
        that many slots (:attr:`host`); on the CPU (Linux, with
        ``config.copy_process``) both pools are then in shared memory, for
        the copy process (``shared_memory=True``).

        Returns:
            The storage, or ``None`` when ``config.storage == "none"``
            (metadata-only simulation; the host tier is then modelled by the
            core alone).

        Raises:
            InvalidInput: An allocation fails (the message gives the GiB).
        """
        if config.storage == "none":
            return None
        shape = config.model
        device = torch.device(config.device)
        return cls(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=torch_dtype(shape.dtype),
            device=device,
            num_host_blocks=config.num_host_blocks,
            shared_memory=(
                config.copy_process
                and config.num_host_blocks > 0
                and device.type == "cpu"
                and shared_memory_available()
            ),
        )

    @property
    def device(self) -> torch.device:
        """Device of every layer's tensor."""
        return self.kv_caches[0].device

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype of the cache."""
        return self.kv_caches[0].dtype

    @property
    def num_slots(self) -> int:
        """Token slots of the usable blocks (``num_blocks * block_size``); the null block's follow them."""
        return self.num_blocks * self.block_size

    @property
    def null_slots(self) -> range:
        """The null block's slots (``num_slots .. num_slots + block_size - 1``), for padded tokens."""
        return range(self.num_slots, self.num_slots + self.block_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block, K and V, across all layers."""
        elem = self.kv_caches[0].element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        """Bytes of all layers' tensors (``(num_blocks + 1) * bytes_per_block``, the null block included)."""
        return sum(cache.nbytes for cache in self.kv_caches)

    # ----------------------------------------------------------------- write
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise InvalidInput(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_kv(self, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInput(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != shape:
            raise InvalidInput(f"{what} must have shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype != self.dtype:
            raise InvalidInput(f"{what} must have dtype {self.dtype}, got {tensor.dtype}")
        if tensor.device != self.device:
            raise InvalidInput(f"{what} must be on {self.device}, got {tensor.device}")

    def _slots(self, slot_mapping: torch.Tensor, check_range: bool) -> torch.Tensor:
        if not isinstance(slot_mapping, torch.Tensor):
            raise InvalidInput(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
        slots = index_tensor(slot_mapping, "slot_mapping")
        if check_range:
            _check_range(slots, self.num_slots + self.block_size, "slot_mapping")
        return slots.to(self.device, non_blocking=True)

    def write(
        self,
        layer: int,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        check_range: bool = True,
    ) -> None:
        """Scatter new tokens' K and V of one layer into their slots.

        vLLM ``reshape_and_cache`` semantics: token ``i`` goes to slot
        ``slot_mapping[i] = block_id * block_size + offset``. One vectorized
        ``index_copy_`` per K and V on the flat view
        ``(2, (num_blocks + 1) * block_size, num_kv_heads, head_dim)``; O(n) work,
        no Python loop over tokens. Unlike vLLM, negative (padding) slots are
        rejected, not skipped: pad with the null block's slots
        (:attr:`null_slots`) instead, which no sequence reads. With duplicate
        slots, which token wins is unspecified.

        Args:
            layer: Layer index in ``[0, num_layers)``.
            slot_mapping: ``(n,)`` int64 (int32 accepted), slots in
                ``[0, (num_blocks + 1) * block_size)`` (the null block's included).
            key: ``(n, num_kv_heads, head_dim)``, cache dtype, cache device.
            value: Same shape, dtype and device as ``key``.
            check_range: Check slot bounds (a host sync when ``slot_mapping``
                lives on a GPU); pass ``False`` only for trusted mappings.

        Raises:
            InvalidInput: Bad layer, shape, dtype, device or slot out of range.
        """
        self._check_layer(layer)
        slots = self._slots(slot_mapping, check_range)
        shape = (slots.numel(), self.num_kv_heads, self.head_dim)
        self._check_kv(key, shape, "key")
        self._check_kv(value, shape, "value")
        self._scatter(layer, slots, key, value)

    def write_all_layers(
        self,
        slot_mapping: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        check_range: bool = True,
    ) -> None:
        """Scatter K and V of every layer at once (same slots in every layer).

        Args:
            slot_mapping: ``(n,)`` int64 (int32 accepted) slots.
            keys: ``(num_layers, n, num_kv_heads, head_dim)``, cache dtype and device.
            values: Same shape, dtype and device as ``keys``.
            check_range: As in :meth:`write`.

        Raises:
            InvalidInput: Bad shape, dtype, device or slot out of range.
        """
        slots = self._slots(slot_mapping, check_range)
        shape = (self.num_layers, slots.numel(), self.num_kv_heads, self.head_dim)
        self._check_kv(keys, shape, "keys")
        self._check_kv(values, shape, "values")
        for layer in range(self.num_layers):
            self._scatter(layer, slots, keys[layer], values[layer])

    def _scatter(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        # flat: (2, (num_blocks + 1) * block_size, num_kv_heads, head_dim), K then V
        flat = _raw(self.kv_caches[layer]).view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, _raw(key))
        flat[1].index_copy_(0, slots, _raw(value))

    # ------------------------------------------------------------------ copy
    def check_copy_ids(self, src_block_ids: IndexLike, dst_block_ids: IndexLike) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a copy batch and return it as two CPU int64 ``(m,)`` tensors.

        Raises:
            InvalidInput: Lengths differ, an id is out of ``[0, num_blocks)``
                (the null block is never copied), a
                destination appears twice, or an id is both source and
                destination within the batch.
        """
        src_t, src = ids_and_list(src_block_ids, self.num_blocks, "src_block_ids")
        dst_t, dst = ids_and_list(dst_block_ids, self.num_blocks, "dst_block_ids")
        if len(src) != len(dst):
            raise InvalidInput(f"src_block_ids has {len(src)} ids but dst_block_ids has {len(dst)}")
        dst_set = set(dst)
        if len(dst_set) != len(dst):
            raise InvalidInput(f"dst_block_ids contains duplicates: {dst}")
        both = dst_set.intersection(src)
        if both:
            raise InvalidInput(f"block ids are both source and destination: {sorted(both)}")
        return src_t, dst_t

    def copy_blocks(self, src_block_ids: IndexLike, dst_block_ids: IndexLike) -> None:
        """Copy whole blocks (K and V) in every layer: ``cache[:, dst] = cache[:, src]``.

        vLLM ``copy_blocks`` semantics (the copy-on-write primitive), batched:
        two kernels per layer (``index_select`` then ``index_copy_``), O(m) data
        moved per layer. Runs on the caller's thread and current stream; use
        :class:`~akv.storage.stream_worker.CopyExecutor` to run it off the
        event loop on a copy stream.

        Args:
            src_block_ids: ``(m,)`` int64 (int32 or a list accepted) source ids.
            dst_block_ids: ``(m,)`` destination ids, pairwise with ``src_block_ids``.

        Raises:
            InvalidInput: See :meth:`check_copy_ids`.
        """
        src, dst = self.check_copy_ids(src_block_ids, dst_block_ids)
        self._copy_unchecked(src.to(self.device), dst.to(self.device))

    def _copy_unchecked(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy validated int64 ids already on the cache device, on the current stream."""
        if src.numel() == 0:
            return
        for cache in self.kv_caches:
            raw = _raw(cache)  # (2, num_blocks + 1, block_size, num_kv_heads, head_dim)
            raw.index_copy_(1, dst, raw.index_select(1, src))

    # ---------------------------------------------------------------- gather
    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read one sequence's K and V of one layer back in logical token order.

        Args:
            layer: Layer index in ``[0, num_layers)``.
            block_table: ``(num_blocks_in_seq,)`` int32 (int64 accepted) block
                ids in logical order.
            num_tokens: Tokens to read, at most ``num_blocks_in_seq * block_size``.

        Returns:
            ``(key, value)``, each a new ``(num_tokens, num_kv_heads, head_dim)``
            tensor of the cache dtype on the cache device.

        Raises:
            InvalidInput: Bad layer, block id out of range, or too many tokens.
        """
        self._check_layer(layer)
        if not isinstance(block_table, torch.Tensor):
            raise InvalidInput(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        ids = index_tensor(block_table, "block_table")
        capacity = ids.numel() * self.block_size
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 <= num_tokens <= capacity:
            raise InvalidInput(
                f"num_tokens must be an int in [0, {capacity}] for {ids.numel()} blocks, got {num_tokens!r}"
            )
        needed = ids[: -(-num_tokens // self.block_size)]
        _check_range(needed, self.num_blocks, "block_table")
        raw = _raw(self.kv_caches[layer])
        # (2, n_blocks, block_size, H, D) -> (2, n_blocks * block_size, H, D)
        kv = raw.index_select(1, needed.to(self.device)).flatten(1, 2)[:, :num_tokens].view(self.dtype)
        return kv[0], kv[1]

    def __repr__(self) -> str:
        return (
            f"KVStorage(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
            f"host_blocks={0 if self.host is None else self.host.num_blocks})"
        )
