"""The host-memory tier's K/V tensors: the device pool's layout, in (pinned) CPU memory.

Layout (per layer), the device pool's (:mod:`akv.storage.kv_pool`, vLLM's
PagedAttention layout) without the null block::

    # (2, num_blocks, block_size, num_kv_heads, head_dim), K then V

A host **slot** is an index ``0 .. num_blocks - 1`` into these tensors (one
slot names the same slab in every layer, as a device block id does). The
prefix tree names host slot ``s`` by the id ``config.host_block_base + s``;
the core converts, storage only ever sees slots. The host tier holds no null
block: block tables never point into it (a model runner only reads device
blocks), so no slot needs to absorb padded writes.

When the device pool is on CUDA the tensors are page-locked, so the copy
stream's transfers to and from them are true asynchronous DMA (pageable memory
would make ``non_blocking`` copies synchronous, staged by the driver), and
mapped into the device's address space for zero-copy kernels
(:mod:`akv.storage.tier_cuda`). They are allocated as ordinary CPU tensors and
registered in place with ``cudaHostRegister`` (what SGLang's HiCache host pool
and LMCache do), not with ``pin_memory=True``: torch's caching host allocator
rounds every pinned allocation up to a power of two, so a 3.1 GiB layer would
pin 4 GiB and a 100 GiB tier 128 GiB of unswappable memory. The registration
is undone when the :class:`HostKVStorage` is collected. Otherwise the tensors
are plain CPU memory. The cross-tier copies are
:meth:`akv.storage.CopyExecutor.submit_tiers`.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

import torch

from akv.errors import InvalidInput
from akv.storage.shared_memory import COMMIT_BYTES, SharedArena, interrupt_point, shared_memory_available
from akv.storage.tensor_args import check_range, index_tensor, raw_bytes

if TYPE_CHECKING:
    from akv.storage.kv_pool import KVStorage


def _register(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Page-lock each tensor's memory in place (``cudaHostRegister``, default flags: mapped and portable under UVA).

    Raises:
        RuntimeError: CUDA refused a registration; those already made are undone.
    """
    cudart = torch.cuda.cudart()
    done: list[torch.Tensor] = []
    with torch.cuda.device(device):
        for tensor in tensors:
            error = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))
            if error != 0:
                _unregister(done)
                raise RuntimeError(f"cudaHostRegister failed with CUDA error {error} ({tensor.nbytes:,} bytes)")
            done.append(tensor)


