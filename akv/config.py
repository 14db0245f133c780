"""Configuration of a :class:`~akv.manager.KVCacheManager` and model shape presets.

Everything is a frozen, keyword-only, slotted dataclass validated in
``__post_init__`` with :class:`~akv.errors.InvalidInput` (a ``ValueError``; never ``assert``). No torch import:
dtypes are named by string and resolved by :mod:`akv.storage`.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass

import numpy as np

from akv.core.block_key import KEY_FUNCTION, KEY_VERSION
from akv.core.eviction_policy import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES
from akv.errors import InvalidInput

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The attention shape that sizes one block of K/V.

    Args:
        name: Preset name, for reports.
        num_layers: Attention layers (one K/V tensor each).
        num_kv_heads: Key/value heads per layer (after grouped-query sharing).
        head_dim: Elements per head.
        dtype: Element type name: ``float32``, ``float16``, ``bfloat16`` or
            ``float8_e4m3fn``.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"{field} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise InvalidInput(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return _DTYPE_BYTES[self.dtype]

    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers.

        ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes`` (the factor 2
        is K and V), as in vLLM's ``page_size_bytes / block_size``.
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block (``block_size`` tokens) across all layers."""
        return self.bytes_per_token() * block_size


#: Shape presets. ``tiny`` runs with real CPU tensors; the others are real model
#: shapes (from the models' published configs) for metadata-only simulation.
MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(name="tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32"),
    "llama-3-8b": ModelShape(name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    "llama-3-70b": ModelShape(name="llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    "qwen2.5-7b": ModelShape(name="qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
    "mistral-7b": ModelShape(name="mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
}


def model_shape(name: str) -> ModelShape:
    """Return the preset named ``name``.

    Raises:
        InvalidInput: Unknown preset; the message lists the known ones.
    """
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise InvalidInput(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class KVCacheConfig:
    """Everything a :class:`~akv.manager.KVCacheManager` needs to start.

    Args:
        num_blocks: Usable blocks in the pool (all shards together); the storage
            holds one more, the null block (:attr:`null_block_id`).
        block_size: Tokens per block (vLLM default 16).
        model: Attention shape that sizes the tensors.
        storage: ``"tensors"`` allocates one K/V tensor per layer on
            ``device``; ``"none"`` keeps metadata only (block tables, refcounts,
            prefix cache) so real-model-sized pools can be simulated.
        device: torch device string for the tensors (``"cpu"``, ``"cuda"``,
            ``"cuda:1"``). Ignored when ``storage == "none"``.
        vocab_size: Token ids must lie in ``[0, vocab_size)``.
        num_shards: Pool shards; block ids are split into contiguous ranges.
            Prefix hits are shard-local (a block lives in one device partition).
        enable_prefix_cache: Publish committed full blocks and match prompts.
        low_watermark: Free fraction (0.0-1.0) below which the eviction loop
            starts evicting cached blocks.
        high_watermark: Free fraction up to which it evicts once started.
        max_headroom_blocks: Cap, in blocks per shard, on the free blocks the
            eviction loop keeps (the high watermark's count; the low one's
            shrinks by the same factor). A fraction of a large pool would keep
            thousands of blocks empty that could hold cached prefixes: on the
            Mooncake conversation trace at 770,048 blocks, 5 % cost 0.1 points
            of hit rate (docs/benchmarks.md, "Eviction quality"). See
            :meth:`watermark_blocks`.
        eviction_batch_blocks: Blocks evicted per eviction batch (one log line
            and one tree message per batch).
        inbox_capacity: Bound of every actor's inbox (messages).
        debug_invariants: Check block-state conservation after every message
            (cheap counters) and raise on violation; for tests and stress runs.
        eviction_policy: Which cached block to evict first, by name (see
            :data:`akv.core.eviction_policy.EVICTION_POLICIES`). Default
            :data:`~akv.core.eviction_policy.DEFAULT_EVICTION_POLICY`,
            ``"slru"``: never-hit blocks go before hit ones; on the Mooncake
            conversation trace it beats LRU by 0.8-0.9 points of hit rate
            (+19 % relative at the tight pool) at LRU's O(1) cost
            (docs/benchmarks.md, "Eviction quality").

    Raises:
        InvalidInput: Any field out of range (a ``ValueError`` subclass).
    """

    num_blocks: int
    block_size: int = 16
    model: ModelShape = MODEL_SHAPES["tiny"]
    storage: str = "tensors"
    device: str = "cpu"
    vocab_size: int = 128_256
    num_shards: int = 1
    enable_prefix_cache: bool = True
    low_watermark: float = 0.02
    high_watermark: float = 0.05
    max_headroom_blocks: int = 2048
    eviction_batch_blocks: int = 256
    inbox_capacity: int = 1024
    debug_invariants: bool = False
    eviction_policy: str = DEFAULT_EVICTION_POLICY

    def __post_init__(self) -> None:
        for field in (
            "num_blocks",
            "block_size",
            "vocab_size",
            "num_shards",
            "eviction_batch_blocks",
            "inbox_capacity",
            "max_headroom_blocks",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"{field} must be a positive int, got {value!r}")
        if self.num_shards > self.num_blocks:
            raise InvalidInput(f"num_shards ({self.num_shards}) exceeds num_blocks ({self.num_blocks})")
        if self.storage not in ("tensors", "none"):
            raise InvalidInput(f"storage must be 'tensors' or 'none', got {self.storage!r}")
        for field in ("low_watermark", "high_watermark"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
                raise InvalidInput(f"{field} must be a real number in [0, 1], got {value!r}")
        if not (0.0 <= self.low_watermark <= self.high_watermark <= 1.0):
            raise InvalidInput(
                "watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1, "
                f"got low={self.low_watermark}, high={self.high_watermark}"
            )
        if not isinstance(self.model, ModelShape):
            raise InvalidInput(f"model must be a ModelShape, got {type(self.model).__name__}")
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in EVICTION_POLICIES:
            raise InvalidInput(
                f"unknown eviction_policy {self.eviction_policy!r}; known: {', '.join(EVICTION_POLICIES)}"
            )

    def watermark_blocks(self, shard_blocks: int) -> tuple[float, int]:
        """The eviction loop's thresholds for a shard of ``shard_blocks`` blocks, in free blocks.

        ``high = min(ceil(high_watermark * shard_blocks), max_headroom_blocks)``
        (the product rounded first to 1e-9, so that ``0.07 * 100`` is 7, not
        8) and ``low = low_watermark * shard_blocks`` scaled down by the same
        factor as ``high``, never above it. The loop wakes when a shard's free
        blocks drop below ``low`` (while it holds cached blocks) and evicts
        until they reach ``high``.

        Returns:
            ``(low, high)``: low as a float (compared with ``<``), high as an
            int (blocks).

        Raises:
            InvalidInput: ``shard_blocks`` is not a positive int.
        """
        if not isinstance(shard_blocks, int) or isinstance(shard_blocks, bool) or shard_blocks < 1:
            raise InvalidInput(f"shard_blocks must be a positive int, got {shard_blocks!r}")
        want = math.ceil(float(self.high_watermark) * shard_blocks - 1e-9)
        high = min(want, self.max_headroom_blocks)
        low = float(self.low_watermark) * shard_blocks + 0.0  # + 0.0: no -0.0
        if high < want:
            low *= high / want
        return min(low, float(high)), high

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        return self.model.bytes_per_block(self.block_size)

    @property
    def null_block_id(self) -> int:
        """The reserved block id that pads block tables: ``num_blocks``, one past the usable blocks.

        vLLM pads block tables with a null block that is never allocated (its
        block 0). akv keeps ids ``0 .. num_blocks - 1`` as the usable blocks
        (their ids stay as they were, shard ranges included) and reserves the
        id after them: the storage holds ``num_blocks + 1`` blocks per layer,
        the last one the null block, which is never allocated, cached or
        evicted; a model runner may write garbage into its slots.
        """
        return self.num_blocks

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K/V tensors: ``(num_blocks + 1) * bytes_per_block``, the null block included."""
        return (self.num_blocks + 1) * self.bytes_per_block

    def shard_ranges(self) -> list[range]:
        """Contiguous block-id range of each shard, sizes differing by at most one."""
        base, extra = divmod(self.num_blocks, self.num_shards)
        ranges, start = [], 0
        for shard in range(self.num_shards):
            size = base + (1 if shard < extra else 0)
            ranges.append(range(start, start + size))
            start += size
        return ranges

    def fingerprint(self) -> dict:
        """What decides whether cached K/V and block keys made under this configuration can be reused.

        A snapshot records it and refuses to load under another one. It holds
        the model (preset name, layers, KV heads, head dim, dtype), the block
        size, the vocabulary size, and the block key function and version
        (:mod:`akv.core.block_key`); not the pool's size, sharding, device,
        watermarks or eviction policy, which a warm restart may change.

        Returns:
            A JSON-serializable dict of str, int and nested dicts.
        """
        m = self.model
        return {
            "model": {
                "name": m.name,
                "num_layers": m.num_layers,
                "num_kv_heads": m.num_kv_heads,
                "head_dim": m.head_dim,
                "dtype": m.dtype,
            },
            "block_size": self.block_size,
            "vocab_size": self.vocab_size,
            "key_function": KEY_FUNCTION,
            "key_version": KEY_VERSION,
        }

    def fingerprint_hex(self) -> str:
        """SHA-256 of the canonical JSON of :meth:`fingerprint` (sorted keys, no spaces, ASCII).

        Returns:
            64 lowercase hex digits, equal for equal fingerprints on any machine.
        """
        text = json.dumps(self.fingerprint(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()
