"""The child process of the kill -9 tests (tests/test_snapshot_crash.py).

Run as ``python -m tests.snapshot_child``. It imports akv once, then serves
one command per stdin line, ``COMMAND DIR SEED [ARG]``, each by forking a
writer process that saves one generation of the snapshot directory ``DIR``
(so no kill pays for a Python start-up):

- ``kill_at SEED INDEX``: the writer saves the snapshot of ``SEED`` and
  SIGKILLs itself at the ``INDEX``-th progress point of the save (0-based;
  it exits 0 if the save has fewer points);
- ``kill_after SEED MICROSECONDS``: this process SIGKILLs the writer that
  long after forking it;
- ``time SEED``: the writer saves in full; the reply carries the seconds;
- ``fsize SEED BYTES``: the writer may create no file larger than ``BYTES``
  (``RLIMIT_FSIZE``, as a full disk would refuse the writes); it exits 10 if
  the save raised SnapshotError cause "io".

Each reply is one line: ``status N SECONDS`` (N: the signal that ended the
writer, or ``-code`` for an exit code); other lines on stdout are akv's
log lines. ``quit`` ends the loop.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.errors import SnapshotError
from akv.storage.snapshot_demo import demo_blocks, demo_layers, tensor_reader
from akv.storage.snapshot_dir import save_snapshot
from akv.storage.snapshot_record import SnapshotBlocks

#: The configuration every crash test saves under: 2 layers of float32, about 12 MiB of K/V.
CONFIG = KVCacheConfig(num_blocks=2048, block_size=16, vocab_size=1000, model=MODEL_SHAPES["tiny"])
#: Saved blocks per generation.
NUM_BLOCKS = 1500


def snapshot_data(seed: int) -> tuple[SnapshotBlocks, list[torch.Tensor]]:
    """The record and K/V a save of ``seed`` writes (deterministic)."""
    blocks = demo_blocks(NUM_BLOCKS, block_size=CONFIG.block_size, vocab_size=CONFIG.vocab_size, seed=seed)
    return blocks, demo_layers(CONFIG, NUM_BLOCKS, seed)


def save(directory: Path, blocks: SnapshotBlocks, layers: list[torch.Tensor], on_progress) -> int:
    """Save ``blocks`` and ``layers`` as a new generation of ``directory``."""
    reader = tensor_reader(layers, np.arange(NUM_BLOCKS, dtype=np.int64))
    return save_snapshot(directory, CONFIG, blocks, reader, batch_bytes=1 << 20, on_progress=on_progress)


def _kill_at(index: int):
    reached = []

    def on_progress(point: str) -> None:
        reached.append(point)
        if len(reached) == index + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_progress


def _serve(directory: Path, command: str, seed: int, arg: int) -> str:
    blocks, layers = snapshot_data(seed)  # before the fork: the writer only saves
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the writer
        if command == "fsize":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (arg, arg))
        try:
            save(directory, blocks, layers, _kill_at(arg) if command == "kill_at" else (lambda point: None))
        except SnapshotError as exc:
            os._exit(10 if exc.cause == "io" else 3)
        except BaseException:
            traceback.print_exc()
            os._exit(3)
        os._exit(0)  # no atexit handlers, no flush of the parent's buffers
    if command == "kill_after":
        time.sleep(arg / 1e6)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    code = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    return f"status {code} {time.perf_counter() - started:.6f}"


def main() -> None:
    """Serve commands until ``quit``."""
    torch.set_num_threads(1)  # no OpenMP pool in a process that forks
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            return
        print(_serve(Path(args[0]), command, int(args[1]), int(args[2]) if len(args) > 2 else 0), flush=True)


if __name__ == "__main__":
    main()
