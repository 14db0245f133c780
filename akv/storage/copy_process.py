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

The child's first answer says it is ready (``seq_no`` 0), so a child that
cannot start (its interpreter lacks numpy, say) is told apart from one that
died later. It runs in a session of its own and ignores the stop signals
(:mod:`akv.storage.copy_child`): a signal sent to the parent's process group
or service (Ctrl-C, a supervisor's ``SIGTERM``) reaches the parent, which
shuts down gracefully and still needs its copies. The child ends when the
request pipe closes: :meth:`CopyProcess.close_input` (the executor drains),
the parent's exit, or a ``kill -9`` of the parent; a killed child shows as
end of file on the response pipe.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np

from akv.storage.kv_pool import KVStorage
from akv.storage.tier_copy import TierBatch

_HEADER = struct.Struct("=4q")  # seq_no, a, b, c (as copy_child)
_RESPONSE = struct.Struct("=2q")  # seq_no, message bytes
_CHILD = Path(__file__).with_name("copy_child.py")
#: ``python -c`` program: ignore the stop signals from the first instruction
#: (see :mod:`~akv.storage.copy_child`), drop the working directory from
#: ``sys.path`` (so a file there cannot shadow numpy), then run the child file
#: as ``__main__``.
_BOOT = (
    "import signal, sys, runpy\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n"
    "sys.path.pop(0); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
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


def process_supported() -> bool:
    """Whether a copy process can be started here: ``sys.executable`` names an executable file.

    False in a frozen application (PyInstaller and the like set
    ``sys.frozen``; its executable would start the application, not Python)
    and in an embedded interpreter with no executable. Whether that file is
    a Python with numpy shows when the child answers
    (:meth:`CopyProcess.wait_ready`).
    """
    exe = sys.executable
    return not getattr(sys, "frozen", False) and bool(exe) and os.access(exe, os.X_OK)


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has data or end of file within ``timeout_s`` (``poll``: no limit on descriptor numbers)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000) + 1)))


