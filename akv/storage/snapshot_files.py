"""Snapshot files: safetensors written in bounded batches, read back whole and checked, fsync helpers.

The safetensors format (https://huggingface.co/docs/safetensors) is an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, padded with spaces to a multiple of 8 bytes, then the raw
little-endian bytes of the tensors. The ``safetensors`` library writes a file
only from tensors already whole in memory (``save_file``), which for a layer
of a large pool would be a staging copy of the whole layer; the header of a
snapshot file is known before any data (the shapes follow from the manifest's
counts), so :class:`SafetensorsWriter` writes the header first and then each
batch of blocks at its offset (``os.pwrite``), and the result is a plain
safetensors file that ``safetensors.safe_open`` reads (the tests check this).

Checksums are xxh3_128 (:data:`CHECKSUM`; non-cryptographic: they detect
corruption, not tampering) over *segments*: the header, then each tensor's byte
range. A layer file's K and V ranges are written in two interleaved streams
(each batch of blocks carries both), so one running hash per segment keeps the
writer to one pass over the data; any changed byte changes its segment's hash.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from akv.errors import SnapshotError

#: The checksum of every file segment: xxhash's xxh3_128, hex digest (32 digits).
CHECKSUM = "xxh3_128"
#: Bytes read per ``readinto`` when a file is read back.
READ_CHUNK_BYTES = 8 << 20

#: A progress callback: called with the name of each point a save reaches (see :mod:`akv.storage.snapshot_dir`).
Progress = Callable[[str], None]

_U64 = struct.Struct("<Q")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a safetensors file.

    Args:
        name: Tensor name in the header.
        dtype: safetensors dtype code (``"F16"``, ``"BF16"``, ``"F32"``, ``"F8_E4M3"``, ``"U8"``, ``"I32"``, ``"I64"``).
        shape: Dimensions.
        itemsize: Bytes per element.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


def safetensors_header(specs: Sequence[TensorSpec]) -> tuple[bytes, list[tuple[int, int]]]:
    """The header bytes of a safetensors file holding ``specs`` in this order, and each tensor's byte range.

    Args:
        specs: The tensors, in file order.

    Returns:
        ``(header, ranges)``: the 8-byte length and the space-padded JSON
        (a multiple of 8 bytes, as the ``safetensors`` library pads it), and
        ``(start, end)`` of each tensor's data as absolute file offsets.
    """
    entries, offset = {}, 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % 8)
    head = 8 + len(text)
    ranges = [(head + start, head + end) for start, end in (entries[s.name]["data_offsets"] for s in specs)]
    return _U64.pack(len(text)) + text, ranges


def segment_names(specs: Sequence[TensorSpec]) -> list[str]:
    """Names of a file's checksum segments: ``"header"``, then each tensor's name."""
    return ["header", *(spec.name for spec in specs)]


class SafetensorsWriter:
    """Write one safetensors file whose tensors arrive in batches, hashing each segment as it goes.

    The file is created (never overwritten: ``O_EXCL``), its full size reserved
    with ``posix_fallocate`` (a full disk fails here, before any data), the
    header written, then each :meth:`append` writes the next bytes of one
    tensor at their offset. :meth:`finish` checks every tensor is complete,
    fsyncs and closes.

    Args:
        path: The file to create.
        specs: Its tensors, in file order.

    Raises:
        SnapshotError: cause ``"io"`` if the file cannot be created or reserved.
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec]) -> None:
        header, self._ranges = safetensors_header(specs)
        self.path = path
        self._header_bytes = len(header)
        self.size = self._ranges[-1][1] if self._ranges else len(header)
        self._names = segment_names(specs)
        self._fill = [start for start, _ in self._ranges]
        self._hashes = [xxhash.xxh3_128(header)] + [xxhash.xxh3_128() for _ in specs]
        self._fd = io_call(path, "create", os.open, path, _CREATE, 0o644)
        try:
            if self.size and hasattr(os, "posix_fallocate"):
                io_call(path, "reserve space for", os.posix_fallocate, self._fd, 0, self.size)
            self._pwrite(header, 0)
        except BaseException:
            self.abort()
            raise

    def _pwrite(self, data: memoryview | bytes, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            written = io_call(self.path, "write", os.pwrite, self._fd, view, offset)
            view, offset = view[written:], offset + written

    def append(self, tensor: int, data: np.ndarray) -> None:
        """Write the next bytes of tensor number ``tensor``.

        Args:
            tensor: Index into ``specs``.
            data: A C-contiguous numpy array (any dtype; its raw bytes are written).

        Raises:
            SnapshotError: cause ``"io"`` on a write error.
            ValueError: More bytes than the tensor holds (a bug of the caller inside akv).
        """
        raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        start, end = self._fill[tensor], self._ranges[tensor][1]
        if start + raw.nbytes > end:
            raise ValueError(f"{self.path.name}: {raw.nbytes} bytes overflow tensor {self._names[tensor + 1]}")
        self._pwrite(raw, start)
        self._hashes[tensor + 1].update(raw)
        self._fill[tensor] = start + raw.nbytes

    def finish(self, on_progress: Progress) -> dict:
        """Check completeness, fsync and close.

        Args:
            on_progress: Called with ``"wrote gen-N/F"`` before the fsync and
                ``"fsynced gen-N/F"`` after it.

        Returns:
            The manifest entry: ``{"bytes": size, "segments": [{"name", "offset", "bytes", "xxh3_128"}, ...]}``.

        Raises:
            SnapshotError: cause ``"io"`` on an fsync error.
            ValueError: A tensor was not written in full (a bug inside akv).
        """
        for index, (fill, (_, end)) in enumerate(zip(self._fill, self._ranges)):
            if fill != end:
                raise ValueError(f"{self.path.name}: tensor {self._names[index + 1]} has {end - fill} bytes unwritten")
        name = f"{self.path.parent.name}/{self.path.name}"
        on_progress(f"wrote {name}")
        io_call(self.path, "fsync", os.fsync, self._fd)
        os.close(self._fd)
        self._fd = -1
        on_progress(f"fsynced {name}")
        bounds = [(0, self._header_bytes), *self._ranges]
        segments = [
            {"name": name, "offset": start, "bytes": end - start, CHECKSUM: digest.hexdigest()}
            for name, (start, end), digest in zip(self._names, bounds, self._hashes)
        ]
        return {"bytes": self.size, "segments": segments}

    def abort(self) -> None:
        """Close the file if still open (the caller deletes the generation it belongs to)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def expected_layout(specs: Sequence[TensorSpec]) -> tuple[bytes, int, list[tuple[str, int, int]]]:
    """The header, size and segments ``(name, offset, bytes)`` a file of ``specs`` has.

    Args:
        specs: The tensors, in file order.

    Returns:
        ``(header, size, segments)``.
    """
    header, ranges = safetensors_header(specs)
    bounds = [(0, len(header)), *ranges]
    segments = [(name, start, end - start) for name, (start, end) in zip(segment_names(specs), bounds)]
    return header, bounds[-1][1], segments


def read_checked(path: Path, entry: dict, specs: Sequence[TensorSpec], *, keep: bool) -> np.ndarray | None:
    """Read a file whole; check its size, its header against ``specs`` and every segment's checksum.

    One sequential pass of :data:`READ_CHUNK_BYTES` reads, each chunk hashed
    while it is still in cache.

    Args:
        path: The file.
        entry: Its manifest entry (as :meth:`SafetensorsWriter.finish` made it).
        specs: The tensors the manifest's counts say it holds.
        keep: Return the file's bytes; else read through one reused chunk buffer.

    Returns:
        The file's bytes as a uint8 array when ``keep``, else ``None``.

    Raises:
        SnapshotError: ``"missing"`` (no such file), ``"truncated"`` (shorter
            than the manifest says), ``"corrupt"`` (longer, the header or a
            checksum differs, or the manifest's entry does not describe a file
            of ``specs``), ``"io"`` (a read error).
    """
    header, size, layout = expected_layout(specs)
    segments = entry["segments"]
    if entry["bytes"] != size or [(s["name"], s["offset"], s["bytes"]) for s in segments] != layout:
        raise SnapshotError("corrupt", path, "the manifest's entry for it does not match the tensors it should hold")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SnapshotError("missing", path, "file named by the manifest is absent") from None
    except OSError as exc:
        raise SnapshotError("io", path, f"cannot open: {exc.strerror or exc}") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            cause = "truncated" if actual < size else "corrupt"
            raise SnapshotError(cause, path, f"{actual} bytes, the manifest says {size}")
        if io_call(path, "read", os.pread, fd, len(header), 0) != header:
            raise SnapshotError("corrupt", path, "its safetensors header does not match the manifest's counts")
        data = np.empty(size if keep else min(size, READ_CHUNK_BYTES), dtype=np.uint8)
        _read_hashing(fd, path, data, segments, keep)
    finally:
        os.close(fd)
    return data if keep else None


def _read_hashing(fd: int, path: Path, data: np.ndarray, segments: list[dict], keep: bool) -> None:
    """Read the file into ``data`` (whole, or chunk by chunk into it) and compare each segment's hash."""
    view = memoryview(data)
    hashes = [xxhash.xxh3_128() for _ in segments]
    ends = [seg["offset"] + seg["bytes"] for seg in segments]
    total = ends[-1] if ends else 0
    pos, seg = 0, 0
    while pos < total:
        base = pos if keep else 0
        chunk = view[base : base + min(READ_CHUNK_BYTES, total - pos)]
        got = io_call(path, "read", os.readv, fd, [chunk])
        if got == 0:
            raise SnapshotError("truncated", path, f"ends at byte {pos} while being read")
        at = 0
        while at < got:
            take = min(got - at, ends[seg] - pos)
            hashes[seg].update(chunk[at : at + take])
            at, pos = at + take, pos + take
            while seg < len(ends) - 1 and pos == ends[seg]:
                seg += 1
    for segment, digest in zip(segments, hashes):
        if digest.hexdigest() != segment[CHECKSUM]:
            raise SnapshotError(
                "corrupt", path, f"checksum of its {segment['name']} ({segment['bytes']} bytes) differs"
            )


def io_call(path: Path, what: str, call: Callable[..., Any], *args: Any) -> Any:
    """Run ``call(*args)``, an operating-system call, turning an ``OSError`` into :class:`SnapshotError` cause ``"io"``.

    Args:
        path: The file or directory the call acts on, for the message.
        what: The verb, for the message (``"write"``, ``"fsync"``).
        call: The call.
        args: Its arguments.

    Returns:
        What ``call`` returned.

    Raises:
        SnapshotError: cause ``"io"``, naming ``path`` and the system's reason.
    """
    try:
        return call(*args)
    except OSError as exc:
        raise SnapshotError("io", path, f"cannot {what}: {exc.strerror or exc}") from None


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the entries created or renamed in it are durable.

    Raises:
        SnapshotError: cause ``"io"``.
    """
    fd = io_call(path, "open the directory", os.open, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        io_call(path, "fsync the directory", os.fsync, fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes, name: str, on_progress: Progress) -> None:
    """Create ``path`` (never overwriting), write ``data`` and fsync it.

    Args:
        path: The file.
        data: Its bytes.
        name: Its name in the progress points.
        on_progress: Called with ``"wrote NAME"`` before the fsync and ``"fsynced NAME"`` after it.

    Raises:
        SnapshotError: cause ``"io"``.
    """
    fd = io_call(path, "create", os.open, path, _CREATE, 0o644)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[io_call(path, "write", os.write, fd, view) :]
        on_progress(f"wrote {name}")
        io_call(path, "fsync", os.fsync, fd)
    finally:
        os.close(fd)
    on_progress(f"fsynced {name}")


def read_small(path: Path, limit_bytes: int, what: str) -> bytes:
    """Read a small file whole (``CURRENT``, a manifest).

    Args:
        path: The file.
        limit_bytes: Largest size accepted.
        what: What the file is, for the message.

    Returns:
        Its bytes.

    Raises:
        SnapshotError: ``"missing"``, ``"corrupt"`` (larger than ``limit_bytes``) or ``"io"``.
    """
    try:
        with open(path, "rb") as file:
            data = file.read(limit_bytes + 1)
    except FileNotFoundError:
        raise SnapshotError("missing", path, f"no {what}") from None
    except OSError as exc:
        raise SnapshotError("io", path, f"cannot read the {what}: {exc.strerror or exc}") from None
    if len(data) > limit_bytes:
        raise SnapshotError("corrupt", path, f"the {what} is larger than {limit_bytes} bytes")
    return data
