"""A snapshot directory of generations, switched atomically through ``CURRENT``.

Layout (docs/persistence.md specifies it)::

    DIR/CURRENT                      "gen-000042 xxh3_128=<manifest checksum>\\n"
    DIR/gen-000042/manifest.json     format, fingerprint, counts, namespaces, checksums
    DIR/gen-000042/blocks.safetensors    the SnapshotBlocks columns
    DIR/gen-000042/layer-00000.safetensors   K and V of the saved blocks, layer 0 (storage "tensors")
    DIR/gen-000041/...               the previous generation, kept

A save writes and fsyncs every file of a new generation and the generation
directory, then writes ``CURRENT.tmp``, fsyncs it, renames it over ``CURRENT``
(atomic on POSIX) and fsyncs ``DIR``; only then are generations older than
the previous one deleted. Before the rename ``CURRENT`` names the old
generation, which nothing touched; after it, the new one, complete and durable
before the rename was issued. Readers read only what ``CURRENT`` names.

One writer at a time per directory (nothing enforces it yet). A reader may run
beside a save; one slower than two saves may find its generation deleted
(cause ``"missing"``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog
import torch

from akv.config import KVCacheConfig
from akv.errors import InvalidInput, SnapshotError
from akv.storage.kv_pool import torch_dtype
from akv.storage.snapshot_files import CHECKSUM, Progress, SafetensorsWriter, fsync_dir, io_call, write_durable
from akv.storage.snapshot_manifest import (
    BLOCKS_NAME,
    CURRENT_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    GENERATION,
    MANIFEST_NAME,
    blocks_specs,
    current_line,
    generation_name,
    layer_name,
    layer_specs,
    manifest_bytes,
)
from akv.storage.snapshot_reader import read_current
from akv.storage.snapshot_record import COLUMNS, SnapshotBlocks
from akv.storage.snapshot_record import encode_namespace as _encode_namespace

#: ``read_blocks(layer, rows) -> (2, len(rows), block_size, num_kv_heads, head_dim)`` tensor, K then V.
ReadBlocks = Callable[[int, np.ndarray], torch.Tensor]

#: Default bytes of K/V asked of ``read_blocks`` per call.
DEFAULT_BATCH_BYTES = 32 << 20

log = structlog.get_logger(
    "akv", component="snapshot"
)  # lazy: bound at first use, after the application configured structlog


def _no_progress(point: str) -> None:
    """The default progress callback: nothing."""


def save_snapshot(
    directory: str | os.PathLike,
    config: KVCacheConfig,
    blocks: SnapshotBlocks,
    read_blocks: ReadBlocks | None,
    *,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    on_progress: Progress = _no_progress,
) -> int:
    """Write ``blocks`` (and their K/V) as a new generation of ``directory`` and make it current.

    The record is checked first (:meth:`SnapshotBlocks.check`: a record that
    would be refused on load is refused now). The K/V are asked of
    ``read_blocks`` one layer at a time in batches of about ``batch_bytes``,
    so the caller can copy them out through its stream worker with no staging
    copy of a whole layer. On any error the new generation is deleted and
    ``CURRENT`` is left as it was.

    Args:
        directory: The snapshot directory (created, with its parents, if absent).
        config: The configuration the blocks were cached under (its
            fingerprint is recorded; ``storage`` decides whether K/V are saved).
        blocks: The blocks to save; ``blocks.block_size == config.block_size``.
        read_blocks: For ``storage="tensors"``, ``read_blocks(layer, rows)``
            returns the K/V of record rows ``rows`` (int64 ``(b,)``) in layer
            ``layer``: ``(2, b, block_size, num_kv_heads, head_dim)`` of the
            model's dtype, on any device. ``None`` for ``storage="none"``.
        batch_bytes: Target bytes of one ``read_blocks`` call (>= 1).
        on_progress: Called with the name of each point the save reaches:
            ``"mkdir gen-N"``, ``"wrote F"`` and ``"fsynced F"`` for each
            file ``F`` (``gen-N/layer-00000.safetensors``, ...,
            ``gen-N/blocks.safetensors``, ``gen-N/manifest.json``),
            ``"fsynced gen-N"``, ``"wrote CURRENT.tmp"``, ``"fsynced CURRENT.tmp"``,
            ``"renamed CURRENT"``, ``"fsynced directory"``, ``"deleted gen-M"``.

    Returns:
        The new generation's number.

    Raises:
        InvalidInput: A bad argument or inconsistent record (nothing written).
        SnapshotError: cause ``"io"``: the directory cannot be created or
            written (a file in its place, permissions, a full disk).
    """
    path = Path(directory)
    _check_save_args(config, blocks, read_blocks, batch_bytes)
    started = time.perf_counter()
    _make_directory(path)
    previous = _current_generation(path)
    generation = 1 + max([previous or 0, *_generations(path).values()])
    gen_dir = path / generation_name(generation)
    io_call(gen_dir, "create", gen_dir.mkdir)  # outside the try: never delete a directory this save did not make
    try:
        on_progress(f"mkdir {gen_dir.name}")
        files = _write_files(gen_dir, config, blocks, read_blocks, batch_bytes, on_progress)
        manifest = _manifest(generation, config, blocks, files)
        write_durable(gen_dir / MANIFEST_NAME, manifest, f"{gen_dir.name}/{MANIFEST_NAME}", on_progress)
        fsync_dir(gen_dir)
        on_progress(f"fsynced {gen_dir.name}")
        _replace_current(path, current_line(generation, manifest), on_progress)
    except BaseException:  # CURRENT still names the old generation
        shutil.rmtree(gen_dir, ignore_errors=True)
        (path / f"{CURRENT_NAME}.tmp").unlink(missing_ok=True)
        raise
    # From here CURRENT names the new generation: an error must not delete it.
    on_progress(f"renamed {CURRENT_NAME}")
    fsync_dir(path)
    on_progress("fsynced directory")
    if previous is not None:  # an unreadable CURRENT: keep every generation, one may be worth recovering
        _delete_old(path, keep={generation, previous}, on_progress=on_progress)
    log.info(
        "snapshot.saved",
        directory=str(path),
        generation=generation,
        num_blocks=blocks.num_blocks,
        bytes=sum(entry["bytes"] for entry in files.values()) + len(manifest),
        seconds=round(time.perf_counter() - started, 6),
    )
    return generation


def _check_save_args(config: KVCacheConfig, blocks: SnapshotBlocks, read_blocks: object, batch_bytes: int) -> None:
    if type(config) is not KVCacheConfig:
        raise InvalidInput(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if type(blocks) is not SnapshotBlocks:
        raise InvalidInput(f"blocks must be a SnapshotBlocks, got {type(blocks).__name__}")
    if blocks.block_size != config.block_size:
        raise InvalidInput(f"blocks have block_size {blocks.block_size}, the config {config.block_size}")
    if (config.storage == "tensors") != (read_blocks is not None):
        raise InvalidInput(f"read_blocks must be given exactly when storage is 'tensors' (it is {config.storage!r})")
    if read_blocks is not None and not callable(read_blocks):
        raise InvalidInput(f"read_blocks must be callable, got {type(read_blocks).__name__}")
    if type(batch_bytes) is not int or batch_bytes < 1:
        raise InvalidInput(f"batch_bytes must be an int >= 1, got {batch_bytes!r}")
    problem = blocks.check(config.vocab_size)
    if problem is not None:
        raise InvalidInput(f"the snapshot record is inconsistent: {problem}")


def _make_directory(path: Path) -> None:
    """Create the snapshot directory (and parents) durably; a file in its place is cause ``"io"``."""
    if path.is_dir():
        return
    if path.exists() or path.is_symlink():
        raise SnapshotError("io", path, "exists and is not a directory")
    io_call(path, "create", lambda: path.mkdir(parents=True, exist_ok=True))
    fsync_dir(path.parent)


def _current_generation(path: Path) -> int | None:
    """The generation ``CURRENT`` names, or ``None`` if there is none or it is unreadable."""
    try:
        return read_current(path)[0]
    except SnapshotError:
        return None


def _generations(path: Path) -> dict[str, int]:
    """Every ``gen-N`` entry in the directory, complete or not: name -> generation number."""
    names = io_call(path, "list", os.listdir, path)
    return {name: int(match.group(1)) for name in names if (match := GENERATION.fullmatch(name))}


def _write_files(
    gen_dir: Path,
    config: KVCacheConfig,
    blocks: SnapshotBlocks,
    read_blocks: ReadBlocks | None,
    batch_bytes: int,
    on_progress: Progress,
) -> dict[str, dict]:
    """Write the layer files and the blocks file; return their manifest entries by name."""
    files = {}
    n = blocks.num_blocks
    if read_blocks is not None:
        fingerprint = config.fingerprint()
        shape = (2, n, config.block_size, config.model.num_kv_heads, config.model.head_dim)
        rows_per_batch = max(1, batch_bytes // max(1, config.bytes_per_block // config.model.num_layers))
        dtype = torch_dtype(config.model.dtype)
        for layer in range(config.model.num_layers):
            writer = SafetensorsWriter(gen_dir / layer_name(layer), layer_specs(fingerprint, n))
            try:
                for start in range(0, n, rows_per_batch):
                    rows = np.arange(start, min(n, start + rows_per_batch), dtype=np.int64)
                    kv = _checked_batch(read_blocks(layer, rows), (shape[0], rows.size, *shape[2:]), dtype, layer)
                    writer.append(0, kv[0])
                    writer.append(1, kv[1])
                files[writer.path.name] = writer.finish(on_progress)
            finally:
                writer.abort()
    writer = SafetensorsWriter(gen_dir / BLOCKS_NAME, blocks_specs(n, config.block_size))
    try:
        for index, name in enumerate(COLUMNS):
            writer.append(index, getattr(blocks, name))
        files[BLOCKS_NAME] = writer.finish(on_progress)
    finally:
        writer.abort()
    return files


def _checked_batch(kv: object, shape: tuple, dtype: torch.dtype, layer: int) -> np.ndarray:
    """``read_blocks``'s answer as a contiguous uint8 numpy view ``(2, b, bytes per block)``, or InvalidInput."""
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != shape or kv.dtype != dtype:
        got = f"{kv.dtype} {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise InvalidInput(f"read_blocks(layer={layer}) must return a {dtype} tensor of shape {shape}, got {got}")
    kv = kv.detach().to("cpu").contiguous()
    return kv.view(torch.uint8).numpy().reshape(2, shape[1], -1)


