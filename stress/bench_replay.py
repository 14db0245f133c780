"""Benchmark: replay the full Mooncake conversation trace in metadata mode.

Prints wall time, per-step manager latency and the hit rate, and writes JSON.

    python stress/bench_replay.py                      # full trace, llama-3-8b shapes, 60 GiB pool
    python stress/bench_replay.py --limit 2000 --json out.json

The pool is sized like an 80 GB GPU serving Llama-3-8B: about 60 GiB of KV
cache (2 MiB per 16-token block), i.e. 30,720 blocks.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import anyio
import torch

from akv import KVCacheConfig, KVCacheManager, model_shape
from akv.obs import configure_logging
from akv.replay import ReplayOptions, replay
from akv.trace import read_trace, shared_trace_path


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--trace", type=Path, default=None, help="default: ../shared/traces/mooncake_conversation.jsonl"
    )
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--pool-gib", type=float, default=60.0)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--json", type=Path, default=Path("stress/results/bench_replay.json"))
    args = parser.parse_args(argv)
    configure_logging(level="warning")

    path = args.trace or shared_trace_path("mooncake_conversation.jsonl")
    if path is None:
        print("bench_replay: ../shared/traces/mooncake_conversation.jsonl not found; pass --trace", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    requests = read_trace(path, limit=args.limit)
    load_s = time.perf_counter() - t0
    shape = model_shape(args.model)
    config = KVCacheConfig(
        num_blocks=int(args.pool_gib * 2**30 // shape.bytes_per_block(16)),
        block_size=16,
        model=shape,
        storage="none",
    )

    async def run():
        async with KVCacheManager(config) as kv:
            return await replay(kv, requests, ReplayOptions(max_batch=args.max_batch, want_metadata=False))

    report = anyio.run(run)
    data = report.as_json()
    data.update(
        trace=str(path),
        trace_load_s=round(load_s, 3),
        model=shape.name,
        pool_gib=args.pool_gib,
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        cpus=len(__import__("os").sched_getaffinity(0)),
        python=platform.python_version(),
        torch=torch.__version__,
    )
    print(
        f"replayed {report.requests_finished:,}/{report.requests:,} requests, {report.prompt_tokens:,} prompt tokens: "
        f"wall {report.wall_s:.1f} s, {report.decode_steps:,} steps, step p50 {report.step_latency_us['p50']:.0f} us "
        f"p99 {report.step_latency_us['p99']:.0f} us, hit rate {report.hit_rate:.2%}, evicted {report.evictions:,} blocks, "
        f"preemptions {report.preemptions:,}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