def _unregister(tensors: list[torch.Tensor]) -> None:
    """Undo :func:`_register` (errors ignored: the process may be tearing CUDA down)."""
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        cudart.cudaHostUnregister(tensor.data_ptr())


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, written :data:`COMMIT_BYTES` at a time.

    Between chunks the interpreter runs signal handlers: Ctrl-C or SIGTERM
    while a large pool is being allocated is handled at once, not after it.
    """
    t = torch.empty(shape, dtype=dtype)
    raw = t.view(-1).view(torch.uint8)
    for start in range(0, raw.numel(), COMMIT_BYTES):
        interrupt_point()
        raw[start : start + COMMIT_BYTES].zero_()
    return t


def available_memory() -> int | None:
    """Bytes of memory the kernel estimates it can give now without swapping (``MemAvailable`` of ``/proc/meminfo``).

    ``None`` where ``/proc/meminfo`` has no such line (not Linux, or a kernel
    before 3.14): the physical-memory check alone applies then.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostKVStorage:
    """The host tier's preallocated K/V tensors, addressed by host slot.

    Args:
        num_blocks: Host slots (every layer). No null block.
        block_size: Tokens per block (the device pool's).
        num_layers: Attention layers; one tensor each.
        num_kv_heads: Key/value heads per layer.
        head_dim: Elements per head.
        dtype: Element dtype (the device pool's).
        cuda_device: The CUDA device the pool serves: the memory is then
            page-locked with that device current (so its context owns the
            registration); ``None``: plain pageable memory (CPU pools).
        shared_memory: Allocate in anonymous shared memory for a copy process
            (:mod:`akv.storage.shared_memory`; CPU pools only).

    Attributes:
        kv_caches: One tensor per layer,
            ``(2, num_blocks, block_size, num_kv_heads, head_dim)``, K then
            V, on the CPU, contiguous, zero-filled and committed when the
            pool is created (memory is allocated then, not page by page
            during the copies).
        pinned: Whether the tensors are page-locked.

    Raises:
        InvalidInput: A size is not a positive int, the dtype is bad, CUDA is
            not available for ``cuda_device``, the pool is larger than the
            machine's physical memory or than the memory available now (it is
            committed at once), or the tensors cannot be allocated or
            page-locked (the message gives the GiB).
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
        cuda_device: torch.device | str | None = None,
        shared_memory: bool = False,
    ) -> None:
        sizes = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"host pool {name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise InvalidInput(f"dtype must be a torch.dtype, got {dtype!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.pinned = cuda_device is not None
        if self.pinned and not torch.cuda.is_available():
            raise InvalidInput("a pinned host pool needs CUDA, which is not available on this machine")
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        nbytes = num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
        kind = "pinned host memory" if self.pinned else "host memory"
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if nbytes > physical:
            raise InvalidInput(
                f"cannot allocate the host KV pool ({nbytes / 2**30:,.2f} GiB of {kind}): "
                f"more than this machine's {physical / 2**30:,.1f} GiB of memory"
            )
        available = available_memory()
        if available is not None and nbytes > available:
            # committed at once (below): past what the kernel can give now, the OOM killer answers, not an error
            raise InvalidInput(
                f"cannot allocate the host KV pool ({nbytes / 2**30:,.2f} GiB of {kind}): "
                f"more than the {available / 2**30:,.1f} GiB of memory available now (MemAvailable)"
            )
        if shared_memory and (self.pinned or not shared_memory_available()):
            raise InvalidInput("a host pool in shared memory must be a CPU pool on Linux (not pinned)")
        #: The shared memory behind :attr:`kv_caches` (``shared_memory=True``), else ``None``.
        self.arena = SharedArena(nbytes, "akv-host-pool") if shared_memory else None
        try:
            # each: (2, num_blocks, block_size, num_kv_heads, head_dim), K then V; no null block
            # committed now, zero-filled (the arena too: commit_pages), as the device pool is: a
            # preallocated pool whose pages are not allocated one fault at a time during the copies
            self.kv_caches: list[torch.Tensor] = (
                self.arena.tensors(num_layers, shape, dtype)
                if self.arena is not None
                else [_zeros(shape, dtype) for _ in range(num_layers)]
            )
            if cuda_device is not None:
                _register(self.kv_caches, torch.device(cuda_device))
        except RuntimeError as exc:  # out of memory, page-locking refused, bad device
            self.kv_caches = []
            raise InvalidInput(
                f"cannot allocate the host KV pool ({nbytes / 2**30:,.2f} GiB of {kind}): {exc}"
            ) from None
        if self.pinned:
            weakref.finalize(self, _unregister, list(self.kv_caches)).atexit = False

    @classmethod
    def like(cls, storage: KVStorage, num_blocks: int, *, shared_memory: bool = False) -> HostKVStorage:
        """A host pool of ``num_blocks`` slots with ``storage``'s block shape and dtype.

        Page-locked for ``storage``'s device when it is a CUDA device, plain
        CPU memory otherwise (shared memory with ``shared_memory``).

        Raises:
            InvalidInput: ``num_blocks`` is not a positive int, or the
                allocation fails.
        """
        return cls(
            num_blocks=num_blocks,
            block_size=storage.block_size,
            num_layers=storage.num_layers,
            num_kv_heads=storage.num_kv_heads,
            head_dim=storage.head_dim,
            dtype=storage.dtype,
            cuda_device=storage.device if storage.device.type == "cuda" else None,
            shared_memory=shared_memory,
        )

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype of the tensors."""
        return self.kv_caches[0].dtype

    @property
    def device(self) -> torch.device:
        """Always the CPU."""
        return self.kv_caches[0].device

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one slot, K and V, across all layers (the device pool's ``bytes_per_block``)."""
        elem = self.kv_caches[0].element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        """Bytes of all layers' tensors: ``num_blocks * bytes_per_block``."""
        return sum(cache.nbytes for cache in self.kv_caches)

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise InvalidInput(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def read_blocks(self, layer: int, slots: torch.Tensor | list[int]) -> torch.Tensor:
        """Copy whole slots of one layer out of the host pool (for tests and verifiers).

        Args:
            layer: Layer index in ``[0, num_layers)``.
            slots: ``(m,)`` host slots in ``[0, num_blocks)`` (int32/int64
                tensor or a list of ints; repeats allowed).

        Returns:
            A new ``(2, m, block_size, num_kv_heads, head_dim)`` CPU tensor of
            the pool's dtype, K then V.

        Raises:
            InvalidInput: Bad layer or a slot out of range.
        """
        self._check_layer(layer)
        ids = index_tensor(slots, "slots").cpu()
        check_range(ids, self.num_blocks, "slots")
        return raw_bytes(self.kv_caches[layer]).index_select(1, ids).view(self.dtype)

    def read_block(self, layer: int, slot: int) -> torch.Tensor:
        """One slot of one layer, K then V: a new ``(2, block_size, num_kv_heads, head_dim)`` tensor.

        Raises:
            InvalidInput: Bad layer or slot.
        """
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise InvalidInput(f"slot must be an int, got {slot!r}")
        return self.read_blocks(layer, [slot])[:, 0]

    def gather(self, layer: int, slot_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read one sequence's K and V of one layer from host slots, in logical token order.

        The host twin of :meth:`akv.storage.KVStorage.gather`, for a sequence
        whose blocks were swapped out (``slot_table`` lists its host slots in
        logical order).

        Args:
            layer: Layer index in ``[0, num_layers)``.
            slot_table: ``(n,)`` int32/int64 host slots in logical order.
            num_tokens: Tokens to read, at most ``n * block_size``.

        Returns:
            ``(key, value)``, each a new ``(num_tokens, num_kv_heads, head_dim)``
            CPU tensor of the pool's dtype.

        Raises:
            InvalidInput: Bad layer, slot out of range, or too many tokens.
        """
        self._check_layer(layer)
        if not isinstance(slot_table, torch.Tensor):
            raise InvalidInput(f"slot_table must be a torch.Tensor, got {type(slot_table).__name__}")
        ids = index_tensor(slot_table, "slot_table").cpu()
        capacity = ids.numel() * self.block_size
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 <= num_tokens <= capacity:
            raise InvalidInput(
                f"num_tokens must be an int in [0, {capacity}] for {ids.numel()} slots, got {num_tokens!r}"
            )
        needed = ids[: -(-num_tokens // self.block_size)]
        check_range(needed, self.num_blocks, "slot_table")
        # (2, n, block_size, H, D) -> (2, n * block_size, H, D)
        kv = raw_bytes(self.kv_caches[layer]).index_select(1, needed).flatten(1, 2)[:, :num_tokens].view(self.dtype)
        return kv[0], kv[1]

    def __repr__(self) -> str:
        return (
            f"HostKVStorage(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, pinned={self.pinned})"
        )
