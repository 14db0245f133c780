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

The ``wakeup`` part measures, from an event loop (anyio on asyncio), what a
copy costs a caller beyond the copy itself, with one-block batches of the
``tiny`` model's shape (2 layers, 8 KiB per block: the copy is a few
microseconds), the executor on a thread of its own as in the manager. Methods:

- ``copy_blocks``: the copy on the calling thread, no executor (the floor);
- ``blocking wait``: ``submit(...).wait()`` from the loop thread;
- ``thread per waiter``: each waiter awaits ``anyio.to_thread.run_sync`` of the
  ticket's ``threading.Event.wait``, which is what ``CopyTicket.wait_async`` did
  up to commit a8f43a1;
- ``loop wake-up``: each waiter awaits ``CopyTicket.wait_async`` (one event per
  loop, set by the worker thread with one ``call_soon_threadsafe``).

``round trip``: submit and await on a running executor, one waiter: the fixed
cost per submission (median of ``--wakeup-reps``). ``parked``: ``W`` tasks
(``--waiters``) parked on one pending batch of a fresh executor, timed from
starting its worker thread until the last one has woken, against the worker
start and copy alone (median of ``--parked-reps``). All methods of a part are
timed round-robin within each rep, paired in one run.

    python stress/bench_copy.py                        # JSON to stress/results/bench_copy.json
    python stress/bench_copy.py --num-blocks 256 --layers 8 --batches 1 16 64
    python stress/bench_copy.py --parts wakeup --json stress/results/bench_copy_wakeup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread
import torch

from akv.storage import CopyExecutor, CopyTicket, KVStorage


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


async def wait_thread_per_waiter(ticket: CopyTicket) -> None:
    """``CopyTicket.wait_async`` as of commit a8f43a1: one anyio worker thread parked per waiter."""
    if not ticket.done():
        await anyio.to_thread.run_sync(ticket._done.wait, abandon_on_cancel=True)
    if ticket.exception() is not None:
        raise ticket.exception()


