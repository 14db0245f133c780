"""A save killed with SIGKILL at any instant leaves the old or the new generation current and loadable.

A child process (tests/snapshot_child.py) imports akv once and forks one
writer per save; the writer is killed with a real SIGKILL, either by itself at
a chosen progress point of the save (after each file write, each fsync, the
directory fsync, the CURRENT.tmp write and fsync, the rename, the deletions)
or by its parent after a random delay. After every kill the snapshot must
verify and load, and what loads must equal, byte for byte, the generation that
was current before the save (kill before the rename) or the new one (after).
A kill -9 tests process death, not power loss: the page cache survives it;
what makes a power loss safe is the fsync order, which
test_snapshot_files.py::test_progress_points_name_every_durable_step pins.
"""

from __future__ import annotations

import functools
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from akv.storage.snapshot_reader import load_snapshot, verify_snapshot
from akv.storage.snapshot_record import COLUMNS
from tests.snapshot_child import CONFIG, save, snapshot_data

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 300


class Child:
    """The child process that forks the writers; one line per command, one line per reply."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "tests.snapshot_child"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def ask(self, command: str, directory: Path, seed: int, arg: int = 0) -> tuple[int, float]:
        """Send a command; return ``(status, seconds)`` of the writer it forked."""
        line = f"{command} {directory} {seed} {arg}"
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply: list[str] = []
        while reply[:1] != ["status"]:  # skip akv's log lines
            ready, _, _ = select.select([self.proc.stdout], [], [], HANG_GUARD_S)
            assert ready, f"the child did not answer {line!r} within {HANG_GUARD_S} s"
            text = self.proc.stdout.readline()
            assert text, f"the child died before answering {line!r}"
            reply = text.split()
        return int(reply[1]), float(reply[2])

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=HANG_GUARD_S)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def child():
    proc = Child()
    yield proc
    proc.close()


@functools.lru_cache(maxsize=8)
def _expected(seed: int):
    return snapshot_data(seed)


def _loads_as(directory: Path, seeds: tuple[int, ...]) -> int:
    """Verify, load, and return which of ``seeds`` the current generation holds (byte-exact)."""
    verify_snapshot(directory, CONFIG.fingerprint())
    snap = load_snapshot(directory, CONFIG.fingerprint())
    for seed in seeds:
        blocks, layers = _expected(seed)
        same = all(np.array_equal(getattr(snap.blocks, name), getattr(blocks, name)) for name in COLUMNS)
        if same and all(torch.equal(got, want) for got, want in zip(snap.layers, layers)):
            return seed
    raise AssertionError(f"generation {snap.generation} holds none of the snapshots of seeds {seeds}")


@functools.lru_cache(maxsize=1)
def _points() -> tuple[list[str], int]:
    """The progress points of a third save into a directory (so one deletion), and the rename's index."""
    with tempfile.TemporaryDirectory() as scratch:
        for seed in (1, 2, 3):
            points: list[str] = []
            save(Path(scratch), *_expected(seed), points.append)
    return points, points.index("renamed CURRENT")


def _start(child: Child, directory: Path) -> None:
    assert child.ask("time", directory, 1)[0] == 0 and child.ask("time", directory, 2)[0] == 0
    assert _loads_as(directory, (2,)) == 2


def test_sigkill_at_every_progress_point_leaves_old_or_new(child: Child, tmp_path: Path) -> None:
    directory = tmp_path / "s"
    points, renamed = _points()
    _start(child, directory)
    current = 2
    for index, point in enumerate(points):
        seed = 10 + index
        status, _ = child.ask("kill_at", directory, seed, index)
        assert status == signal.SIGKILL, point
        want = seed if index >= renamed else current
        assert _loads_as(directory, (want,)) == want, f"killed after {point!r}"
        current = want
    assert child.ask("time", directory, 99)[0] == 0  # the next save succeeds and sweeps the crashed saves' leftovers
    assert _loads_as(directory, (99,)) == 99
    assert len([name for name in os.listdir(directory) if name.startswith("gen-")]) == 2
    assert not (directory / "CURRENT.tmp").exists()


def _random_kills(child: Child, directory: Path, count: int) -> None:
    _start(child, directory)
    _, full_s = child.ask("time", directory, 3)
    current, rng = 3, random.Random(15)
    outcomes = {"old": 0, "new": 0}
    for k in range(count):
        seed = 100 + k
        delay_us = int((k + rng.random()) / count * 1.5 * full_s * 1e6)  # stratified over 1.5 save times
        child.ask("kill_after", directory, seed, delay_us)
        got = _loads_as(directory, (current, seed))
        outcomes["new" if got == seed else "old"] += 1
        current = got
    assert outcomes["old"] > 0 and outcomes["new"] > 0, outcomes  # kills landed both before and after the switch


def test_sigkill_at_random_times_leaves_old_or_new(child: Child, tmp_path: Path) -> None:
    _random_kills(child, tmp_path / "s", 4)


@pytest.mark.slow
def test_sigkill_at_100_random_times_leaves_old_or_new(child: Child, tmp_path: Path) -> None:
    _random_kills(child, tmp_path / "s", 100)


@pytest.mark.parametrize("limit_bytes", [0, 4096, 1 << 20])
def test_a_disk_that_fills_is_an_io_error_leaving_the_old_generation(child: Child, tmp_path: Path, limit_bytes: int):
    directory = tmp_path / "s"
    _start(child, directory)
    before = sorted(os.listdir(directory))
    assert child.ask("fsize", directory, 5, limit_bytes)[0] == -10  # SnapshotError cause "io"
    assert sorted(os.listdir(directory)) == before  # the new generation was removed, CURRENT untouched
    assert _loads_as(directory, (2,)) == 2
