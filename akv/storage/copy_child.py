"""The copy process's program: runs cross-tier copy batches on the pools' shared memory, in order.

Started by :class:`~akv.storage.copy_process.CopyProcess` as
``python -c <boot> <this file> <layout JSON>``, never imported by akv itself:
it needs the standard library and numpy only (no torch, so it starts in a
fraction of a second), and loads :mod:`akv.storage.row_copy` from the file
beside it.

Protocol (native-endian int64 words on two pipes whose descriptors the
layout names):

- request: ``seq_no, a, b, c`` then the ``2a + 2b + 2c`` ids, phase by
  phase: ``d2h_src_ids, d2h_dst_slots, d2d_src_ids, d2d_dst_ids,
  h2d_src_slots, h2d_dst_ids`` (:class:`~akv.storage.tier_copy.TierBatch`,
  already validated by the parent);
- response: first ``0, 0`` once the pools are mapped (the process is
  ready); then for each batch, once its copies are done, ``seq_no, n`` and
  ``n`` bytes, an error message (``n == 0``: the batch succeeded). After an
  error the process exits (later batches would copy from unordered data).

End of file on the request pipe (the parent closed it, or exited, or was
killed) ends the process after the batches already read: that is the only
way it ends, short of ``SIGKILL``. ``SIGINT``, ``SIGTERM`` and ``SIGHUP``
are ignored: a terminal's Ctrl-C, a supervisor's stop (systemd signals every
process of the service) or a hang-up reach the whole group, and the parent,
shutting down gracefully, still needs its copies to finish.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import signal
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

_HEADER = struct.Struct("=4q")
_RESPONSE = struct.Struct("=2q")


def _load_row_copy() -> Any:
    """:mod:`akv.storage.row_copy`, loaded from its file without importing the ``akv`` package (and torch)."""
    spec = importlib.util.spec_from_file_location("_akv_row_copy", Path(__file__).with_name("row_copy.py"))
    assert spec is not None and spec.loader is not None, "row_copy.py is missing beside copy_child.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row_dtype(row_bytes: int) -> np.dtype:
    """The widest integer dtype dividing a row (the parent's ``row_view`` rule; mappings are page-aligned)."""
    for dtype in (np.int64, np.int32, np.int16, np.uint8):
        if row_bytes % np.dtype(dtype).itemsize == 0:
            return np.dtype(dtype)
    raise AssertionError("unreachable: uint8 divides every row")


def _pool_rows(pool: dict[str, int]) -> list[np.ndarray]:
    """Per-layer ``(2, rows, row)`` views of one pool's shared memory.

    Mapped with ``MAP_POPULATE``: the parent committed the pages
    (:func:`akv.storage.shared_memory.commit_pages`), so this only fills the
    child's page tables up front (about 0.05 s per GiB), instead of one page
    fault per 4 KiB page in the middle of the copies.
    """
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(pool["fd"], pool["nbytes"], flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    dtype = _row_dtype(pool["row_bytes"])
    per_row = pool["row_bytes"] // dtype.itemsize
    count = 2 * pool["rows"] * per_row
    return [
        np.frombuffer(mapping, dtype=dtype, count=count, offset=layer * count * dtype.itemsize).reshape(
            2, pool["rows"], per_row
        )
        for layer in range(pool["layers"])
    ]


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``; ``None`` at end of file before the first byte."""
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            if got:
                raise EOFError(f"request cut short: {got} of {n} bytes")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def serve(layout: dict[str, Any]) -> int:
    """Run batches until end of file on the request pipe; the process's exit status."""
    row_copy = _load_row_copy()
    device, host = _pool_rows(layout["device"]), _pool_rows(layout["host"])
    row_bytes = layout["device"]["row_bytes"]
    requests, responses = layout["request_fd"], layout["response_fd"]
    _write_all(responses, _RESPONSE.pack(0, 0))  # ready

    def phase(dst: list[np.ndarray], src: list[np.ndarray], dst_ids: np.ndarray, src_ids: np.ndarray) -> None:
        if len(dst_ids):
            for ids, rows in ((dst_ids, dst[0].shape[1]), (src_ids, src[0].shape[1])):
                if ids.min() < 0 or ids.max() >= rows:  # the copy kinds clip or skip: never copy silently wrong
                    raise IndexError(f"block ids {ids.min()}..{ids.max()} outside the {rows} rows of a pool")
            plan = row_copy.plan_row_copy(dst_ids, src_ids, row_bytes)
            for dst_rows, src_rows in zip(dst, src):
                row_copy.copy_rows(dst_rows, src_rows, plan)

    while True:
        header = _read_exact(requests, _HEADER.size)
        if header is None:
            return 0
        seq_no, a, b, c = _HEADER.unpack(header)
        payload = _read_exact(requests, 16 * (a + b + c)) if a + b + c else b""
        try:
            ids = np.frombuffer(payload or b"", dtype=np.int64)
            d2h, d2d, h2d = ids[: 2 * a], ids[2 * a : 2 * (a + b)], ids[2 * (a + b) :]
            phase(host, device, d2h[a:], d2h[:a])
            phase(device, device, d2d[b:], d2d[:b])
            phase(device, host, h2d[c:], h2d[:c])
        except Exception as exc:  # reported to the parent, which fails the batch and the executor
            message = f"{type(exc).__name__}: {exc}".encode()
            _write_all(responses, _RESPONSE.pack(seq_no, len(message)) + message)
            return 1
        _write_all(responses, _RESPONSE.pack(seq_no, 0))


def main(argv: list[str]) -> int:
    """Entry point: ``argv[0]`` is the layout JSON (pools: fd, nbytes, layers, rows, row_bytes; the two pipe fds)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        return serve(json.loads(argv[0]))
    except BrokenPipeError:  # the parent stopped reading (closed without draining, or exited): nothing to tell
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
