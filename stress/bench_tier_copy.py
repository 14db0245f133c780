"""Benchmark: demote (device -> host) and promote (host -> device) throughput through the stream worker.

Issue 16's target: cross-tier copies at least 50 % of a plain torch copy of the
same bytes between the same two tensors. Pools of Llama-3-8B blocks (per layer
``(2, n, 16, 8, 128)`` bf16, K then V: 64 KiB per block and layer; 32 layers,
2 MiB per block, by default), a device pool and a host pool (pinned on CUDA). For each
direction, id pattern and batch size ``m`` (``--batches``), timed round-robin
within each rep so background load hits all methods alike:

- ``akv``: ``CopyExecutor.submit_tiers(...)`` then ``ticket.wait()`` on a
  started executor (validation, the one-pass row copies of
  :mod:`akv.storage.row_copy`; on the CPU in the copy process, pools in shared
  memory, as a manager runs them; on CUDA the copy stream and its fence);
- ``akv (thread)``: the same on the executor's worker thread
  (``process=False``; CPU only);
- ``akv x4``: four such batches submitted back to back, then a wait on the
  last; time per batch: the executor's sustained throughput when batches
  queue up (an eviction pass, several admissions), its thread hand-offs
  amortized;
- ``akv copier``: the same copies on the calling thread (``TierCopier.run``
  of a validated batch, CPU only): ``akv`` minus the executor's queue and
  thread hand-offs, which on a loaded 2-core VM can cost milliseconds;
- ``torch copy``: per layer ``dst_view.copy_(src_view)`` of ``m`` consecutive
  blocks between the same two tensors (on CUDA one ``copy_`` per K/V plane, so
  each is a single pinned ``cudaMemcpyAsync``): the ceiling;
- ``index_copy``: per layer ``dst.index_copy_(1, dst_ids, src.index_select(1,
  src_ids))``, the obvious two-pass implementation, for reference (CPU only,
  ``m <= 32``: it runs at well under 1 GiB/s).

Patterns (fresh random draws each rep): ``contiguous`` (``m`` consecutive
device ids and ``m`` consecutive host slots), ``host-runs`` (random distinct
device ids, consecutive host slots: what the tier sees when the core hands out
host slots in runs, since device ids come from the free queue in any order)
and ``scattered`` (random distinct ids and slots). Throughput is bytes moved per second in GiB/s
(``m * bytes_per_block / median seconds``, 2**30 B/GiB), the median of
``--reps`` timed reps after ``--warmup``; ``ratio`` is the method's
throughput over ``torch copy``'s for the same direction and ``m``. The script
sets ``OMP_NUM_THREADS=1`` (before importing torch) and
``torch.set_num_threads(1)``; with ``--device cuda`` (or ``auto`` on a GPU
host) the device pool is on CUDA, ``akv`` runs with and without zero-copy
kernels, and times are taken with ``torch.cuda.synchronize``.

    PYTHONPATH=$PWD python3 stress/bench_tier_copy.py          # CPU; JSON to stress/results/bench_tier_copy.json
    PYTHONPATH=$PWD python3 stress/bench_tier_copy.py --layers 4 --batches 1 32 --reps 5 --json /tmp/t.json
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: one intra-op thread

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from akv.storage import CopyExecutor, KVStorage
from akv.storage.shared_memory import shared_memory_available
from akv.storage.tier_copy import TierCopier, check_tier_batch

GIB = 2**30
PATTERNS = ("contiguous", "host-runs", "scattered")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[int], None]], device: torch.device, reps: int, warmup: int
) -> dict[str, float]:
    """Median seconds per call of each function, round-robin within each rep (device synchronized around calls)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            fn(i)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def make_storage(args: argparse.Namespace, device: str) -> KVStorage:
    """Device pool and host pool of Llama-3-8B-shaped blocks, filled with noise."""
    storage = KVStorage(
        num_blocks=args.num_blocks,
        block_size=16,
        num_layers=args.layers,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device=device,
        num_host_blocks=args.host_blocks,
        shared_memory=device == "cpu" and shared_memory_available(),  # as KVStorage.from_config: the copy process
    )
    assert storage.host is not None
    for cache in storage.kv_caches + storage.host.kv_caches:
        cache.normal_()
    return storage


