"""Content keys of full blocks: what a block holds, independent of where it lives.

A full block's key is a chained hash, as in vLLM's prefix cache
(``hash_block_tokens`` in ``vllm/v1/core/kv_cache_utils.py``: the hash of
``(parent_block_hash, token_ids, extra_keys)``, the first block chained to a
fixed root seed) and SGLang's HiCache storage keys (``get_hash_str`` in
``python/sglang/srt/mem_cache/hicache_storage.py``: the page's token ids
hashed after the prior page's hash)::

    key[0] = H(ROOT,    tokens[0:bs],      namespace, extra_keys)
    key[i] = H(key[i-1], tokens[i*bs:(i+1)*bs], namespace, extra_keys)

so a key names the whole prefix up to and including its block, and the same
prompt under the same namespace gets the same keys in every shard, process
and machine, whatever block ids hold it. A key holds no shard index, device
id or block id.

``H`` is xxhash's ``xxh3_128`` (:data:`KEY_FUNCTION`, 128 bits, its canonical
big-endian digest) over a canonical encoding of the fields, each type-tagged
and length-prefixed, so distinct inputs give distinct byte strings:

- a domain prefix ``b"akv.block_key"`` and :data:`KEY_VERSION` (one byte);
- the parent: ``b"R"`` for the root, or ``b"P"`` and the parent's 16 bytes;
- the tokens: ``b"K"``, their count (uint64 LE) and the ids as
  little-endian **int32**, the bytes the prefix tree stores and compares
  (``akv.core.tokens.as_token_array`` hands out int32, so keying costs no
  conversion); ids must lie in ``[0, 2**31)``, a wider vocabulary would be
  a new :data:`KEY_VERSION`;
- the namespace and the extra keys (a LoRA id, a cache salt), each
  :func:`encode_plain` of a plain value (:mod:`akv.core.ids`).

Never Python's ``hash()``: it is salted per process for ``str`` and
``bytes``. A key is an *identity*, not a proof: 128 bits make an accidental
collision unlikely, not impossible, and a key may come from elsewhere (a
snapshot, another instance's events). So the prefix tree still matches on the
stored token ids themselves and never on keys alone; a collision can at worst
make two blocks share a name, never serve one prompt's K/V to another
(``tests/test_block_key.py`` forces every key equal and checks this).
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import xxhash

from akv.core.ids import plain_id
from akv.core.tokens import as_token_array
from akv.errors import InvalidInput

#: The hash function of block keys (part of :meth:`akv.config.KVCacheConfig.fingerprint`).
KEY_FUNCTION = "xxh3_128"
#: Version of the encoding hashed; bumped whenever a key of the same input would change.
KEY_VERSION = 1
#: Bytes per key.
KEY_BYTES = 16

_TOKEN_LIMIT = 2**31  # token ids are keyed as int32
_U64 = struct.Struct("<Q")
_PREFIX = b"akv.block_key" + bytes([KEY_VERSION])
_ROOT = b"R"
_PARENT = b"P"
_TOKENS = b"K"
_digest = xxhash.xxh3_128_digest  # the one hash call; a test forces every key equal through it


def encode_plain(value: Any) -> bytes:
    """Canonical bytes of a plain value (a namespace, an extra key): stable everywhere, distinct per value.

    One type tag, then a uint64 little-endian length, then the payload:
    ``N`` (``None``, no length), ``I`` (an ``int``: minimal two's-complement
    little-endian bytes), ``S`` (a ``str``: UTF-8, lone surrogates kept by
    ``surrogatepass``), ``B`` (``bytes``), ``T`` (a tuple: the number of
    elements, then each element's encoding). Every encoding is prefix-free,
    so distinct plain values (``1``, ``"1"``, ``b"1"``, ``(1,)``, ``None``)
    never share bytes. numpy scalars are first normalized by
    :func:`akv.core.ids.plain_id`, so ``np.int64(1)`` encodes as ``1``.

    Args:
        value: ``None``, or a plain value (:mod:`akv.core.ids`).

    Returns:
        The encoding, ``O(size of value)`` bytes.

    Raises:
        InvalidInput: ``value`` is not a plain value (a bool, a float, a list...).
    """
    return _encode(plain_id(value, "a namespace or extra key", allow_none=True))


def _encode(value: Hashable) -> bytes:
    """:func:`encode_plain` of a value already normalized by ``plain_id``."""
    if value is None:
        return b"N"
    kind = type(value)
    if kind is int:
        payload = value.to_bytes((~value if value < 0 else value).bit_length() // 8 + 1, "little", signed=True)
        return b"I" + _U64.pack(len(payload)) + payload
    if kind is str:
        payload = value.encode("utf-8", "surrogatepass")
        return b"S" + _U64.pack(len(payload)) + payload
    if kind is bytes:
        return b"B" + _U64.pack(len(value)) + value
    return b"T" + _U64.pack(len(value)) + b"".join(map(_encode, value))


def chain_suffix(namespace: Hashable, extra_keys: Sequence[Hashable] = ()) -> bytes:
    """The encoded namespace and extra keys that :func:`chain_keys_raw` appends to every block.

    Args:
        namespace: ``None`` or a plain value (:mod:`akv.core.ids`).
        extra_keys: Plain values (a tuple or list).

    Returns:
        ``encode_plain(namespace) + encode_plain(tuple(extra_keys))``.

    Raises:
        InvalidInput: A value is not plain, or ``extra_keys`` is not a tuple or list.
    """
    if type(extra_keys) not in (tuple, list):
        raise InvalidInput(f"extra_keys must be a tuple or list of plain values, got {type(extra_keys).__name__}")
    return encode_plain(namespace) + encode_plain(tuple(extra_keys))


def _parent_field(parent_key: bytes | None) -> bytes:
    """The encoded parent: the root marker, or the parent's key."""
    if parent_key is None:
        return _ROOT
    if type(parent_key) is not bytes or len(parent_key) != KEY_BYTES:
        raise InvalidInput(f"parent_key must be None or {KEY_BYTES} bytes, got {type(parent_key).__name__}")
    return _PARENT + parent_key


def _tokens(token_ids: Any) -> np.ndarray:
    """``token_ids`` as a fresh int32 array, validated as ids in ``[0, 2**31)``."""
    return as_token_array(token_ids, _TOKEN_LIMIT, what="token_ids of a block key")


def block_key(
    parent_key: bytes | None,
    token_ids: Any,
    namespace: Hashable = None,
    extra_keys: Sequence[Hashable] = (),
) -> bytes:
    """Key of one full block (see the module docstring for the encoding).

    Args:
        parent_key: Key of the block before it in the chain, or ``None`` for
            the first block of a prompt.
        token_ids: The block's token ids, shape ``(block_size,)``, ints in
            ``[0, 2**31)`` (a list, tuple, numpy array or CPU tensor).
        namespace: ``None`` or a plain value (:mod:`akv.core.ids`).
        extra_keys: Plain values that also decide the K/V (a LoRA id, a cache salt).

    Returns:
        :data:`KEY_BYTES` (16) bytes.

    Raises:
        InvalidInput: ``parent_key`` is not ``None`` or 16 bytes, or the
            namespace or an extra key is not a plain value.
        InvalidTokens: Bad token ids (empty, not integers, out of range).
    """
    raw = _tokens(token_ids).astype("<i4", copy=False).tobytes()
    head = _PREFIX + _parent_field(parent_key) + _TOKENS + _U64.pack(len(raw) // 4)
    return _digest(head + raw + chain_suffix(namespace, extra_keys))


def chain_keys(
    token_ids: Any,
    block_size: int,
    namespace: Hashable = None,
    extra_keys: Sequence[Hashable] = (),
) -> list[bytes]:
    """Keys of every full block of a prompt, chained from the root.

    ``chain_keys(t, bs, ns)[i] == block_key(keys[i - 1] or None, t[i*bs:(i+1)*bs], ns)``;
    a trailing partial block gets no key. One validation and one conversion
    for the whole prompt, then one hash call per block (``O(len(token_ids))``).

    Args:
        token_ids: The prompt's token ids, shape ``(n,)``, ints in ``[0, 2**31)``.
        block_size: Tokens per block (an int >= 1).
        namespace: ``None`` or a plain value (:mod:`akv.core.ids`).
        extra_keys: Plain values that also decide the K/V (a LoRA id, a cache salt).

    Returns:
        ``n // block_size`` keys of :data:`KEY_BYTES` bytes, in logical order.

    Raises:
        InvalidInput: ``block_size`` is not an int >= 1, or the namespace or
            an extra key is not a plain value.
        InvalidTokens: Bad token ids.
    """
    if type(block_size) is not int or block_size < 1:
        raise InvalidInput(f"block_size must be an int >= 1, got {block_size!r}")
    raw = _tokens(token_ids).astype("<i4", copy=False).tobytes()
    return chain_keys_raw(raw, block_size, chain_suffix(namespace, extra_keys))


def block_key_raw(parent_key: bytes | None, raw: bytes, suffix: bytes) -> bytes:
    """:func:`block_key` of already validated int32 little-endian token bytes.

    For callers inside akv that hold validated tokens (the prefix tree, a
    snapshot record whose tokens were range-checked): no validation, one hash call.

    Args:
        parent_key: The parent's :data:`KEY_BYTES`-byte key, or ``None`` for a first block.
        raw: The block's token ids as little-endian int32 bytes (``4 * block_size`` bytes).
        suffix: :func:`chain_suffix` of the namespace and extra keys.

    Returns:
        :data:`KEY_BYTES` (16) bytes, equal to ``block_key(parent_key, tokens, namespace, extra_keys)``.
    """
    parent = _ROOT if parent_key is None else _PARENT + parent_key
    return _digest(_PREFIX + parent + _TOKENS + _U64.pack(len(raw) // 4) + raw + suffix)


def chain_keys_raw(raw: bytes, block_size: int, suffix: bytes, parent_key: bytes | None = None) -> list[bytes]:
    """:func:`chain_keys` of already validated int32 little-endian token bytes.

    For callers inside akv that hold the prefix tree's token bytes (no
    validation: the bytes came from validated tokens).

    Args:
        raw: Token ids as little-endian int32 bytes, ``4 * n`` bytes.
        block_size: Tokens per block (>= 1).
        suffix: ``encode_plain(namespace) + encode_plain(tuple(extra_keys))``
            (see :func:`chain_suffix`).
        parent_key: Key of the block before the first one (16 bytes, not
            checked), or ``None`` to chain from the root: a chain continued
            below a cached block (``akv.events.key_index``).

    Returns:
        ``n // block_size`` keys of :data:`KEY_BYTES` bytes.
    """
    width = 4 * block_size
    count = _TOKENS + _U64.pack(block_size)
    digest = _digest
    keys: list[bytes] = []
    parent = _ROOT if parent_key is None else _PARENT + parent_key
    for start in range(0, len(raw) - width + 1, width):
        key = digest(_PREFIX + parent + count + raw[start : start + width] + suffix)
        keys.append(key)
        parent = _PARENT + key
    return keys
