"""One running sequence as bytes: its tokens and computed K/V, checksummed and fingerprinted.

For moving a request between instances (``KVCacheManager.snapshot_sequence``
/ ``restore_sequence``). Layout, all integers little-endian::

    b"AKVSEQ\\x00\\x01"                 8 bytes: magic and format version 1
    header length                      u64
    header                             ASCII JSON (fields below)
    tokens                             int32 (num_tokens,)
    per layer: K then V                each (num_computed, num_kv_heads, head_dim), the model's dtype
    xxh3_128                           16 bytes, of everything before it

Header fields: ``format`` (``"akv-sequence"``), ``fingerprint``
(:meth:`~akv.config.KVCacheConfig.fingerprint`), ``storage`` (``"tensors"``
or ``"none"``: no K/V bytes), ``namespace`` (tagged, as in a snapshot
manifest), ``num_tokens``, ``num_computed``. The checksum is checked before
anything else is parsed, so a flipped or missing byte anywhere is
``SnapshotError("corrupt")``; another configuration is ``"foreign"``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from akv.config import KVCacheConfig
from akv.errors import SnapshotError
from akv.storage.kv_pool import torch_dtype
from akv.storage.snapshot_manifest import fingerprint_differences
from akv.storage.snapshot_record import decode_namespace, encode_namespace

MAGIC = b"AKVSEQ\x00\x01"
#: What a SnapshotError of a sequence blob names as its path.
BLOB_PATH = "<sequence blob>"
_U64 = struct.Struct("<Q")
_DIGEST_BYTES = 16
_FIELDS = {"format", "fingerprint", "storage", "namespace", "num_tokens", "num_computed"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceBlob:
    """A decoded sequence.

    Attributes:
        namespace: Its prefix-cache namespace.
        tokens: int32 ``(num_tokens,)`` token history.
        num_computed: Leading tokens whose K/V the blob holds.
        layers: Per layer ``(key, value)``, each ``(num_computed, num_kv_heads,
            head_dim)`` CPU tensors of the model's dtype; ``None`` without K/V.
    """

    namespace: Hashable
    tokens: np.ndarray
    num_computed: int
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None


def encode_sequence(config: KVCacheConfig, blob: SequenceBlob) -> bytes:
    """The bytes of ``blob`` under ``config`` (its fingerprint and storage are recorded)."""
    header = {
        "format": "akv-sequence",
        "fingerprint": config.fingerprint(),
        "storage": "none" if blob.layers is None else "tensors",
        "namespace": encode_namespace(blob.namespace),
        "num_tokens": int(blob.tokens.shape[0]),
        "num_computed": blob.num_computed,
    }
    text = json.dumps(header, ensure_ascii=True, sort_keys=True).encode("ascii")
    parts = [MAGIC, _U64.pack(len(text)), text, np.ascontiguousarray(blob.tokens, dtype="<i4").tobytes()]
    for key, value in blob.layers or ():
        for tensor in (key, value):
            parts.append(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    body = b"".join(parts)
    return body + xxhash.xxh3_128_digest(body)


def decode_sequence(config: KVCacheConfig, data: object) -> SequenceBlob:
    """Check and decode bytes from :func:`encode_sequence`.

    Raises:
        SnapshotError: ``"corrupt"`` (not bytes, wrong magic, checksum,
            header or size), ``"format"`` (another format), ``"foreign"``
            (another configuration fingerprint, or no K/V for a manager that
            holds K/V).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotError("corrupt", BLOB_PATH, f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < len(MAGIC) + _U64.size + _DIGEST_BYTES or not data.startswith(MAGIC[:6]):
        raise SnapshotError("corrupt", BLOB_PATH, "not an akv sequence blob")
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if xxhash.xxh3_128_digest(body) != digest:
        raise SnapshotError("corrupt", BLOB_PATH, "checksum differs")
    if not data.startswith(MAGIC):
        raise SnapshotError("format", BLOB_PATH, f"format version {data[6:8].hex()} is not 0001")
    header, offset = _header(body)
    differences = fingerprint_differences(header["fingerprint"], config.fingerprint())
    if differences:
        raise SnapshotError("foreign", BLOB_PATH, "saved under another configuration: " + "; ".join(differences))
    if header["storage"] == "none" and config.storage == "tensors":
        raise SnapshotError("foreign", BLOB_PATH, "a blob without K/V for a manager that holds K/V")
    n, computed = header["num_tokens"], header["num_computed"]
    tokens = np.frombuffer(body, dtype="<i4", count=n, offset=offset).astype(np.int32)
    offset += 4 * n
    layers = _layers(config, body, offset, computed) if header["storage"] == "tensors" else None
    if layers is None and offset != len(body):
        raise SnapshotError("corrupt", BLOB_PATH, "bytes after the tokens of a blob without K/V")
    namespace = decode_namespace(header["namespace"])
    return SequenceBlob(namespace=namespace, tokens=tokens, num_computed=computed, layers=layers)


def _header(body: bytes) -> tuple[dict, int]:
    """The parsed header and the offset after it; checked field by field."""
    (length,) = _U64.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _U64.size
    try:
        header = json.loads(body[start : start + length].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise SnapshotError("corrupt", BLOB_PATH, "the header is not ASCII JSON") from None
    if type(header) is not dict or set(header) != _FIELDS or header["format"] != "akv-sequence":
        raise SnapshotError("format", BLOB_PATH, "not an akv-sequence header")
    n, computed = header["num_tokens"], header["num_computed"]
    if not (type(n) is int and type(computed) is int and 0 <= computed <= n and n >= 1):
        raise SnapshotError("corrupt", BLOB_PATH, f"bad counts num_tokens={n!r} num_computed={computed!r}")
    if header["storage"] not in ("none", "tensors") or type(header["fingerprint"]) is not dict:
        raise SnapshotError("corrupt", BLOB_PATH, "bad storage or fingerprint field")
    try:
        decode_namespace(header["namespace"])
    except ValueError as exc:
        raise SnapshotError("corrupt", BLOB_PATH, f"bad namespace: {exc}") from None
    if start + length + 4 * n > len(body):
        raise SnapshotError("corrupt", BLOB_PATH, "shorter than its header says")
    return header, start + length


def _layers(config: KVCacheConfig, body: bytes, offset: int, computed: int) -> list:
    """Per layer ``(key, value)`` tensors read from ``body`` at ``offset``; the size must match exactly."""
    model = config.model
    shape = (computed, model.num_kv_heads, model.head_dim)
    dtype = torch_dtype(model.dtype)
    nbytes = computed * model.num_kv_heads * model.head_dim * model.dtype_bytes
    if offset + 2 * model.num_layers * nbytes != len(body):
        raise SnapshotError("corrupt", BLOB_PATH, "its K/V bytes do not match its counts and model")
    raw = torch.frombuffer(bytearray(body[offset:]), dtype=torch.uint8) if nbytes else None
    layers = []
    for layer in range(model.num_layers):
        pair = []
        for half in range(2):
            start = (2 * layer + half) * nbytes
            chunk = raw[start : start + nbytes] if raw is not None else torch.zeros(0, dtype=torch.uint8)
            pair.append(chunk.view(dtype).reshape(shape))
        layers.append((pair[0], pair[1]))
    return layers
