"""Anonymous shared memory for the K/V pools of a CPU copy process: one ``memfd`` per pool, mapped as torch tensors.

With a host tier on the CPU, block copies between the tiers run in a child
process (:mod:`akv.storage.copy_process`) so that they take no time from the
event loop's thread (a copy thread would share its GIL). Both pools then live
in memory the child maps too: a ``memfd_create`` file (Linux), sized with
``ftruncate``, mapped ``MAP_SHARED`` by each process and committed when it
is created (:func:`commit_pages`), as the private pools are by
``torch.zeros``: a preallocated pool, whose pages are not allocated and
zero-filled one fault at a time in the middle of the copies. The file has
no name in any file system: nothing to clean up after a crash, and the memory
is returned once the last process holding the descriptor or a mapping exits.

The layer tensors are ``torch.frombuffer`` views of the mapping, the same
shapes, dtypes and strides as the private allocation
(:class:`~akv.storage.kv_pool.KVStorage`); they keep the mapping alive.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from akv.errors import InvalidInput

T = TypeVar("T")


def shared_memory_available() -> bool:
    """Whether this platform has ``os.memfd_create`` (Linux with Python 3.8+)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


#: ``madvise`` advice that allocates a range's pages and maps them writable
#: (Linux 5.14, ``include/uapi/asm-generic/mman-common.h``); Python's ``mmap``
#: module passes the number through but names it only from 3.13 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

#: Bytes committed per call: between calls the interpreter runs signal handlers, so Ctrl-C or a
#: supervisor's SIGTERM during a large pool's allocation is handled within a fraction of a second.
COMMIT_BYTES = 64 * 2**20


class AllocationStopped(Exception):
    """An allocation was stopped between two chunks (:func:`stoppable`): its caller gave up waiting for it."""


_thread = threading.local()


def stoppable(fn: Callable[[], T], stop: threading.Event) -> Callable[[], T]:
    """``fn`` wrapped so that the allocations it makes on this thread stop between chunks once ``stop`` is set.

    The manager allocates its pools on a worker thread it can abandon (a
    cancelled entry: Ctrl-C, SIGTERM, a timeout) and then sets ``stop``: the
    thread ends within one chunk (:data:`COMMIT_BYTES`), releasing what it
    allocated, instead of committing GiBs nobody will use.
    """

    def run() -> T:
        _thread.stop = stop
        try:
            return fn()
        finally:
            _thread.stop = None

    return run


def interrupt_point() -> None:
    """Between two chunks of an allocation: stop if this thread's allocation was given up (:func:`stoppable`).

    Raises:
        AllocationStopped: It was.
    """
    stop = getattr(_thread, "stop", None)
    if stop is not None and stop.is_set():
        raise AllocationStopped("the pools' allocation was stopped: its caller gave up waiting for it")


def commit_pages(mapping: mmap.mmap) -> None:
    """Allocate every page of a fresh shared mapping now (zero-filled), as ``torch.zeros`` does for a private pool.

    ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later) over
    :data:`COMMIT_BYTES` at a time; on an older kernel (``EINVAL``) the
    mapping is written with zeros instead, which on a fresh ``memfd`` is the
    same content. Costs what allocating the memory costs (about 1.6 s per GiB
    on the 2-core reference VM, as ``torch.zeros``), once, where the copies
    would otherwise take a page fault per 4 KiB page.

    Raises:
        OSError: The kernel could not allocate the pages (``ENOMEM``, or
            ``EFAULT`` past a ``memfd`` size limit).
        BaseException: Whatever a signal handler raised between two calls
            (``KeyboardInterrupt``), or :class:`AllocationStopped`
            (:func:`interrupt_point`).
    """
    size, step = len(mapping), COMMIT_BYTES
    populate = True
    start = 0
    while start < size:
        interrupt_point()
        length = min(step, size - start)
        if populate:
            try:
                mapping.madvise(MADV_POPULATE_WRITE, start, length)
            except InterruptedError:
                continue  # a signal arrived: its handler has run; the same range again
            except OSError as exc:
                if exc.errno != errno.EINVAL or start:
                    raise
                populate = False  # no such advice on this kernel: write the zeros
                continue
        else:
            mapping[start : start + length] = bytes(length)
        start += length


class SharedArena:
    """One ``memfd`` of ``nbytes``, mapped read-write; tensors are views into it.

    Args:
        nbytes: Size in bytes, ``> 0``.
        name: A label for ``/proc/<pid>/fd`` (e.g. ``"akv-device-pool"``).

    Attributes:
        fd: The memfd descriptor (close-on-exec; a child gets it through
            ``subprocess.Popen(pass_fds=...)``), closed when the arena is
            garbage collected.
        nbytes: The size.

    Raises:
        InvalidInput: ``nbytes`` is not positive, or the kernel refuses the
            file or the mapping (the message gives the GiB and the error).
    """

    def __init__(self, nbytes: int, name: str) -> None:
        if nbytes <= 0:
            raise InvalidInput(f"a shared arena needs a positive size, got {nbytes}")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            raise InvalidInput(f"cannot create shared memory for {name}: {exc}") from None
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError) as exc:
            os.close(fd)
            raise InvalidInput(f"cannot map {nbytes / 2**30:,.2f} GiB of shared memory for {name}: {exc}") from None
        try:
            commit_pages(self._map)
        except BaseException as exc:  # also an interrupt between two chunks: nothing is left open
            self._map.close()
            os.close(fd)
            if isinstance(exc, OSError):
                raise InvalidInput(
                    f"cannot commit {nbytes / 2**30:,.2f} GiB of shared memory for {name}: {exc}"
                ) from None
            raise
        self.fd = fd
        self.nbytes = nbytes
        weakref.finalize(self, os.close, fd)

    def tensors(self, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """``count`` contiguous tensors of ``shape`` and ``dtype``, back to back from offset 0.

        Raises:
            InvalidInput: They do not fit in the arena.
        """
        numel = math.prod(shape)
        each = numel * dtype.itemsize
        if count * each > self.nbytes:
            raise InvalidInput(f"{count} tensors of {each} bytes do not fit in a {self.nbytes}-byte arena")
        return [
            torch.frombuffer(self._map, dtype=dtype, count=numel, offset=i * each).view(shape) for i in range(count)
        ]

    def __repr__(self) -> str:
        return f"SharedArena(fd={self.fd}, nbytes={self.nbytes})"