def _manifest(generation: int, config: KVCacheConfig, blocks: SnapshotBlocks, files: dict) -> bytes:
    return manifest_bytes(
        {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "generation": generation,
            "created_unix_s": time.time(),
            "fingerprint": config.fingerprint(),
            "storage": config.storage,
            "num_blocks": blocks.num_blocks,
            "num_layers": config.model.num_layers if config.storage == "tensors" else 0,
            "namespaces": [_encode_namespace(ns) for ns in blocks.namespaces],
            "checksum": CHECKSUM,
            "files": files,
        }
    )


def _replace_current(path: Path, line: bytes, on_progress: Progress) -> None:
    """Atomically replace ``CURRENT`` with ``line``: write and fsync a temp file, rename it over ``CURRENT``.

    The caller fsyncs the directory. If this raises, ``CURRENT`` is unchanged
    (``os.replace`` either happens whole or not at all).
    """
    tmp = path / f"{CURRENT_NAME}.tmp"
    tmp.unlink(missing_ok=True)  # left by a save that crashed before its rename
    write_durable(tmp, line, tmp.name, on_progress)
    io_call(path, "rename CURRENT.tmp over CURRENT in", os.replace, tmp, path / CURRENT_NAME)


def _delete_old(path: Path, keep: set, on_progress: Progress) -> None:
    """Delete every generation but those in ``keep`` (the new one and the previous current)."""
    for name, generation in sorted(_generations(path).items()):
        if generation in keep:
            continue
        try:
            shutil.rmtree(path / name)
        except OSError as exc:  # the new generation is current; an old one left behind is only disk space
            log.warning("snapshot.old_generation_kept", directory=str(path), generation=name, error=str(exc))
            continue
        on_progress(f"deleted {name}")