def draw_pairs(args: argparse.Namespace, m: int, pattern: str, gen: torch.Generator) -> list[tuple[list, list]]:
    """Per rep: ``(device ids, host slots)`` of ``m`` blocks, consecutive or scattered."""
    pairs = []
    for _ in range(args.reps + args.warmup):
        b = int(torch.randint(0, args.num_blocks - m + 1, (1,), generator=gen))
        a = int(torch.randint(0, args.host_blocks - m + 1, (1,), generator=gen))
        ids = (
            list(range(b, b + m))
            if pattern == "contiguous"
            else torch.randperm(args.num_blocks, generator=gen)[:m].tolist()
        )
        slots = (
            torch.randperm(args.host_blocks, generator=gen)[:m].tolist()
            if pattern == "scattered"
            else list(range(a, a + m))
        )
        pairs.append((ids, slots))
    return pairs


def plain_copy(storage: KVStorage, direction: str, pairs: list[tuple[list, list]]) -> Callable[[int], None]:
    """``torch copy``: the same bytes between the same tensors, as consecutive blocks (one copy_ per plane on CUDA)."""
    assert storage.host is not None
    host_caches, cuda = storage.host.kv_caches, storage.device.type == "cuda"

    def run(i: int) -> None:
        ids, slots = pairs[i]
        b, a, m = ids[0], slots[0], len(ids)  # the draw's first id and slot: a region as random as the pattern's
        b, a = min(b, storage.num_blocks - m), min(a, storage.host.num_blocks - m)
        for dev, host in zip(storage.kv_caches, host_caches, strict=True):
            src, dst = (
                (dev[:, b : b + m], host[:, a : a + m])
                if direction == "d2h"
                else (host[:, a : a + m], dev[:, b : b + m])
            )
            if cuda:
                dst[0].copy_(src[0], non_blocking=True)
                dst[1].copy_(src[1], non_blocking=True)
            else:
                dst.copy_(src)

    return run


def bench_one(storage: KVStorage, executors: dict[str, CopyExecutor], args: argparse.Namespace) -> list[dict]:
    """Every direction, pattern and batch size on one storage; one row per method."""
    assert storage.host is not None
    gen = torch.Generator().manual_seed(args.seed)
    dev_type = storage.device.type
    rows = []
    for m in args.batches:
        if m > min(args.num_blocks, args.host_blocks):
            continue
        for direction in ("d2h", "h2d"):
            for pattern in PATTERNS:
                pairs = draw_pairs(args, m, pattern, gen)
                fns: dict[str, Callable[[int], None]] = {"torch copy": plain_copy(storage, direction, pairs)}
                for name, executor in executors.items():
                    fns[name] = through(executor, direction, pairs, 1)
                    fns[f"{name} x4"] = through(executor, direction, pairs, 4)
                if dev_type == "cpu":
                    fns["akv copier"] = copier(storage, direction, pairs)
                    if m <= 32:
                        fns["index_copy"] = index_copy(storage, direction, pairs)
                seconds = time_interleaved(fns, storage.device, args.reps, args.warmup)
                seconds = {k: v / 4 if k.endswith(" x4") else v for k, v in seconds.items()}
                nbytes = m * storage.bytes_per_block
                base = seconds["torch copy"]
                for method, s in seconds.items():
                    rows.append(
                        {
                            "device": dev_type,
                            "direction": direction,
                            "pattern": pattern,
                            "blocks_per_call": m,
                            "method": method,
                            "bytes_per_call": nbytes,
                            "median_s": s,
                            "gib_per_s": nbytes / s / GIB,
                            "ratio": base / s,
                        }
                    )
                print_rows(rows[-len(seconds) :])
    return rows


def through(
    executor: CopyExecutor, direction: str, pairs: list[tuple[list, list]], depth: int
) -> Callable[[int], None]:
    """``akv`` (depth 1) or ``akv x4``: submit ``depth`` batches of rep ``i``, wait for the last."""

    def run(i: int) -> None:
        ids, slots = pairs[i]
        for _ in range(depth):
            if direction == "d2h":
                ticket = executor.submit_tiers(d2h_src_ids=ids, d2h_dst_slots=slots)
            else:
                ticket = executor.submit_tiers(h2d_src_slots=slots, h2d_dst_ids=ids)
        ticket.wait()

    return run


