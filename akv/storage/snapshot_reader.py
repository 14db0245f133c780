"""Reading a snapshot directory: load, verify and info, each reading only what ``CURRENT`` names.

Everything is checked before anything is returned, in this order: ``CURRENT``
(one line naming a generation and its manifest's checksum), the manifest's
checksum, its format and version, its fields, the configuration fingerprint
(a foreign snapshot is cause ``"foreign"``, naming the differing fields), then
each file: present, of the recorded size, a header matching the manifest's
counts, every segment's xxh3_128; then the record's contents (topological
order, parents, namespaces, token range, and every key recomputed from its
parent's key, tokens and namespace). A snapshot that fails any check is
refused whole with :class:`~akv.errors.SnapshotError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from akv.errors import SnapshotError
from akv.storage.kv_pool import torch_dtype
from akv.storage.snapshot_files import expected_layout, read_checked, read_small
from akv.storage.snapshot_manifest import (
    BLOCKS_NAME,
    CURRENT_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    blocks_specs,
    fingerprint_differences,
    generation_name,
    layer_name,
    layer_specs,
    parse_current,
    parse_manifest,
)
from akv.storage.snapshot_record import COLUMNS, SnapshotBlocks, decode_namespace


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """A loaded, fully verified snapshot.

    Attributes:
        generation: The generation ``CURRENT`` named.
        created_unix_s: When it was saved (seconds since the epoch).
        fingerprint: The configuration fingerprint it was saved under.
        blocks: The saved blocks.
        layers: For storage ``"tensors"``, one CPU tensor per layer,
            ``(2, n, block_size, num_kv_heads, head_dim)``, K then V, in the
            model's dtype (row ``i`` of dim 1 is record row ``i``); ``None``
            for a metadata-only snapshot.
    """

    generation: int
    created_unix_s: float
    fingerprint: dict
    blocks: SnapshotBlocks
    layers: list[torch.Tensor] | None


def read_current(directory: Path) -> tuple[int, str]:
    """``(generation, manifest checksum)`` that ``directory/CURRENT`` names.

    Raises:
        SnapshotError: ``"missing"`` (no directory or no ``CURRENT``), ``"io"``
            (not a directory, unreadable), ``"corrupt"`` (not one valid line).
    """
    if not directory.exists():
        raise SnapshotError("missing", directory, "no such snapshot directory")
    if not directory.is_dir():
        raise SnapshotError("io", directory, "is not a directory")
    path = directory / CURRENT_NAME
    return parse_current(path, read_small(path, 4096, "CURRENT file (is this a snapshot directory?)"))


def _read_manifest(directory: Path, fingerprint: dict | None) -> tuple[Path, dict]:
    """The current generation's directory and checked manifest; ``"foreign"`` if fingerprints differ."""
    generation, checksum = read_current(directory)
    gen_dir = directory / generation_name(generation)
    if not gen_dir.is_dir():
        raise SnapshotError("missing", gen_dir, f"CURRENT names generation {gen_dir.name}, which is absent")
    path = gen_dir / MANIFEST_NAME
    data = read_small(path, MAX_MANIFEST_BYTES, "manifest")
    if xxhash.xxh3_128_hexdigest(data) != checksum:
        raise SnapshotError("corrupt", path, "its checksum differs from the one CURRENT records")
    manifest = parse_manifest(path, data, generation)
    if fingerprint is not None:
        differ = fingerprint_differences(manifest["fingerprint"], fingerprint)
        if differ:
            saved, wanted = manifest["fingerprint"], fingerprint
            details = ", ".join(
                f"{name} {_lookup(saved, name)!r} (expected {_lookup(wanted, name)!r})" for name in differ
            )
            raise SnapshotError("foreign", path, f"saved under another configuration: {details}")
    return gen_dir, manifest


def _lookup(fields: dict, dotted: str) -> object:
    for part in dotted.split("."):
        fields = fields.get(part) if type(fields) is dict else None
    return fields


def _namespaces(path: Path, manifest: dict) -> tuple:
    try:
        return tuple(decode_namespace(item) for item in manifest["namespaces"])
    except ValueError as exc:
        raise SnapshotError("corrupt", path, f"bad namespace table: {exc}") from None


