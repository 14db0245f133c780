"""Configuration of a :class:`~akv.manager.KVCacheManager` and model shape presets.

Everything is a frozen, keyword-only, slotted dataclass validated in
``__post_init__`` with :class:`~akv.errors.InvalidInput` (a ``ValueError``; never ``assert``). No torch import:
dtypes are named by string and resolved by :mod:`akv.storage`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from akv.core.block_key import KEY_FUNCTION, KEY_VERSION
from akv.core.eviction_policy import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES
from akv.core.ids import NUMPY_INTEGER_TYPES, describe
from akv.errors import InvalidInput

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

#: Largest block count: block ids are int32 in block tables.
MAX_NUM_BLOCKS = 2**31 - 1
#: Largest tokens per block (the ``akv replay --block-size`` bound).
MAX_BLOCK_SIZE = 2**16
#: Largest vocabulary: token ids are stored as int32.
MAX_VOCAB_SIZE = 2**31
#: Most pool shards (one actor task each; the ``akv replay --shards`` bound).
MAX_NUM_SHARDS = 1024
#: Largest layer count, KV head count and head dim of a :class:`ModelShape`.
MAX_MODEL_DIM = 2**14
#: Device strings a config accepts: a device type, optionally ``:index``.
DEVICE_PATTERN = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,3})?")
_FLOAT_TYPES = frozenset({float, int, Fraction, np.float16, np.float32, np.float64})


def _int_field(owner: object, field: str, hi: int) -> None:
    """Check ``owner.field`` is an exact int (numpy ints made int) in ``[1, hi]``, normalizing in place."""
    value = getattr(owner, field)
    if type(value) in NUMPY_INTEGER_TYPES:
        value = int(value)
        object.__setattr__(owner, field, value)  # frozen dataclass
    if type(value) is not int or not 1 <= value <= hi:
        raise InvalidInput(f"{field} must be a positive int (at most {hi:,}), got {describe(value)}")


def _bool_field(owner: object, field: str) -> None:
    """Check ``owner.field`` is a bool (``numpy.bool_`` made bool), normalizing in place."""
    value = getattr(owner, field)
    if type(value) is np.bool_:
        object.__setattr__(owner, field, bool(value))
    elif type(value) is not bool:
        raise InvalidInput(f"{field} must be a bool, got {describe(value)}")


def _events_window(owner: object) -> None:
    """Check ``owner.events_window`` is an exact int (numpy ints made int) in ``[0, MAX_NUM_BLOCKS]``."""
    value = owner.events_window
    if type(value) in NUMPY_INTEGER_TYPES:
        value = int(value)
        object.__setattr__(owner, "events_window", value)
    if type(value) is not int or not 0 <= value <= MAX_NUM_BLOCKS:
        raise InvalidInput(f"events_window must be an int in [0, {MAX_NUM_BLOCKS:,}] (batches), got {describe(value)}")


def _str_field(owner: object, field: str, allowed: Any) -> str:
    """Check ``owner.field`` is an exact str in ``allowed`` (compared only once it is a str)."""
    value = getattr(owner, field)
    if type(value) is not str or value not in allowed:
        raise InvalidInput(f"{field} must be one of {', '.join(map(repr, allowed))}, got {describe(value)}")
    return value


def _device(value: object) -> str:
    """The device string of a str or ``torch.device`` (exact types), checked against :data:`DEVICE_PATTERN`."""
    torch = sys.modules.get("torch")  # a torch.device exists only once torch is imported
    if torch is not None and type(value) is torch.device:
        value = str(value)
    if type(value) is not str or DEVICE_PATTERN.fullmatch(value) is None:
        raise InvalidInput(
            f"device must be a str such as 'cpu', 'cuda' or 'cuda:1' (types cpu, cuda, mps, xpu; "
            f"index up to 3 digits) or a torch.device, got {describe(value)}"
        )
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The attention shape that sizes one block of K/V.

    Args:
        name: Preset name, for reports: an exact ``str``.
        num_layers: Attention layers (one K/V tensor each).
        num_kv_heads: Key/value heads per layer (after grouped-query sharing).
        head_dim: Elements per head.
        dtype: Element type name (an exact ``str``): ``float32``, ``float16``,
            ``bfloat16`` or ``float8_e4m3fn``.

    The three sizes are exact ints (numpy integers are made ``int``) in
    ``[1, MAX_MODEL_DIM]``.

    Raises:
        InvalidInput: A field of the wrong type or out of range.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        if type(self.name) is not str:
            raise InvalidInput(f"name must be a str, got {describe(self.name)}")
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            _int_field(self, field, MAX_MODEL_DIM)
        _str_field(self, "dtype", tuple(_DTYPE_BYTES))

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
        device: torch device for the tensors: a string (``"cpu"``, ``"cuda"``,
            ``"cuda:1"``) or a ``torch.device``, stored as a string. Checked
            but otherwise ignored when ``storage == "none"``.
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
            and one ``Evict`` message to the shard per batch). A shard with a
            host tier evicts each pass's whole deficit (up to the high
            watermark's blocks) in one batch, since each is a copy batch.
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
        enable_events: Turn every change to the set of cached keys into cache
            events (vLLM's ``enable_kv_cache_events``): each shard keeps a
            key index, and ``subscribe_events`` / ``cached_keys`` work (see
            docs/events.md). Off by default: the step path then pays nothing.
        events_window: Event batches kept for ``subscribe_events(since=...)``
            resumption (0 keeps none).
        snapshot_dir: Snapshot directory (docs/persistence.md) for
            ``save_on_exit`` and ``load_on_enter``: a non-empty ``str`` or
            ``os.PathLike`` (stored as ``str``), or ``None``.
        save_on_exit: Save a snapshot to ``snapshot_dir`` when ``async with``
            exits cleanly (needs ``snapshot_dir``).
        load_on_enter: Load ``snapshot_dir``'s snapshot on entry (needs
            ``snapshot_dir``); a refused snapshot starts cold with a
            ``snapshot.refused`` warning unless ``require_snapshot``.
        require_snapshot: With ``load_on_enter``, a refused snapshot raises
            :class:`~akv.errors.SnapshotError` from entry instead.
        host_blocks: Blocks of the host-memory tier (all shards together; 0,
            the default: no host tier). Cached blocks that eviction picks are
            demoted there instead of dropped, prefix hits on them are promoted
            back, and preempted sequences can be swapped out to it (see
            docs/host_tier.md). With ``storage == "tensors"`` it is a host
            torch pool of the device pool's layout (pinned memory when the
            device is CUDA); with ``"none"`` it is modelled in metadata only.
        host_gib: The host tier's size in GiB instead of ``host_blocks``
            (``floor(host_gib * 2**30 / bytes_per_block)`` blocks); a real
            number > 0, or ``None``. Give at most one of the two.
        copy_process: With CPU tensors and a host tier (Linux), run the
            copies between the tiers in a child process on shared memory
            (:mod:`akv.storage.copy_process`; ``True``, the default), off the
            event loop's GIL; ``False``: on a worker thread.

    Types are exact: counts are ``int`` (numpy integers are made ``int``) in
    ``[1, limit]`` (:data:`MAX_NUM_BLOCKS` for ``num_blocks``,
    ``eviction_batch_blocks``, ``inbox_capacity`` and ``max_headroom_blocks``;
    :data:`MAX_BLOCK_SIZE`, :data:`MAX_VOCAB_SIZE`, :data:`MAX_NUM_SHARDS`
    for the others), flags are ``bool`` (``numpy.bool_`` is made ``bool``),
    watermarks are ``float``, ``int`` or ``Fraction`` (numpy floats too;
    stored as ``float``), names are exact ``str``, ``model`` is a :class:`ModelShape`,
    and ``device`` is a ``str`` matching :data:`DEVICE_PATTERN` or a
    ``torch.device`` (stored as its string). No caller object is compared,
    hashed or handed to torch before its type is checked.

    Raises:
        InvalidInput: Any field of the wrong type or out of range (a
            ``ValueError`` subclass).
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
    enable_events: bool = False
    events_window: int = 1024
    snapshot_dir: str | None = None
    save_on_exit: bool = False
    load_on_enter: bool = False
    require_snapshot: bool = False
    host_blocks: int = 0
    host_gib: float | None = None
    copy_process: bool = True

    def __post_init__(self) -> None:
        limits = {
            "num_blocks": MAX_NUM_BLOCKS,
            "block_size": MAX_BLOCK_SIZE,
            "vocab_size": MAX_VOCAB_SIZE,
            "num_shards": MAX_NUM_SHARDS,
            "eviction_batch_blocks": MAX_NUM_BLOCKS,
            "inbox_capacity": MAX_NUM_BLOCKS,
            "max_headroom_blocks": MAX_NUM_BLOCKS,
        }
        for field, hi in limits.items():
            _int_field(self, field, hi)
        if self.num_shards > self.num_blocks:
            raise InvalidInput(f"num_shards ({self.num_shards}) exceeds num_blocks ({self.num_blocks})")
        _bool_field(self, "enable_prefix_cache")
        _bool_field(self, "debug_invariants")
        _bool_field(self, "enable_events")
        _bool_field(self, "copy_process")
        _events_window(self)
        _str_field(self, "storage", ("tensors", "none"))
        if type(self.eviction_policy) is not str or self.eviction_policy not in EVICTION_POLICIES:
            raise InvalidInput(
                f"unknown eviction_policy {describe(self.eviction_policy)}; known: {', '.join(EVICTION_POLICIES)}"
            )
        device = _device(self.device)
        if device is not self.device:
            object.__setattr__(self, "device", device)
        for field in ("low_watermark", "high_watermark"):
            value = getattr(self, field)
            if type(value) not in _FLOAT_TYPES:
                raise InvalidInput(f"{field} must be a real number in [0, 1], got {describe(value)}")
            object.__setattr__(self, field, float(value))
        if not (0.0 <= self.low_watermark <= self.high_watermark <= 1.0):
            raise InvalidInput(
                "watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1, "
                f"got low={self.low_watermark}, high={self.high_watermark}"
            )
        if type(self.model) is not ModelShape:
            raise InvalidInput(f"model must be a ModelShape, got {type(self.model).__name__}")
        _snapshot_fields(self)
        _host_fields(self)

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
        return _split(0, self.num_blocks, self.num_shards)

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier (``host_blocks``, or ``host_gib`` converted; 0: no host tier)."""
        if self.host_gib is None:
            return self.host_blocks
        return int(self.host_gib * 2**30 // self.bytes_per_block)

    @property
    def host_block_base(self) -> int:
        """Id of host slot 0 in the prefix tree: ``num_blocks + 1``, right after the null block.

        Host slots and device blocks share one id space in the tree (a cached
        block's id says where it is: below :attr:`null_block_id` a device
        block, from here on host slot ``id - host_block_base``), so a block
        that changes tier keeps its node and only changes its id there.
        """
        return self.num_blocks + 1

    def host_shard_ranges(self) -> list[range]:
        """Each shard's contiguous range of host-tier ids (from :attr:`host_block_base`), sizes differing by at most one."""
        return _split(self.host_block_base, self.num_host_blocks, self.num_shards)

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


def _split(start: int, total: int, parts: int) -> list[range]:
    """``total`` ids from ``start`` in ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    ranges = []
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _host_fields(config: KVCacheConfig) -> None:
    """Validate (and normalize) ``host_blocks`` and ``host_gib``."""
    value = config.host_blocks
    if type(value) in NUMPY_INTEGER_TYPES:
        value = int(value)
        object.__setattr__(config, "host_blocks", value)
    if type(value) is not int or not 0 <= value <= MAX_NUM_BLOCKS:
        raise InvalidInput(f"host_blocks must be an int in [0, {MAX_NUM_BLOCKS:,}], got {describe(value)}")
    gib = config.host_gib
    if gib is not None:
        if type(gib) not in _FLOAT_TYPES or not 0 < float(gib) < 2**40:
            raise InvalidInput(f"host_gib must be None or a real number in (0, 2**40), got {describe(gib)}")
        object.__setattr__(config, "host_gib", float(gib))
        if value:
            raise InvalidInput("give host_blocks or host_gib, not both")
    num = config.num_host_blocks
    if gib is not None and num == 0:
        raise InvalidInput(f"host_gib={gib} is less than one block of {config.bytes_per_block:,} bytes")
    if num > MAX_NUM_BLOCKS:
        raise InvalidInput(f"host_gib={gib} gives {num:,} host blocks, more than {MAX_NUM_BLOCKS:,}")
    if 0 < num < config.num_shards:
        raise InvalidInput(f"a host tier of {num} blocks cannot be split over {config.num_shards} shards")


def _snapshot_fields(config: KVCacheConfig) -> None:
    """Validate (and normalize) the snapshot fields of ``config``."""
    path = config.snapshot_dir
    if path is not None:
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if type(path) is not str or not path or "\x00" in path:
            raise InvalidInput(f"snapshot_dir must be None or a non-empty path, got {describe(config.snapshot_dir)}")
        object.__setattr__(config, "snapshot_dir", path)
    for field in ("save_on_exit", "load_on_enter", "require_snapshot"):
        _bool_field(config, field)
    if (config.save_on_exit or config.load_on_enter) and path is None:
        raise InvalidInput("save_on_exit and load_on_enter need a snapshot_dir")
    if config.require_snapshot and not config.load_on_enter:
        raise InvalidInput("require_snapshot needs load_on_enter")