def copier(storage: KVStorage, direction: str, pairs: list[tuple[list, list]]) -> Callable[[int], None]:
    """``akv copier``: validate and copy on the calling thread, no executor."""
    run = TierCopier(storage).run
    if direction == "d2h":
        return lambda i: run(check_tier_batch(storage, d2h_src_ids=pairs[i][0], d2h_dst_slots=pairs[i][1]))
    return lambda i: run(check_tier_batch(storage, h2d_src_slots=pairs[i][1], h2d_dst_ids=pairs[i][0]))


def index_copy(storage: KVStorage, direction: str, pairs: list[tuple[list, list]]) -> Callable[[int], None]:
    """The two-pass reference: ``index_copy_(1, dst, index_select(1, src))`` per layer."""
    assert storage.host is not None
    tensors = [(torch.tensor(ids), torch.tensor(slots)) for ids, slots in pairs]

    def run(i: int) -> None:
        ids, slots = tensors[i]
        for dev, host in zip(storage.kv_caches, storage.host.kv_caches, strict=True):
            if direction == "d2h":
                host.index_copy_(1, slots, dev.index_select(1, ids))
            else:
                dev.index_copy_(1, ids, host.index_select(1, slots))

    return run


def print_rows(rows: list[dict]) -> None:
    first = rows[0]
    cells = "  ".join(f"{r['method']} {r['gib_per_s']:6.2f} GiB/s ({r['ratio']:.2f}x)" for r in rows)
    print(f"{first['device']:4} {first['direction']} {first['pattern']:10} m={first['blocks_per_call']:4d}  {cells}")


def print_table(rows: list[dict]) -> None:
    """The summary: per device, direction, pattern and m, each method's GiB/s and ratio to torch copy."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    print("\n| device | direction | pattern | m | " + " | ".join(methods) + " |")
    print("| --- | --- | --- | ---: |" + " ---: |" * len(methods))
    keys = ("device", "direction", "pattern", "blocks_per_call")
    for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        by_method = {r["method"]: r for r in rows if tuple(r[k] for k in keys) == key}
        cells = []
        for method in methods:
            r = by_method.get(method)
            cells.append(
                ""
                if r is None
                else f"{r['gib_per_s']:.2f}" + ("" if method == "torch copy" else f" ({r['ratio']:.2f})")
            )
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=512, help="device pool blocks")
    parser.add_argument("--host-blocks", type=int, default=512, help="host pool slots")
    parser.add_argument("--layers", type=int, default=32, help="layers (64 KiB per block each)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--json", type=Path, default=Path("stress/results/bench_tier_copy.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if args.device != "cpu" and torch.cuda.is_available() else [])
    if args.device == "cuda":
        devices = devices[1:]
    load_before = os.getloadavg()
    print(
        f"bench_tier_copy: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, torch threads {torch.get_num_threads()}, "
        f"{args.layers} layers x 64 KiB per block, pools {args.num_blocks} device / {args.host_blocks} host blocks, "
        f"median of {args.reps} reps, load average {load_before[0]:.2f}"
    )
    rows = []
    for device in devices:
        storage = make_storage(args, device)
        executors = {"akv": CopyExecutor(storage)}
        if storage.arena is not None:  # "akv" is the copy process; the worker thread for reference
            executors["akv (thread)"] = CopyExecutor(storage, process=False)
        if device == "cuda":
            executors["akv (DMA only)"] = CopyExecutor(storage, zero_copy=False)
            print(f"cuda: zero-copy alias of the host pool: {executors['akv'].zero_copy}")
        for executor in executors.values():
            executor.start()
        try:
            rows += bench_one(storage, executors, args)
        finally:
            for executor in executors.values():
                executor.close()
        del storage
    print_table(rows)
    report = {
        "commit": _commit(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count()},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "block_shape_per_layer": [2, 16, 8, 128],
        "dtype": "bfloat16",
        "layers": args.layers,
        "bytes_per_block": args.layers * 2 * 16 * 8 * 128 * 2,
        "num_blocks": args.num_blocks,
        "host_blocks": args.host_blocks,
        "reps": args.reps,
        "warmup": args.warmup,
        "aggregation": "median of reps; methods round-robin within each rep; GiB/s = bytes / median s / 2**30",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
