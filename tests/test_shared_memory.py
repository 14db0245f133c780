"""Shared-memory pools: the memfd behind a copy process's pools is committed when it is created.

Real memfds and real ``madvise`` calls: the kernel's own count of the file's
allocated blocks (``st_blocks``) says whether the pages exist.
"""

from __future__ import annotations

import mmap
import os
import signal

import anyio
import pytest
import torch

from akv.storage import shared_memory
from akv.storage.shared_memory import SharedArena, commit_pages

pytestmark = pytest.mark.skipif(not shared_memory.shared_memory_available(), reason="memfd needs Linux")

MIB = 2**20


def allocated_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_a_fresh_memfd_holds_no_pages_until_committed() -> None:
    fd = os.memfd_create("akv-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8 * MIB)
        mapping = mmap.mmap(fd, 8 * MIB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        assert allocated_bytes(fd) == 0
        commit_pages(mapping)
        assert allocated_bytes(fd) >= 8 * MIB
        assert mapping[:4096] == bytes(4096)
        mapping.close()
    finally:
        os.close(fd)


def test_an_arena_is_committed_and_zero_filled() -> None:
    arena = SharedArena(6 * MIB + 123, "akv-test-arena")
    assert allocated_bytes(arena.fd) >= 6 * MIB + 123
    (t,) = arena.tensors(1, (6 * MIB // 4,), torch.float32)
    assert not t.any()


def test_without_populate_advice_the_pages_are_zero_filled_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    # An advice number no kernel knows: madvise answers EINVAL, as a kernel
    # older than 5.14 does for MADV_POPULATE_WRITE, and the fallback writes zeros.
    monkeypatch.setattr(shared_memory, "MADV_POPULATE_WRITE", 0x7FFF)
    monkeypatch.setattr(shared_memory, "COMMIT_BYTES", 3 * MIB)
    arena = SharedArena(7 * MIB + 5, "akv-test-fill")
    assert allocated_bytes(arena.fd) >= 7 * MIB + 5
    (t,) = arena.tensors(1, (7 * MIB + 5,), torch.uint8)
    assert not t.any()


def test_the_child_maps_committed_pools_with_populated_page_tables() -> None:
    from akv.storage import copy_child

    arena = SharedArena(4 * MIB, "akv-test-child")
    (t,) = arena.tensors(1, (2, 2, 4 * MIB // 32), torch.int64)
    t[1, 1, 5] = 42
    rows = copy_child._pool_rows({"fd": arena.fd, "nbytes": arena.nbytes, "layers": 1, "rows": 2, "row_bytes": MIB})
    assert int(rows[0][1, 1, 5]) == 42


class _Interrupted(Exception):
    pass


def test_a_signal_during_the_commit_is_handled_between_chunks_and_leaves_nothing_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pool of many GiB used to be committed in one madvise call: a Ctrl-C or SIGTERM waited
    # until the whole allocation was done (18 s for 8 GiB on the 2-core VM).
    monkeypatch.setattr(shared_memory, "COMMIT_BYTES", 8 * MIB)
    name = "akv-test-interrupted"
    seen: list[int] = []

    def ours() -> list[int]:
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if name in os.readlink(f"/proc/self/fd/{fd}"):
                    fds.append(int(fd))
            except OSError:
                pass
        return fds

    def handler(signum: int, frame: object) -> None:
        seen.extend(allocated_bytes(fd) for fd in ours())
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        with pytest.raises(_Interrupted):
            SharedArena(2**30, name)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert seen and max(seen) < 2**30  # handled while the arena was still being committed (fd and mmap dup)
    assert ours() == []  # its memfd closed


@pytest.mark.anyio
async def test_a_cancelled_entry_stops_allocating_its_pools_between_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pools are committed at entry (GiBs take seconds): on the event loop, a Ctrl-C or SIGTERM
    # waited until the whole allocation was done. They are allocated on a worker thread now; a
    # cancelled entry returns at once and the thread stops within a chunk.
    import threading

    from akv import KVCacheConfig, KVCacheManager

    chunks: list[int] = []
    stopped = threading.Event()
    real = shared_memory.interrupt_point

    def counted() -> None:
        chunks.append(1)
        try:
            real()
        except shared_memory.AllocationStopped:
            stopped.set()
            raise

    monkeypatch.setattr(shared_memory, "interrupt_point", counted)
    monkeypatch.setattr(shared_memory, "COMMIT_BYTES", 4 * MIB)
    config = KVCacheConfig(num_blocks=64, host_gib=1.0)  # 256 chunks of the host arena
    with anyio.move_on_after(0.05) as scope:
        async with KVCacheManager(config):
            pytest.fail("entered: the allocation was not stopped")
    assert scope.cancelled_caught
    assert await anyio.to_thread.run_sync(stopped.wait, 30)  # a hang guard: the thread gave up
    assert 0 < len(chunks) < 256
