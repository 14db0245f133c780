"""The snapshot manifest and ``CURRENT``: their bytes, and their strict parsing.

``CURRENT`` is one line, ``gen-000042 xxh3_128=<32 hex digits>\\n``: the
generation directory that is the snapshot, and the checksum of that
generation's ``manifest.json`` (whose raw bytes a JSON parse alone would not
protect: a changed digit still parses). The manifest is a JSON object; its
fields are specified in docs/persistence.md and checked here field by field,
so that nothing later reads a value of an unexpected type.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import xxhash

from akv.errors import SnapshotError
from akv.storage.snapshot_files import CHECKSUM, TensorSpec
from akv.storage.snapshot_record import COLUMNS

#: The manifest's ``format`` value.
FORMAT_NAME = "akv-snapshot"
#: The manifest's ``format_version``: bumped on any change a reader of the old version would misread.
FORMAT_VERSION = 1
#: The file in a snapshot directory that names the current generation.
CURRENT_NAME = "CURRENT"
#: The manifest file of a generation.
MANIFEST_NAME = "manifest.json"
#: The metadata columns file of a generation.
BLOCKS_NAME = "blocks.safetensors"
#: Largest manifest read (the namespace table is its only unbounded part).
MAX_MANIFEST_BYTES = 64 << 20

#: safetensors dtype code and bytes per element of each dtype name.
SAFETENSORS_DTYPES = {
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "uint8": ("U8", 1),
    "int32": ("I32", 4),
    "int64": ("I64", 8),
}

_CURRENT = re.compile(rb"(gen-[0-9]{6,12}) " + CHECKSUM.encode() + rb"=([0-9a-f]{32})\n")
GENERATION = re.compile(r"gen-([0-9]{6,12})")


def generation_name(generation: int) -> str:
    """``gen-000042`` for generation 42."""
    return f"gen-{generation:06d}"


def layer_name(layer: int) -> str:
    """``layer-00003.safetensors`` for layer 3."""
    return f"layer-{layer:05d}.safetensors"


def current_line(generation: int, manifest: bytes) -> bytes:
    """The bytes of ``CURRENT`` naming ``generation`` whose manifest is ``manifest``."""
    return f"{generation_name(generation)} {CHECKSUM}={xxhash.xxh3_128_hexdigest(manifest)}\n".encode("ascii")


def parse_current(path: Path, data: bytes) -> tuple[int, str]:
    """``(generation, manifest checksum)`` of ``CURRENT``'s bytes.

    Raises:
        SnapshotError: cause ``"corrupt"`` if it is not one such line.
    """
    match = _CURRENT.fullmatch(data)
    if match is None:
        raise SnapshotError("corrupt", path, f"not a line 'gen-NNNNNN {CHECKSUM}=<32 hex digits>': {data[:80]!r}")
    return int(match.group(1)[4:]), match.group(2).decode("ascii")


def blocks_specs(num_blocks: int, block_size: int) -> list[TensorSpec]:
    """The tensors of ``blocks.safetensors``: one per column of :data:`akv.storage.snapshot_record.COLUMNS`."""
    specs = []
    for name, (dtype, trailing) in COLUMNS.items():
        code, itemsize = SAFETENSORS_DTYPES[dtype.name]
        specs.append(TensorSpec(name, code, (num_blocks, *trailing(block_size)), itemsize))
    return specs


def layer_specs(fingerprint: dict, num_blocks: int) -> list[TensorSpec]:
    """The tensors of one layer file: ``k`` and ``v``, each ``(num_blocks, block_size, num_kv_heads, head_dim)``.

    Together they are the pool's ``(2, num_blocks, block_size, num_kv_heads,
    head_dim)`` block, K then V, in the model's dtype.
    """
    model = fingerprint["model"]
    code, itemsize = SAFETENSORS_DTYPES[model["dtype"]]
    shape = (num_blocks, fingerprint["block_size"], model["num_kv_heads"], model["head_dim"])
    return [TensorSpec("k", code, shape, itemsize), TensorSpec("v", code, shape, itemsize)]


def manifest_bytes(fields: dict) -> bytes:
    """The manifest's bytes: indented JSON, ASCII only (non-ASCII text escaped), ending in a newline."""
    return (json.dumps(fields, indent=1, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _unique(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice in an object")
    return dict(pairs)


def parse_manifest(path: Path, data: bytes, generation: int) -> dict:
    """Parse and check a manifest's fields (not the files it lists).

    Args:
        path: The manifest, for messages.
        data: Its bytes, whose checksum already matched ``CURRENT``.
        generation: The generation ``CURRENT`` names.

    Returns:
        The manifest as a dict, every field of the documented type.

    Raises:
        SnapshotError: ``"format"`` (not an akv snapshot manifest, or another
            format version), ``"corrupt"`` (not JSON, a field missing or of a
            wrong type or value).
    """
    try:
        fields = json.loads(data.decode("ascii"), object_pairs_hook=_unique, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SnapshotError("corrupt", path, f"not a JSON manifest: {exc}") from None
    if type(fields) is not dict or fields.get("format") != FORMAT_NAME:
        raise SnapshotError("format", path, f"not an {FORMAT_NAME} manifest (no 'format': {FORMAT_NAME!r})")
    if fields.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(
            "format", path, f"format version {fields.get('format_version')!r}; this akv reads version {FORMAT_VERSION}"
        )
    problem = _field_problem(fields, generation)
    if problem is not None:
        raise SnapshotError("corrupt", path, problem)
    return fields


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _field_problem(fields: dict, generation: int) -> str | None:
    """What is wrong with the manifest's fields, or ``None``."""
    expected = {
        "format": str,
        "format_version": int,
        "generation": int,
        "created_unix_s": float,
        "fingerprint": dict,
        "storage": str,
        "num_blocks": int,
        "num_layers": int,
        "namespaces": list,
        "checksum": str,
        "files": dict,
    }
    for name, kind in expected.items():
        if type(fields.get(name)) is not kind:
            return f"field {name!r} is missing or not a {kind.__name__}"
    if set(fields) != set(expected):
        return f"unexpected fields {sorted(set(fields) - set(expected))}"
    if fields["generation"] != generation:
        return f"it says generation {fields['generation']}, but CURRENT names generation {generation}"
    if fields["checksum"] != CHECKSUM:
        return f"checksum {fields['checksum']!r}; this akv checks {CHECKSUM}"
    if fields["storage"] not in ("tensors", "none") or not _is_count(fields["num_blocks"]):
        return "storage must be 'tensors' or 'none' and num_blocks a count"
    problem = _fingerprint_problem(fields["fingerprint"])
    if problem is not None:
        return problem
    layers = fields["fingerprint"]["model"]["num_layers"] if fields["storage"] == "tensors" else 0
    if fields["num_layers"] != layers:
        return f"num_layers is {fields['num_layers']}, expected {layers} for storage {fields['storage']!r}"
    names = {BLOCKS_NAME, *(layer_name(layer) for layer in range(layers))}
    if set(fields["files"]) != names:
        return f"files must be {BLOCKS_NAME} and {layers} layer files, got {sorted(fields['files'])[:5]}"
    for name, entry in fields["files"].items():
        if not _is_file_entry(entry):
            return f"the entry of file {name!r} is malformed"
    return None


def _fingerprint_problem(fingerprint: dict) -> str | None:
    model = fingerprint.get("model")
    if type(model) is not dict or model.get("dtype") not in SAFETENSORS_DTYPES:
        return "the fingerprint has no model with a known dtype"
    sizes = [model.get(name) for name in ("num_layers", "num_kv_heads", "head_dim")]
    sizes += [fingerprint.get("block_size"), fingerprint.get("vocab_size")]
    if not all(type(size) is int and size >= 1 for size in sizes):
        return "the fingerprint's sizes (layers, heads, head dim, block size, vocabulary) must be positive ints"
    return None


def _is_file_entry(entry: object) -> bool:
    if type(entry) is not dict or set(entry) != {"bytes", "segments"} or not _is_count(entry["bytes"]):
        return False
    segments = entry["segments"]
    if type(segments) is not list:
        return False
    keys = {"name", "offset", "bytes", CHECKSUM}
    return all(
        type(s) is dict
        and set(s) == keys
        and type(s["name"]) is str
        and _is_count(s["offset"])
        and _is_count(s["bytes"])
        and type(s[CHECKSUM]) is str
        for s in segments
    )


def fingerprint_differences(saved: dict, expected: dict, prefix: str = "") -> list[str]:
    """The dotted names of the fields where two fingerprints differ, e.g. ``["model.dtype"]``.

    Args:
        saved: The snapshot's fingerprint.
        expected: The loading configuration's (:meth:`akv.config.KVCacheConfig.fingerprint`).
        prefix: Dotted prefix of the fields (for nested dicts).

    Returns:
        Sorted names; empty when equal.
    """
    names = []
    for key in sorted(set(saved) | set(expected), key=str):
        a, b = saved.get(key), expected.get(key)
        if type(a) is dict and type(b) is dict:
            names += fingerprint_differences(a, b, f"{prefix}{key}.")
        elif a != b or type(a) is not type(b):
            names.append(f"{prefix}{key}")
    return names