def _close_all(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


#: Every live copy process of this interpreter (see :func:`_after_fork_in_child`).
_LIVE: weakref.WeakSet[CopyProcess] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked process (``multiprocessing``'s default start) closes its copies of the pipes.

    Otherwise it would hold the request pipe open: the copy process would
    never see end of file, outliving a killed parent and holding up the
    manager's exit for as long as the forked process lives.
    """
    for process in list(_LIVE):
        _close_all(process._request)
        _close_all(process._response)
        _close_all(process._child_ends)
        if process._finalizer is not None:
            process._finalizer.detach()  # the child belongs to the parent: never reap or wait for it here


os.register_at_fork(after_in_child=_after_fork_in_child)


def _stop(proc: subprocess.Popen, request_fd: list[int], response_fd: list[int]) -> None:
    """Finalizer: close the request pipe (the child exits after its batches), reap the child, close the rest."""
    _close_all(request_fd)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    _close_all(response_fd)


class CopyProcess:
    """A child process running copy batches on ``storage``'s shared pools, in submission order.

    Args:
        storage: CPU pools in shared memory with a host tier
            (``KVStorage(..., shared_memory=True, num_host_blocks > 0)``).

    Raises:
        OSError: The child could not be started (no ``python`` executable,
            too many open files); nothing is left open.
    """

    def __init__(self, storage: KVStorage) -> None:
        layout = _layout(storage)
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # a smaller pipe only blocks sooner
            fcntl.fcntl(req_w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        layout.update(request_fd=req_r, response_fd=resp_w)
        fds = (layout["device"]["fd"], layout["host"]["fd"], req_r, resp_w)
        # Lists, so that the finalizer, close() and a fork's handler share them; registered
        # before Popen, so that a thread forking meanwhile closes the pipes in its child.
        self._request, self._response, self._child_ends = [req_w], [resp_r], [req_r, resp_w]
        self._finalizer: weakref.finalize | None = None
        _LIVE.add(self)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(_CHILD), json.dumps(layout)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            _LIVE.discard(self)
            for ends in (self._request, self._response, self._child_ends):
                _close_all(ends)
            raise
        _close_all(self._child_ends)
        self._pending = b""
        #: Whether the child has said it is ready (its pools are mapped).
        self.ready = False
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._request, self._response)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def send(self, seq_no: int, batch: TierBatch) -> None:
        """Write one batch to the child (blocks only while the pipe is full: the child is far behind).

        Raises:
            BrokenPipeError: The child has exited (killed, failed a batch, or
                could not start); the message says which it looks like.
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
        try:
            while view:
                view = view[os.write(fd, view) :]
        except BrokenPipeError:
            raise BrokenPipeError(f"the copy process {self.describe_exit()}") from None

    def wait_ready(self, timeout_s: float) -> str | None:
        """Block until the child says it is ready, before any batch is sent; ``None``, or why it is not.

        Returns:
            ``None`` once ready; else the reason (it exited first, or gave
            no answer for ``timeout_s``), and the child is then killed.
        """
        deadline = time.monotonic() + timeout_s
        buf = b""
        while not self.ready and self._response:
            if not _readable(self._response[0], deadline - time.monotonic()):
                self.kill()
                return f"the copy process was not ready after {timeout_s:g} s"
            data = os.read(self._response[0], _RESPONSE.size - len(buf))
            if not data:
                return f"the copy process {self.describe_exit()}"
            buf += data
            if len(buf) == _RESPONSE.size:
                if _RESPONSE.unpack(buf) != (0, 0):
                    self.kill()
                    return f"the copy process answered {_RESPONSE.unpack(buf)} instead of its ready record"
                self.ready = True
        return None

    def describe_exit(self) -> str:
        """How the child ended, in words (its status, and whether it had started), for error messages."""
        status = self.wait(timeout_s=1.0)
        how = f"was killed by signal {-status}" if status is not None and status < 0 else f"exited (status {status})"
        return how if self.ready else f"{how} before it was ready (see its stderr)"

    def completions(self, timeout_s: float | None = None) -> list[tuple[int, str | None]] | None:
        """Wait for the child's answers; every answer read, ``(seq_no, error message or None)``, in order.

        Args:
            timeout_s: Seconds to wait for one; ``None``: as long as it takes.

        Returns:
            The answers; ``[]`` when ``timeout_s`` passed with none; ``None``
            at end of file (the child has exited and every answer it wrote
            has been returned) or once :meth:`close` was called.
        """
        out: list[tuple[int, str | None]] = []
        while not out:
            if not self._response:
                return None
            if timeout_s is not None and not _readable(self._response[0], timeout_s):
                return out
            data = os.read(self._response[0], 1 << 16)
            if not data:
                return None
            buf = self._pending + data
            pos = 0
            while len(buf) - pos >= _RESPONSE.size:
                seq_no, n = _RESPONSE.unpack_from(buf, pos)
                if len(buf) - pos - _RESPONSE.size < n:
                    break
                start = pos + _RESPONSE.size
                if seq_no == 0 and not self.ready:
                    self.ready = True
                else:
                    out.append((seq_no, buf[start : start + n].decode(errors="replace") if n else None))
                pos = start + n
            self._pending = buf[pos:]
        return out

    def close_input(self) -> None:
        """Close the request pipe: the child exits after the batches already written. Idempotent."""
        _close_all(self._request)

    def close(self) -> None:
        """Close both pipes and reap the child (waiting up to 5 s). Idempotent; for after the last answer."""
        self._finalizer()

    def kill(self) -> None:
        """Stop the child now (``SIGKILL`` to its process group); its pending batches are not run.

        The child leads a session of its own, so the group is its own and
        whatever it started: an executable that is a wrapper script which
        runs Python without ``exec`` leaves no process behind. Only while the
        child is not reaped (its id cannot have been reused).
        """
        self.close_input()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self._proc.returncode is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
            else:
                self._proc.kill()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Reap the child; its exit status, or ``None`` if it is still running after ``timeout_s``."""
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def __repr__(self) -> str:
        return f"CopyProcess(pid={self._proc.pid}, returncode={self._proc.returncode})"
