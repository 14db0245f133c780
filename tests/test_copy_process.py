"""The copy process: CPU tier copies run by a child on the pools' shared memory (akv.storage.copy_process).

Real processes, real pipes, real signals: the child is killed with SIGKILL,
the parent too (a child of the test), and what each side sees is checked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv import KVCacheConfig, KVCacheManager, model_shape
from akv.errors import ActorCrashed, InvalidInput, ManagerClosed
from akv.storage import CopyExecutor, KVStorage, TierBatch
from akv.storage.shared_memory import shared_memory_available
from tests.test_host_storage_copy import apply_model, assert_same, make_storage, snapshot, tier_batches

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="memfd shared memory is Linux-only")


def shared_storage(**kw) -> KVStorage:
    return make_storage(shared_memory=True, **kw)


def watched_executor(**kw) -> tuple[CopyExecutor, list[ActorCrashed]]:
    """An executor on fresh shared pools and the list its ``on_failure`` reports go to."""
    executor = CopyExecutor(shared_storage(), **kw)
    failures: list[ActorCrashed] = []
    executor.on_failure = failures.append
    return executor, failures


def copies_one_batch_exactly(executor: CopyExecutor, storage: KVStorage) -> None:
    """Start ``executor``, run one batch of both directions, close it, and compare the pools with the model."""
    dev, host = snapshot(storage)
    b = {"d2h_src_ids": [1], "d2h_dst_slots": [2], "h2d_src_slots": [3], "h2d_dst_ids": [4]}
    executor.start()
    executor.submit_tiers(**b).wait(timeout_s=30)
    apply_model(dev, host, **b)
    executor.close()
    assert_same(storage, dev, host)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie of a reaped-later child counts as gone
        return f.read().split()[2] != "Z"


@settings(max_examples=20, deadline=None)
@given(batches=st.lists(tier_batches(), min_size=1, max_size=6))
def test_the_process_copies_exactly_the_three_phases_in_order(batches: list[dict[str, list[int]]]) -> None:
    storage = shared_storage(head_dim=5)  # odd rows: int32 words
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    assert executor._process is not None
    tickets = [executor.submit_tiers(**b) for b in batches]  # all written before anyone reads an answer
    for b in batches:
        apply_model(dev, host, **b)
    executor.close()  # no worker thread ran: close reads the answers here
    assert [t.done() and t.exception() is None for t in tickets] == [True] * len(batches)
    assert executor.completed_seq_no == len(batches)
    assert_same(storage, dev, host)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_worker_thread_settles_answers_while_batches_keep_coming(dtype: torch.dtype) -> None:
    storage = shared_storage(dtype=dtype)
    dev, host = snapshot(storage)
    executor = CopyExecutor(storage)
    executor.start()
    for i in range(200):
        b = {"d2h_src_ids": [i % 10], "d2h_dst_slots": [i % 8], "h2d_src_slots": [(i + 3) % 8], "h2d_dst_ids": [9]}
        ticket = executor.submit_tiers(**b)
        apply_model(dev, host, **b)
    ticket.wait(timeout_s=30)
    assert executor.completed_seq_no == 200
    executor.close()
    assert_same(storage, dev, host)


def test_process_true_needs_shared_pools_and_false_keeps_the_thread() -> None:
    with pytest.raises(InvalidInput, match="shared memory"):
        CopyExecutor(make_storage(), process=True)
    executor = CopyExecutor(shared_storage(), process=False)
    assert executor._process is None
    executor.close()


def test_a_child_killed_with_sigkill_fails_pending_batches_and_breaks_the_executor() -> None:
    executor, failures = watched_executor()
    done = executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0])
    executor.start()
    done.wait(timeout_s=30)
    os.kill(executor._process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while executor._failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ActorCrashed):
        executor.submit_tiers(d2h_src_ids=[2], d2h_dst_slots=[1]).wait(timeout_s=10)
    assert len(failures) == 1 and "killed by signal 9" in str(failures[0].cause)
    executor.close()


def test_a_batch_the_child_cannot_copy_fails_with_its_message_and_later_ones_fail_too() -> None:
    executor, failures = watched_executor()
    bad = torch.tensor([10_000])  # past the host pool: only a bypassed check can send it
    empty = torch.empty(0, dtype=torch.int64)
    ticket = executor._submit_batch(TierBatch(torch.tensor([1]), bad, empty, empty, empty, empty))
    executor.start()
    with pytest.raises(ActorCrashed, match="copy process failed batch 1: IndexError"):
        ticket.wait(timeout_s=30)
    assert len(failures) == 1
    with pytest.raises(ActorCrashed):
        executor.submit_tiers(d2h_src_ids=[2], d2h_dst_slots=[1])
    executor.close()


def test_close_without_drain_fails_the_unanswered_batches_with_manager_closed() -> None:
    storage = shared_storage()
    executor = CopyExecutor(storage)
    tickets = [executor.submit_tiers(d2h_src_ids=[i % 10], d2h_dst_slots=[i % 8]) for i in range(50)]
    executor.close(drain=False)
    assert all(t.done() for t in tickets)
    errors = {type(t.exception()) for t in tickets if t.exception() is not None}
    assert errors <= {ManagerClosed}
    with pytest.raises(ManagerClosed):
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0])


def test_the_child_exits_when_its_parent_is_killed_with_sigkill(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import sys, time, torch
        from akv.storage import CopyExecutor, KVStorage
        storage = KVStorage(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                            dtype=torch.float32, device="cpu", num_host_blocks=4, shared_memory=True)
        executor = CopyExecutor(storage)
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0])
        print(executor._process.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the copy process outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()


@pytest.mark.anyio
async def test_a_manager_with_cpu_tensors_and_a_host_tier_copies_in_a_process() -> None:
    config = KVCacheConfig(num_blocks=16, block_size=4, model=model_shape("tiny"), storage="tensors", host_blocks=64)
    async with KVCacheManager(config) as kv:
        process = kv._executor._process
        assert process is not None and alive(process.pid)
        pid = process.pid
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the copy process outlived its manager"


def test_submit_blocks_only_the_caller_while_the_child_is_far_behind() -> None:
    storage = shared_storage()
    executor = CopyExecutor(storage)
    executor.start()
    ids = list(range(8))
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            executor.submit_tiers(d2h_src_ids=ids, d2h_dst_slots=ids)

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(0.5)
    stop.set()
    thread.join(timeout=30)
    last = executor.submit_tiers(d2h_src_ids=ids, d2h_dst_slots=ids)
    last.wait(timeout_s=60)
    assert executor.completed_seq_no == last.seq_no
    executor.close()


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_stop_signals_to_the_group_leave_the_child_copying() -> None:
    storage = shared_storage()
    executor = CopyExecutor(storage)
    executor.start()
    executor.submit_tiers(d2h_src_ids=[5], d2h_dst_slots=[5]).wait(timeout_s=30)  # started: signals are ignored
    pid = executor._process.pid
    assert os.getsid(pid) == pid  # a session of its own: a group's Ctrl-C or SIGTERM goes to the parent only
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(pid, signum)  # even sent to it directly, ignored
    dev, host = snapshot(storage)
    b = {"d2h_src_ids": [1, 2], "d2h_dst_slots": [3, 4]}
    executor.submit_tiers(**b).wait(timeout_s=30)
    apply_model(dev, host, **b)
    assert alive(pid)
    executor.close()
    assert_same(storage, dev, host)


def test_a_child_stopped_after_close_is_killed_once_the_stall_timeout_passes() -> None:
    executor, failures = watched_executor(stall_timeout_s=0.5)
    executor.start()
    executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)  # the child is ready
    pid = executor._process.pid
    os.kill(pid, signal.SIGSTOP)
    ticket = executor.submit_tiers(d2h_src_ids=[2], d2h_dst_slots=[1])
    started = time.monotonic()
    executor.close(timeout_s=30)
    assert time.monotonic() - started < 10
    with pytest.raises(ActorCrashed, match=r"gave no answer for 0\.5 s and was killed"):
        ticket.wait(timeout_s=1)
    assert len(failures) == 1 and not alive(pid)


def test_a_child_stopped_while_batches_wait_is_killed_and_its_batches_fail() -> None:
    # A stopped child hung every waiter of its copies (a replay's step, a runner) until the
    # manager was left; now its batches fail once stall_timeout_s passes without an answer.
    executor, failures = watched_executor(stall_timeout_s=0.5)
    executor.start()
    executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)  # the child is ready
    pid = executor._process.pid
    time.sleep(1.0)  # idle longer than the timeout: nothing is owed, nothing is killed
    assert alive(pid)
    executor.submit_tiers(d2h_src_ids=[3], d2h_dst_slots=[2]).wait(timeout_s=30)
    os.kill(pid, signal.SIGSTOP)
    ticket = executor.submit_tiers(d2h_src_ids=[2], d2h_dst_slots=[1])
    with pytest.raises(ActorCrashed, match=r"gave no answer for 0\.5 s and was killed, 1 batches unanswered"):
        ticket.wait(timeout_s=30)
    assert len(failures) == 1 and not alive(pid)
    with pytest.raises(ActorCrashed):
        executor.submit_tiers(d2h_src_ids=[4], d2h_dst_slots=[3])
    executor.close(timeout_s=30)


def test_a_drained_close_gives_back_the_pipes_and_reaps_the_child() -> None:
    storage = shared_storage()
    before = open_fds()
    executor = CopyExecutor(storage)
    executor.start()
    executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)
    pid = executor._process.pid
    assert len(open_fds() - before) == 2  # one end of each pipe
    executor.close(timeout_s=30)
    assert open_fds() == before  # at close, not at garbage collection
    assert not alive(pid)
    assert executor._process.wait(timeout_s=0) == 0


def test_a_child_that_cannot_start_breaks_the_executor_with_a_typed_error_saying_so(monkeypatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # an executable that is no python: exits with status 1
    executor, failures = watched_executor()
    executor.start()
    with pytest.raises(ActorCrashed):
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "before it was ready" in str(failures[0].cause)
    executor.close()


@pytest.mark.parametrize("executable", ["/nonexistent/python", ""])
def test_without_a_python_executable_the_copies_fall_back_to_the_thread(monkeypatch, executable: str) -> None:
    monkeypatch.setattr(sys, "executable", executable)
    storage = shared_storage()
    with pytest.raises(InvalidInput, match="python executable"):
        CopyExecutor(storage, process=True)
    executor = CopyExecutor(storage)
    assert executor._process is None and "not a python interpreter" in executor.process_unavailable
    copies_one_batch_exactly(executor, storage)


@pytest.mark.anyio
async def test_a_left_manager_dropped_by_its_caller_frees_its_pools_without_the_cycle_collector() -> None:
    import gc
    import weakref

    config = KVCacheConfig(num_blocks=16, block_size=4, model=model_shape("tiny"), storage="tensors", host_blocks=64)
    gc.disable()
    try:
        kv = KVCacheManager(config)
        async with kv:
            pass
        storage = weakref.ref(kv.storage)
        del kv
        deadline = time.monotonic() + 5
        while storage() is not None and time.monotonic() < deadline:
            await anyio.sleep(0.01)  # anyio's worker thread lets go of the stream worker's function
        assert storage() is None, "the pools outlive their manager until the cycle collector runs"
    finally:
        gc.enable()


def write_program(path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    ("program", "reason"),
    [
        ("#!/bin/sh\nexit 0\n", "exited (status 0) before it was ready"),  # a program, but no python
        ("#!/bin/sh\nexec sleep 60\n", "not ready after 1 s"),  # starts, never answers
    ],
)
def test_a_child_that_never_gets_ready_is_killed_and_the_thread_copies(tmp_path, monkeypatch, program, reason) -> None:
    monkeypatch.setattr(sys, "executable", write_program(tmp_path / "python", program))
    storage = shared_storage()
    executor = CopyExecutor(storage)
    pid = executor._process.pid
    started = time.monotonic()
    assert executor.wait_process_ready(timeout_s=1.0) is False
    assert time.monotonic() - started < 10
    assert executor._process is None and reason in executor.process_unavailable
    assert not alive(pid)
    copies_one_batch_exactly(executor, storage)


def test_a_wrapper_that_never_gets_ready_is_killed_with_what_it_started(tmp_path, monkeypatch) -> None:
    # An executable that is a wrapper script running its program without exec: killing only the
    # wrapper left the program behind, holding the caller's stdout open (found by the fresh-user review).
    pidfile = tmp_path / "grandchild.pid"
    program = f"#!/bin/sh\nsleep 60 &\necho $! > {pidfile}\nwait\n"
    monkeypatch.setattr(sys, "executable", write_program(tmp_path / "python", program))
    storage = shared_storage()
    executor = CopyExecutor(storage)
    assert executor.wait_process_ready(timeout_s=1.0) is False
    assert "not ready after 1 s" in executor.process_unavailable
    grandchild = int(pidfile.read_text())
    for _ in range(100):  # a hang guard only: SIGKILL is delivered at once
        if not alive(grandchild):
            break
        time.sleep(0.05)
    assert not alive(grandchild)
    copies_one_batch_exactly(executor, storage)


def test_wait_process_ready_comes_before_the_first_batch() -> None:
    executor = CopyExecutor(shared_storage())
    assert executor.wait_process_ready() is True
    executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0])
    with pytest.raises(InvalidInput, match="before the first batch"):
        executor.wait_process_ready()
    executor.close()


@pytest.mark.anyio
async def test_a_manager_whose_copy_process_cannot_start_enters_and_copies_on_the_thread(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "executable", write_program(tmp_path / "python", "#!/bin/sh\nexit 3\n"))
    config = KVCacheConfig(num_blocks=16, block_size=4, model=model_shape("tiny"), storage="tensors", host_blocks=64)
    async with KVCacheManager(config) as kv:
        assert kv._executor._process is None and "status 3" in kv._executor.process_unavailable
        await kv.add_sequence("a", list(range(1, 30)))
        await kv.swap_out("a")
        await kv.swap_in("a")
        await kv.check()


def test_a_process_forked_while_the_copy_process_runs_does_not_keep_it_alive() -> None:
    import multiprocessing

    executor = CopyExecutor(shared_storage())
    executor.start()
    executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)
    pid = executor._process.pid
    helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    helper.start()  # inherits the pipes, then closes its copies at fork
    try:
        started = time.monotonic()
        executor.close(timeout_s=30)
        assert time.monotonic() - started < 10, "the close waited for the forked process"
        assert not alive(pid) and executor.completed_seq_no == 1
    finally:
        helper.kill()
        helper.join(timeout=10)


def test_the_pipes_may_have_descriptor_numbers_above_1023() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit {hard} is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(max(0, 1100 - len(open_fds())))]
    try:
        executor = CopyExecutor(shared_storage())
        assert executor.wait_process_ready() is True  # select() would refuse descriptors past 1023
        executor.start()
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)
        executor.close(timeout_s=30)
        assert executor.completed_seq_no == 1 and executor._failure is None
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_process_forked_while_the_child_is_being_started_does_not_keep_it_alive(monkeypatch) -> None:
    import multiprocessing
    import subprocess as sp

    helpers = []
    real_popen = sp.Popen

    def fork_then_popen(*args, **kw):  # another thread forking at the worst moment: the pipes exist, no child yet
        helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
        helper.start()
        helpers.append(helper)
        return real_popen(*args, **kw)

    monkeypatch.setattr("akv.storage.copy_process.subprocess.Popen", fork_then_popen)
    executor = CopyExecutor(shared_storage())
    monkeypatch.undo()
    try:
        assert executor.wait_process_ready() is True
        executor.start()
        executor.submit_tiers(d2h_src_ids=[1], d2h_dst_slots=[0]).wait(timeout_s=30)
        pid = executor._process.pid
        started = time.monotonic()
        executor.close(timeout_s=30)
        assert time.monotonic() - started < 10, "the close waited for the forked process"
        assert not alive(pid) and executor._failure is None
    finally:
        for helper in helpers:
            helper.kill()
            helper.join(timeout=10)
