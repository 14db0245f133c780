"""Benchmark: copy-on-write block copies through akv against a plain torch memcpy of the same bytes.

For batches of ``m`` random (source, destination) block pairs in a pool of
Llama-3-8B-shaped blocks (per layer ``(2, num_blocks, 16, 8, 128)`` bf16, K then
V; 32 layers: 2 MiB per block), time in the same run:

- ``copy_blocks``: :meth:`akv.storage.KVStorage.copy_blocks` on the calling
  thread (per layer one ``index_select`` and one ``index_copy_``, vLLM
  ``copy_blocks`` semantics);
- ``stream worker``: :meth:`akv.storage.CopyExecutor.submit` then
  ``ticket.wait()``: the path the manager's CoW copies take (validation,
  queue, worker thread; on CUDA the dedicated copy stream and its fence);
- ``memcpy``: ``dst.copy_(src)`` of one contiguous preallocated buffer of the
  same ``m * bytes_per_block`` bytes (the bandwidth ceiling).

Throughput is bytes written per second (GB/s = 1e9 B/s), the median of
``--reps`` timed calls after warm-up, the three methods timed round-robin
within each rep so background load hits them alike; the ratio is akv over
memcpy. CPU always (one torch thread by default), CUDA when available (timed
with ``torch.cuda.synchronize``).

    python stress/bench_copy.py                        # JSON to stress/results/bench_copy.json
    python stress/bench_copy.py --num-blocks 256 --layers 8 --batches 1 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from akv.storage import CopyExecutor, KVStorage


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[int], None]], device: torch.device, reps: int, warmup: int
) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin so background load hits all alike.

    Each rep calls every function once, in turn (device synchronized around
    each call); ``warmup`` untimed reps first.
    """
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


def bench_device(device: str, args: argparse.Namespace) -> list[dict]:
    """All batch sizes on one device; one row per (batch size, method)."""
    storage = KVStorage(
        num_blocks=args.num_blocks,
        block_size=16,
        num_layers=args.layers,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device=device,
    )
    for cache in storage.kv_caches:
        cache.normal_()
    dev = storage.device
    executor = CopyExecutor(storage)
    executor.start()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    try:
        for m in args.batches:
            if 2 * m > args.num_blocks:
                continue
            pairs = []
            for _ in range(args.reps + args.warmup):
                perm = torch.randperm(args.num_blocks, generator=gen)
                pairs.append((perm[:m].tolist(), perm[m : 2 * m].tolist()))
            nbytes = m * storage.bytes_per_block
            # (m * bytes_per_block,) contiguous, the memcpy baseline of the same bytes
            src_buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
            dst_buf = torch.empty_like(src_buf)

            def direct(i: int, pairs=pairs) -> None:
                storage.copy_blocks(*pairs[i])

            def worker(i: int, pairs=pairs) -> None:
                executor.submit(*pairs[i]).wait()

            def memcpy(_i: int, src_buf=src_buf, dst_buf=dst_buf) -> None:
                dst_buf.copy_(src_buf)

            seconds = time_interleaved(
                {"memcpy": memcpy, "copy_blocks": direct, "stream worker": worker}, dev, args.reps, args.warmup
            )
            for method, s in seconds.items():
                rows.append(
                    {
                        "device": dev.type,
                        "blocks_per_call": m,
                        "method": method,
                        "bytes_per_call": nbytes,
                        "median_s": s,
                        "gb_per_s": nbytes / s / 1e9,
                        "ratio_to_memcpy": seconds["memcpy"] / s,
                    }
                )
            print(
                f"{dev.type:4} m={m:4d} {nbytes / 2**20:8.1f} MiB  memcpy {nbytes / seconds['memcpy'] / 1e9:6.2f} GB/s  "
                f"copy_blocks {nbytes / seconds['copy_blocks'] / 1e9:6.2f} GB/s "
                f"({seconds['memcpy'] / seconds['copy_blocks']:.2f}x)  stream worker "
                f"{nbytes / seconds['stream worker'] / 1e9:6.2f} GB/s ({seconds['memcpy'] / seconds['stream worker']:.2f}x)"
            )
            del src_buf, dst_buf
    finally:
        executor.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=512, help="blocks in the pool (default 512: 1 GiB)")
    parser.add_argument("--layers", type=int, default=32, help="layers (default 32, as Llama-3-8B)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="blocks per call")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on a shared, busy host)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when available")
    parser.add_argument("--json", type=Path, default=Path("stress/results/bench_copy.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    rows = []
    for device in devices:
        rows += bench_device(device, args)
    data = {
        "block_shape_per_layer": [2, 16, 8, 128],
        "dtype": "bfloat16",
        "layers": args.layers,
        "bytes_per_block": 2 * args.layers * 16 * 8 * 128 * 2,
        "num_blocks": args.num_blocks,
        "reps": args.reps,
        "rows": rows,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name() if "cuda" in devices else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