async def time_wakeup(fns: dict[str, Callable[[int], Awaitable[float]]], reps: int, warmup: int) -> dict[str, dict]:
    """Median and p90 of the seconds each coroutine function reports timing itself, round-robin per rep."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            seconds = await fn(i)
            if i >= warmup:
                times[name].append(seconds)
    return {
        name: {"median_s": statistics.median(ts), "p90_s": statistics.quantiles(ts, n=10)[-1]}
        for name, ts in times.items()
    }


def _wakeup_storage() -> KVStorage:
    # (2, 64, 16, 2, 16) float32 per layer, K then V: the tiny model's shape, 8 KiB per block
    return KVStorage(
        num_blocks=64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu"
    )


WAITS: dict[str, Callable[[CopyTicket], Awaitable[None]]] = {
    "thread per waiter": wait_thread_per_waiter,
    "loop wake-up": CopyTicket.wait_async,
}


async def bench_round_trip(args: argparse.Namespace) -> list[dict]:
    """One-block batches on a running executor, one waiter each: the fixed cost per submission."""
    storage = _wakeup_storage()
    executor = CopyExecutor(storage)
    gen = torch.Generator().manual_seed(args.seed)
    pairs = [torch.randperm(64, generator=gen)[:2].tolist() for _ in range(args.wakeup_reps + args.warmup)]

    async def direct(i: int) -> float:
        t = time.perf_counter()
        storage.copy_blocks([pairs[i][0]], [pairs[i][1]])
        return time.perf_counter() - t

    async def blocking(i: int) -> float:
        t = time.perf_counter()
        executor.submit([pairs[i][0]], [pairs[i][1]]).wait()
        return time.perf_counter() - t

    def awaited_by(wait: Callable[[CopyTicket], Awaitable[None]]) -> Callable[[int], Awaitable[float]]:
        async def run(i: int) -> float:
            t = time.perf_counter()
            await wait(executor.submit([pairs[i][0]], [pairs[i][1]]))
            return time.perf_counter() - t

        return run

    executor.start()  # a thread of its own, as the manager's (not one of the loop's worker threads)
    try:
        fns = {"copy_blocks": direct, "blocking wait": blocking} | {m: awaited_by(w) for m, w in WAITS.items()}
        seconds = await time_wakeup(fns, args.wakeup_reps, args.warmup)
    finally:
        executor.close()
    floor = seconds["copy_blocks"]["median_s"]
    print("round trip W=1  " + "  ".join(f"{m} {t['median_s'] * 1e3:.3f} ms" for m, t in seconds.items()))
    return [
        {"part": "round trip", "waiters": 1, "method": m, **t, "fixed_cost_s": t["median_s"] - floor}
        for m, t in seconds.items()
    ]


async def bench_parked(args: argparse.Namespace, waiters: int) -> list[dict]:
    """``waiters`` tasks parked on one pending batch; time from starting the worker to the last one woken."""
    storage = _wakeup_storage()

    async def floor(_i: int) -> float:  # worker start + copy, woken by a blocking wait
        executor = CopyExecutor(storage)
        ticket = executor.submit([1], [2])
        t = time.perf_counter()
        executor.start()
        ticket.wait()
        elapsed = time.perf_counter() - t
        executor.close()
        return elapsed

    def parked_on(wait: Callable[[CopyTicket], Awaitable[None]]) -> Callable[[int], Awaitable[float]]:
        async def run(_i: int) -> float:
            executor = CopyExecutor(storage)
            ticket = executor.submit([1], [2])
            async with anyio.create_task_group() as tg:
                for _ in range(waiters):
                    tg.start_soon(wait, ticket)
                await anyio.wait_all_tasks_blocked()
                t = time.perf_counter()
                executor.start()
            elapsed = time.perf_counter() - t
            executor.close()
            return elapsed

        return run

    fns = {"worker start + copy": floor} | {m: parked_on(w) for m, w in WAITS.items()}
    seconds = await time_wakeup(fns, args.parked_reps, args.warmup)
    base = seconds["worker start + copy"]["median_s"]
    print(f"parked W={waiters:<5d}" + "  ".join(f"{m} {t['median_s'] * 1e3:.3f} ms" for m, t in seconds.items()))
    return [
        {"part": "parked", "waiters": waiters, "method": m, **t, "wake_cost_s": t["median_s"] - base}
        for m, t in seconds.items()
    ]


async def bench_wakeup(args: argparse.Namespace) -> list[dict]:
    """Both wake-up parts: the round trip, then parked waiters for each ``--waiters`` count."""
    rows = await bench_round_trip(args)
    for waiters in args.waiters:
        rows += await bench_parked(args, waiters)
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
    parser.add_argument("--parts", nargs="+", choices=["throughput", "wakeup"], default=["throughput", "wakeup"])
    parser.add_argument("--waiters", type=int, nargs="+", default=[1, 64, 512, 1000], help="wakeup: parked waiters")
    parser.add_argument("--wakeup-reps", type=int, default=201, help="wakeup: timed round trips per method")
    parser.add_argument("--parked-reps", type=int, default=31, help="wakeup: timed batches per method and W")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    rows, wakeup_rows = [], []
    if "throughput" in args.parts:
        for device in devices:
            rows += bench_device(device, args)
    if "wakeup" in args.parts:
        wakeup_rows = anyio.run(bench_wakeup, args)
    data = {
        "block_shape_per_layer": [2, 16, 8, 128],
        "dtype": "bfloat16",
        "layers": args.layers,
        "bytes_per_block": 2 * args.layers * 16 * 8 * 128 * 2,
        "num_blocks": args.num_blocks,
        "reps": args.reps,
        "rows": rows,
        "wakeup_block_shape_per_layer": [2, 16, 2, 16],
        "wakeup_dtype": "float32",
        "wakeup_reps": args.wakeup_reps,
        "parked_reps": args.parked_reps,
        "wakeup_rows": wakeup_rows,
        "load_average": os.getloadavg(),
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
