"""Benchmark: snapshot save and load of a real CPU pool against plain sequential file I/O of the same bytes.

A pool of Llama-3-8B-shaped blocks (per layer ``(2, num_blocks, 16, 8, 128)``
bf16, K then V; 32 layers, 2 MiB per block; 512 blocks = 1 GiB by default),
every block saved, gathered in a random block order (as a prefix tree's
blocks lie in the pool). Timed in the same run, round-robin per rep:

- ``save``: :func:`akv.storage.snapshot_dir.save_snapshot` into a fresh
  directory: gather through ``read_blocks`` in 32 MiB batches, write, hash
  (xxh3_128), fsync every file and directory, switch ``CURRENT``;
- ``sequential write``: a Python ``dd conv=fsync``: one file of the same
  total bytes written from one buffer in 32 MiB ``os.write`` calls, fsync;
- ``load (cold)``: every file of the snapshot dropped from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)`` after fsync), then
  :func:`akv.storage.snapshot_reader.load_snapshot` (read, checksum, check
  header and record, tensors ready);
- ``verify (cold)``: the same through :func:`verify_snapshot` (one 8 MiB buffer);
- ``sequential read (cold)``: the same files dropped the same way, then read
  whole in 8 MiB ``readinto`` calls, nothing else.

Throughput is GiB/s of the snapshot's bytes (the median of ``--reps``); the
ratio is akv over the plain I/O. Also: xxh3_128 and sha256 over 256 MiB in
memory, the cost of the checksum choice. Run with ``OMP_NUM_THREADS=1``; the
machine's load average and the filesystem of ``--dir`` are recorded.

    OMP_NUM_THREADS=1 python stress/bench_snapshot.py           # JSON to stress/results/bench_snapshot.json
    python stress/bench_snapshot.py --num-blocks 64 --reps 1     # a quick look (128 MiB)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

from akv.config import MODEL_SHAPES, KVCacheConfig
from akv.storage.kv_pool import KVStorage
from akv.storage.snapshot_demo import demo_blocks, tensor_reader
from akv.storage.snapshot_dir import save_snapshot
from akv.storage.snapshot_reader import load_snapshot, verify_snapshot

CHUNK_WRITE = 32 << 20
CHUNK_READ = 8 << 20
GIB = float(1 << 30)


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _sequential_write(path: Path, buffer: memoryview) -> float:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, buffer.nbytes, CHUNK_WRITE):
            view = buffer[start : start + CHUNK_WRITE]
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def _sequential_read(paths: list[Path], buffer: memoryview) -> float:
    _drop_cache(paths)
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer[:CHUNK_READ]):
                pass
    return time.perf_counter() - started


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _hash_cost() -> dict:
    data = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    out = {}
    for name, hasher in (("xxh3_128", xxhash.xxh3_128), ("sha256", hashlib.sha256)):
        seconds = _timed(lambda hasher=hasher: hasher(memoryview(data)).hexdigest())
        out[f"{name}_gib_s"] = round(data.nbytes / GIB / seconds, 3)
    return out


def _filesystem(directory: Path) -> str:
    done = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else "unknown"


def run(num_blocks: int, reps: int, base: Path) -> dict:
    """Time every method ``reps`` times, round-robin; return the results dict."""
    config = KVCacheConfig(num_blocks=num_blocks, model=MODEL_SHAPES["llama-3-8b"], vocab_size=128_256)
    storage = KVStorage.from_config(config)
    generator = torch.Generator().manual_seed(0)
    for cache in storage.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    blocks = demo_blocks(num_blocks, block_size=config.block_size, vocab_size=config.vocab_size)
    block_ids = np.random.default_rng(1).permutation(num_blocks).astype(np.int64)
    reader = tensor_reader(storage.kv_caches, block_ids)
    times: dict[str, list[float]] = {k: [] for k in ("save", "write", "load", "verify", "read")}
    snapshot_bytes = 0
    for rep in range(reps):
        directory = base / f"snap-{rep}"
        times["save"].append(_timed(lambda directory=directory: save_snapshot(directory, config, blocks, reader)))
        files = _files(directory)
        snapshot_bytes = sum(p.stat().st_size for p in files)
        buffer = memoryview(np.random.default_rng(rep).integers(0, 256, snapshot_bytes, dtype=np.uint8))
        times["write"].append(_sequential_write(base / f"dd-{rep}", buffer))
        (base / f"dd-{rep}").unlink()
        _drop_cache(files)
        times["load"].append(_timed(lambda directory=directory: load_snapshot(directory, config.fingerprint())))
        _drop_cache(files)
        times["verify"].append(_timed(lambda directory=directory: verify_snapshot(directory, config.fingerprint())))
        times["read"].append(_sequential_read(files, buffer))
        del buffer
        shutil.rmtree(directory)
    gib = snapshot_bytes / GIB
    rate = {name: gib / statistics.median(values) for name, values in times.items()}
    return {
        "pool": {"model": "llama-3-8b", "num_blocks": num_blocks, "pool_gib": round(storage.nbytes / GIB, 3)},
        "snapshot_gib": round(gib, 4),
        "seconds": {name: [round(v, 4) for v in values] for name, values in times.items()},
        "gib_s": {
            "save": round(rate["save"], 3),
            "sequential_write_fsync": round(rate["write"], 3),
            "load_cold": round(rate["load"], 3),
            "verify_cold": round(rate["verify"], 3),
            "sequential_read_cold": round(rate["read"], 3),
        },
        "ratio": {
            "save_vs_write": round(rate["save"] / rate["write"], 3),
            "load_vs_read": round(rate["load"] / rate["read"], 3),
            "verify_vs_read": round(rate["verify"] / rate["read"], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a summary, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=512, help="blocks of 2 MiB (default 512: 1 GiB)")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions (default 2)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write (default /tmp)")
    parser.add_argument("--json", type=Path, default=Path("stress/results/bench_snapshot.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    base = Path(tempfile.mkdtemp(prefix="akv-bench-snapshot-", dir=args.dir))
    load_before = os.getloadavg()
    try:
        results = run(args.num_blocks, args.reps, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results.update(
        hash_in_memory=_hash_cost(),
        filesystem=_filesystem(args.dir),
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        python=platform.python_version(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    for name, value in results["gib_s"].items():
        print(f"{name:>24}: {value:6.3f} GiB/s")
    print(f"ratios: {results['ratio']}; in memory: {results['hash_in_memory']}")
    print(f"filesystem: {results['filesystem']}; load average {load_before} -> {results['load_average_after']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
