"""Benchmark: routing the conversation trace over 4 managers with ``CacheAwareRouter`` vs round-robin vs one manager.

Three fleets, one command, the same requests in arrival order:

- **router**: ``--instances`` managers of ``1/instances`` of the pool each; each
  request goes where ``CacheAwareRouter.pick`` says (longest cached prefix, ties
  and ``--max-running`` cap by running sequences), the router's index fed by
  every manager's event subscription (drained after each admission; resynced
  through ``cached_keys()`` after a gap);
- **round_robin**: the same managers, requests dealt in turn;
- **single**: one manager of the whole pool (the upper bound on hit rate).

A request holds its prompt's blocks (admitted and committed, so its full
blocks are published) from its trace timestamp for ``output_length *
--step-ms`` simulated milliseconds, then is freed; an admission the pool
cannot hold is counted as rejected. Reported per fleet: hit rate (prompt tokens
served from cache / prompt tokens), rejected requests, and load balance at
each arrival: max / mean running sequences over the instances (mean of the
ratio, and its worst).

    OMP_NUM_THREADS=1 python3 stress/bench_routing.py             # JSON to stress/results/bench_routing.json
    OMP_NUM_THREADS=1 python3 stress/bench_routing.py --limit 300 --num-blocks 16384 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import platform
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import numpy as np
import structlog

from akv import KVCacheConfig, KVCacheManager
from akv.errors import PoolExhausted, RequestTooLarge
from akv.routing import CacheAwareRouter
from akv.trace import default_trace_path, read_trace, synthesize_prompt


def _drain(router: CacheAwareRouter, subs: list) -> list[int]:
    """Apply every ready batch of each instance; return the instances left stale (gap seen)."""
    stale = []
    for i, sub in enumerate(subs):
        while (batch := sub.receive_nowait()) is not None:
            router.apply(i, batch)
        if router.index(i).stale:
            stale.append(i)
    return stale


async def run_fleet(args: argparse.Namespace, prompts: list, requests: list, mode: str) -> dict:
    n = 1 if mode == "single" else args.instances
    per = args.num_blocks // n
    cfg = KVCacheConfig(num_blocks=per, block_size=args.block_size, storage="none", enable_events=mode == "router")
    router = CacheAwareRouter(range(n), block_size=args.block_size, max_running=args.max_running)
    async with AsyncExitStack() as stack:
        kvs = [await stack.enter_async_context(KVCacheManager(cfg)) for _ in range(n)]
        subs = [kv.subscribe_events(buffer=4096) for kv in kvs] if mode == "router" else []
        running = [0] * n
        ends: list = []  # (end_ms, seq_id, instance)
        prompt_tokens = cached_tokens = rejected = 0
        ratios: list[float] = []
        t0 = time.perf_counter()
        for k, (req, prompt) in enumerate(zip(requests, prompts)):
            while ends and ends[0][0] <= req.timestamp_ms:
                _, seq_id, i = heapq.heappop(ends)
                await kvs[i].free(seq_id)
                running[i] -= 1
            if n > 1:
                ratios.append(max(running) / statistics.mean(running) if any(running) else 1.0)
            if mode == "router":
                for i in _drain(router, subs):
                    keys, as_of = await kvs[i].cached_keys()
                    router.resync(i, keys, as_of)
                i = router.pick(prompt, running=dict(enumerate(running)))
            else:
                i = k % n
            seq_id = f"r{k}"
            try:
                hit = await kvs[i].add_sequence(seq_id, prompt)
            except (PoolExhausted, RequestTooLarge):
                rejected += 1
                continue
            await kvs[i].commit(seq_id, len(prompt) - hit)
            prompt_tokens += len(prompt)
            cached_tokens += hit
            running[i] += 1
            heapq.heappush(ends, (req.timestamp_ms + req.output_length * args.step_ms, seq_id, i))
        wall = time.perf_counter() - t0
    return {
        "instances": n,
        "blocks_per_instance": per,
        "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "rejected": rejected,
        "load_max_over_mean": {
            "mean": statistics.mean(ratios) if ratios else 1.0,
            "worst": max(ratios) if ratios else 1.0,
        },
        "wall_s": wall,
    }


async def main_async(args: argparse.Namespace) -> dict:
    requests = read_trace(default_trace_path(), limit=args.limit)
    prompts = [
        np.asarray(synthesize_prompt(r.hash_ids, r.input_length, seed=0), dtype=np.int32)[: args.max_prompt]
        for r in requests
    ]
    return {mode: await run_fleet(args, prompts, requests, mode) for mode in ("router", "round_robin", "single")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=2000, help="trace requests (default 2000)")
    parser.add_argument("--num-blocks", type=int, default=65_536, help="whole pool in blocks (default 65536)")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-running", type=int, default=8, help="router load cap, running sequences (default 8)")
    parser.add_argument("--max-prompt", type=int, default=32_768, help="prompt tokens at most (default 32768)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated ms per output token (default 20)")
    parser.add_argument("--out", type=Path, default=Path("stress/results/bench_routing.json"))
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = anyio.run(main_async, args)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    result["machine"] = {"python": platform.python_version(), "load_avg": os.getloadavg()}
    for mode in ("router", "round_robin", "single"):
        r = result[mode]
        lb = r["load_max_over_mean"]
        print(
            f"{mode:11}: {r['instances']} x {r['blocks_per_instance']:,} blocks  hit rate {r['hit_rate']:.3f}  "
            f"rejected {r['rejected']}  load max/mean {lb['mean']:.2f} (worst {lb['worst']:.2f})  {r['wall_s']:.1f} s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
