"""The copy process: the CPU copies of a host tier, run by a child process on the pools' shared memory.

A copy thread shares the event loop's GIL: each numpy or torch call it makes
releases the GIL while it copies, but taking it back behind a busy event loop
waits up to the interpreter's switch interval (5 ms), so a thread that makes
a few calls per block copies at a small fraction of memory speed, and the
blocks it has not copied yet stay pinned. A child process has an interpreter
of its own: it copies at memory speed on another core while the event loop
runs, and the parent's only work per batch is a pipe write and, on a reader
thread, one read for all the completions that arrived meanwhile.

:class:`CopyProcess` starts ``python -c <boot> copy_child.py <layout>``
(:mod:`akv.storage.copy_child`: numpy only, about 0.2 s to start) with the
two pools' ``memfd`` descriptors (:mod:`akv.storage.shared_memory`) and a
pipe each way. Batches are written to the request pipe in submission order;
the child runs them in that order (the phases of each in order, as
:class:`~akv.storage.tier_copy.TierCopier` does) and answers each with its
``seq_no`` once the copies are done. Memory ordering: the parent's writes
to a pool (the model runner's K/V) happen before it writes the request, and
the child's copies before it writes the response; a pipe write and read
order memory between the two processes (they are system calls).

The child ends when the request pipe closes: :meth:`CopyProcess.close_input`
(the executor drains), the parent's exit, or a ``kill -9`` of the parent; a
killed child shows as end of file on the response pipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np

from akv.storage.kv_pool import KVStorage
from akv.storage.tier_copy import TierBatch

_HEADER = struct.Struct("=4q")  # seq_no, a, b, c (as copy_child)
_RESPONSE = struct.Struct("=2q")  # seq_no, message bytes
_CHILD = Path(__file__).with_name("copy_child.py")
#: ``python -c`` program: drop the working directory from ``sys.path`` (so a
#: file there cannot shadow numpy), then run the child file as ``__main__``.
_BOOT = "import sys, runpy; sys.path.pop(0); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
#: Request pipe capacity asked for (Linux ``F_SETPIPE_SZ``; capped by
#: ``/proc/sys/fs/pipe-max-size``, 1 MiB by default): a submit blocks only
#: when the child is this far behind.
_PIPE_BYTES = 1 << 20


def _layout(storage: KVStorage) -> dict:
    host = storage.host
    assert host is not None and storage.arena is not None and host.arena is not None, "pools not in shared memory"
    row_bytes = storage.bytes_per_block // (2 * storage.num_layers)
    return {
        "device": {
            "fd": storage.arena.fd,
            "nbytes": storage.arena.nbytes,
            "layers": storage.num_layers,
            "rows": storage.num_blocks + 1,
            "row_bytes": row_bytes,
        },
        "host": {
            "fd": host.arena.fd,
            "nbytes": host.arena.nbytes,
            "layers": host.num_layers,
            "rows": host.num_blocks,
            "row_bytes": row_bytes,
        },
    }


def _stop(proc: subprocess.Popen, request_fd: list[int]) -> None:
    """Finalizer: close the request pipe (the child exits after its batches) and reap the child."""
    if request_fd:
        with contextlib.suppress(OSError):
            os.close(request_fd.pop())
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class CopyProcess:
    """A child process running copy batches on ``storage``'s shared pools, in submission order.

    Args:
        storage: CPU pools in shared memory with a host tier
            (``KVStorage(..., shared_memory=True, num_host_blocks > 0)``).

    Raises:
        OSError: The child could not be started (no ``python`` executable,
            too many open files).
    """

    def __init__(self, storage: KVStorage) -> None:
        layout = _layout(storage)
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # a smaller pipe only blocks sooner
            fcntl.fcntl(req_w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        layout.update(request_fd=req_r, response_fd=resp_w)
        fds = (layout["device"]["fd"], layout["host"]["fd"], req_r, resp_w)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(_CHILD), json.dumps(layout)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except BaseException:
            for fd in (req_r, req_w, resp_r, resp_w):
                os.close(fd)
            raise
        os.close(req_r)  # the child's ends
        os.close(resp_w)
        self._request = [req_w]  # a list so that the finalizer and close_input share it
        self._response = resp_r
        self._pending = b""
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._request)
        weakref.finalize(self, os.close, resp_r)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def send(self, seq_no: int, batch: TierBatch) -> None:
        """Write one batch to the child (blocks only while the pipe is full: the child is far behind).

        Raises:
            BrokenPipeError: The child has exited (killed, or failed a batch).
            OSError: The request pipe is closed (:meth:`close_input`).
        """
        ids = (
            batch.d2h_src_ids,
            batch.d2h_dst_slots,
            batch.d2d_src_ids,
            batch.d2d_dst_ids,
            batch.h2d_src_slots,
            batch.h2d_dst_ids,
        )
        header = _HEADER.pack(seq_no, batch.num_d2h, batch.num_d2d, batch.num_h2d)
        body = np.concatenate([t.numpy() for t in ids]).astype(np.int64, copy=False).tobytes()
        if not self._request:
            raise OSError("the copy process's request pipe is closed")
        view = memoryview(header + body)
        fd = self._request[0]
        while view:
            view = view[os.write(fd, view) :]

    def completions(self) -> list[tuple[int, str | None]] | None:
        """Block until the child answers; every answer read, ``(seq_no, error message or None)``, in order.

        Returns ``None`` at end of file: the child has exited and every
        answer it wrote has been returned.
        """
        out: list[tuple[int, str | None]] = []
        while not out:
            data = os.read(self._response, 1 << 16)
            if not data:
                return None
            buf = self._pending + data
            pos = 0
            while len(buf) - pos >= _RESPONSE.size:
                seq_no, n = _RESPONSE.unpack_from(buf, pos)
                if len(buf) - pos - _RESPONSE.size < n:
                    break
                start = pos + _RESPONSE.size
                out.append((seq_no, buf[start : start + n].decode(errors="replace") if n else None))
                pos = start + n
            self._pending = buf[pos:]
        return out

    def close_input(self) -> None:
        """Close the request pipe: the child exits after the batches already written. Idempotent."""
        if self._request:
            with contextlib.suppress(OSError):
                os.close(self._request.pop())

    def kill(self) -> None:
        """Stop the child now (``SIGKILL``); its pending batches are not run."""
        self.close_input()
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Reap the child; its exit status, or ``None`` if it is still running after ``timeout_s``."""
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def __repr__(self) -> str:
        return f"CopyProcess(pid={self._proc.pid}, returncode={self._proc.returncode})"