def _read_blocks(gen_dir: Path, manifest: dict) -> SnapshotBlocks:
    n, fingerprint = manifest["num_blocks"], manifest["fingerprint"]
    block_size = fingerprint["block_size"]
    specs = blocks_specs(n, block_size)
    path = gen_dir / BLOCKS_NAME
    data = read_checked(path, manifest["files"][BLOCKS_NAME], specs, keep=True)
    _, _, layout = expected_layout(specs)
    columns = {}
    for (name, (dtype, trailing)), (_, offset, size) in zip(COLUMNS.items(), layout[1:]):
        raw = data[offset : offset + size].view(dtype.newbyteorder("<"))
        columns[name] = raw.astype(dtype, copy=False).reshape(n, *trailing(block_size))
    blocks = SnapshotBlocks(block_size=block_size, namespaces=_namespaces(gen_dir / MANIFEST_NAME, manifest), **columns)
    problem = blocks.check(fingerprint["vocab_size"])
    if problem is not None:
        raise SnapshotError("corrupt", path, problem)
    return blocks


def _read_layers(gen_dir: Path, manifest: dict, keep: bool) -> list[torch.Tensor] | None:
    if manifest["storage"] == "none":
        return None
    fingerprint, n = manifest["fingerprint"], manifest["num_blocks"]
    specs = layer_specs(fingerprint, n)
    _, _, layout = expected_layout(specs)
    dtype = torch_dtype(fingerprint["model"]["dtype"])
    shape = (2, *specs[0].shape)
    layers = []
    for layer in range(manifest["num_layers"]):
        name = layer_name(layer)
        data = read_checked(gen_dir / name, manifest["files"][name], specs, keep=keep)
        if data is not None:
            start, end = layout[1][1], layout[2][1] + layout[2][2]  # k then v, adjacent
            layers.append(torch.from_numpy(data[start:end]).view(dtype).reshape(shape))
    return layers if keep else None


def load_snapshot(directory: str | os.PathLike, fingerprint: dict | None = None) -> Snapshot:
    """Read and verify the current generation of a snapshot directory whole.

    Args:
        directory: The snapshot directory.
        fingerprint: The loading configuration's
            (:meth:`akv.config.KVCacheConfig.fingerprint`); ``None`` skips the
            foreign check.

    Returns:
        The snapshot; its tensors share the memory the files were read into
        (about the snapshot's size).

    Raises:
        SnapshotError: The snapshot is refused (see the module docstring
            for the checks and :class:`~akv.errors.SnapshotError` for the causes).
    """
    gen_dir, manifest = _read_manifest(Path(directory), fingerprint)
    blocks = _read_blocks(gen_dir, manifest)
    layers = _read_layers(gen_dir, manifest, keep=True)
    return Snapshot(
        generation=manifest["generation"],
        created_unix_s=manifest["created_unix_s"],
        fingerprint=manifest["fingerprint"],
        blocks=blocks,
        layers=layers,
    )


def verify_snapshot(directory: str | os.PathLike, fingerprint: dict | None = None) -> None:
    """Run every check of :func:`load_snapshot`, reading layer files through one small buffer.

    Args:
        directory: The snapshot directory.
        fingerprint: As in :func:`load_snapshot`.

    Raises:
        SnapshotError: The snapshot would be refused.
    """
    gen_dir, manifest = _read_manifest(Path(directory), fingerprint)
    _read_blocks(gen_dir, manifest)
    _read_layers(gen_dir, manifest, keep=False)


def snapshot_info(directory: str | os.PathLike) -> dict:
    """What the current generation holds, from its manifest (checksummed, but the data files are not read).

    Args:
        directory: The snapshot directory.

    Returns:
        ``generation``, ``created_unix_s``, ``storage``, ``num_blocks``,
        ``num_layers``, ``num_namespaces``, ``bytes`` (all files, manifest
        included), ``files`` (name -> bytes), ``fingerprint``,
        ``format_version``, ``generations`` (every generation directory present).

    Raises:
        SnapshotError: ``CURRENT`` or the manifest is refused.
    """
    path = Path(directory)
    gen_dir, manifest = _read_manifest(path, None)
    files = {name: entry["bytes"] for name, entry in sorted(manifest["files"].items())}
    files[MANIFEST_NAME] = (gen_dir / MANIFEST_NAME).stat().st_size
    return {
        "directory": str(path),
        "generation": manifest["generation"],
        "created_unix_s": manifest["created_unix_s"],
        "storage": manifest["storage"],
        "num_blocks": manifest["num_blocks"],
        "num_layers": manifest["num_layers"],
        "num_namespaces": len(manifest["namespaces"]),
        "bytes": sum(files.values()),
        "files": files,
        "fingerprint": manifest["fingerprint"],
        "format_version": manifest["format_version"],
        "generations": sorted(p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("gen-")),
    }
