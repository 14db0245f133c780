"""Micro-benchmark: the cost of cache events per block and per step (akv.events, akv.routing).

Times, in one run and alternating within each pair so machine load hits both alike
(best of ``--repeats`` timed batches):

- ``KeyIndex.stored`` per block for a prefill (one call of a ``--prefill-blocks``
  chain), next to ``chain_keys`` over the same tokens (the hash cost alone);
  ``stored_events`` (keys plus the ``BlockStored`` objects) for that prefill and for
  a decode step (one call of the ``--batch / block_size`` blocks that fill in a step,
  each below a cached block); ``removed`` of the prefill's blocks;
- ``EventHub.publish`` of one decode step's events (``--batch / block_size`` one-block
  ``BlockStored`` events, the blocks that fill in a step) with no subscriber and with
  one (drained after each publish), paired;
- ``CacheAwareRouter``: ``apply`` of that step's batch, and ``longest_prefix`` /
  ``pick`` over ``--instances`` instances for a prompt of ``--prefill-blocks`` blocks.

Prints one line per measurement and writes JSON.

    OMP_NUM_THREADS=1 python3 stress/bench_events.py                  # JSON to stress/results/bench_events.json
    OMP_NUM_THREADS=1 python3 stress/bench_events.py --repeats 3 --out /tmp/e.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from akv.core.block_key import chain_keys
from akv.events import BlockStored, EventBatch, EventHub, KeyIndex
from akv.routing import CacheAwareRouter


def _timed_us(setup: Callable[[], object], fn: Callable[[object], object], number: int) -> float:
    """µs per call of ``fn(state)`` over ``number`` calls, each on a fresh ``setup()`` (not timed)."""
    states = [setup() for _ in range(number)]
    start = time.perf_counter()
    for state in states:
        fn(state)
    return (time.perf_counter() - start) / number * 1e6


def _best(pairs: dict[str, tuple], repeats: int) -> dict[str, float]:
    """Best µs per call of each ``name -> (setup, fn, number)``, the names alternating in every repeat."""
    best = dict.fromkeys(pairs, float("inf"))
    for _ in range(repeats):
        for name, (setup, fn, number) in pairs.items():
            best[name] = min(best[name], _timed_us(setup, fn, number))
    return best


def key_index_cases(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, tuple]:
    """Setups and calls for the KeyIndex measurements."""
    bs, n = args.block_size, args.prefill_blocks
    num_blocks = 2 * (args.batch + n)
    prompt = rng.integers(0, 32_000, n * bs, dtype=np.int32)
    rows = prompt.reshape(n, bs)
    ids, parents = list(range(n)), [None, *range(n - 1)]
    step_blocks = max(1, args.batch // bs)  # blocks that fill in one decode step, each below a cached one
    decode_rows = rng.integers(0, 32_000, (step_blocks, bs), dtype=np.int32)
    decode_ids = list(range(n, n + step_blocks))
    decode_parents = [i % n for i in range(step_blocks)]

    def fresh() -> KeyIndex:
        return KeyIndex(num_blocks, bs)

    def with_prefill() -> KeyIndex:
        index = fresh()
        index.stored(ids, parents, rows, [None] * n)
        return index

    def decode(index: KeyIndex) -> None:
        index.stored_events(decode_ids, decode_parents, decode_rows, [None] * step_blocks)

    return {
        "chain_keys_prefill": (lambda: None, lambda _: chain_keys(prompt, bs), 20),
        "stored_prefill": (fresh, lambda ix: ix.stored(ids, parents, rows, [None] * n), 20),
        "stored_events_prefill": (fresh, lambda ix: ix.stored_events(ids, parents, rows, [None] * n), 20),
        "stored_events_decode_step": (with_prefill, decode, 50),
        "removed_prefill": (with_prefill, lambda ix: ix.removed(ids[::-1]), 20),
    }


def step_events(args: argparse.Namespace, rng: np.random.Generator) -> list:
    """The BlockStored events of one decode step: one block for every ``block_size``-th sequence."""
    bs = args.block_size
    count = max(1, args.batch // bs)
    index = KeyIndex(count, bs)
    rows = rng.integers(0, 32_000, (count, bs), dtype=np.int32)
    return index.stored_events(list(range(count)), [None] * count, rows, [None] * count)


def hub_cases(events: list) -> dict[str, tuple]:
    """Setups and calls for publishing one step's events with 0 and 1 subscriber."""
    hub0, hub1 = EventHub(), EventHub()
    sub = hub1.subscribe(buffer=1024)

    def publish_drained(_: object) -> None:
        hub1.publish(events)
        sub.receive_nowait()

    return {
        "publish_0_subscribers": (lambda: None, lambda _: hub0.publish(events), 2000),
        "publish_1_subscriber": (lambda: None, publish_drained, 2000),
    }


def router_cases(args: argparse.Namespace, events: list, rng: np.random.Generator) -> dict[str, tuple]:
    """Setups and calls for the router: apply one step's batch; look up and pick a long prompt."""
    bs, n = args.block_size, args.prefill_blocks
    hub = EventHub()
    batches = [hub.publish(events)]
    prompt = rng.integers(0, 32_000, n * bs + 1, dtype=np.int32).tolist()
    warm = CacheAwareRouter(range(args.instances), block_size=bs)
    keys = chain_keys(prompt[: n * bs], bs)

    for i in range(args.instances):  # instance i holds the first i * n / instances blocks
        held = keys[: i * n // args.instances] or keys[:1]
        store = BlockStored(
            block_hashes=held,
            parent_block_hash=None,
            token_ids=prompt[: len(held) * bs],
            block_size=bs,
            medium="device",
        )
        warm.apply(i, EventBatch(seq=1, ts=0.0, events=(store,)))

    def fresh_router() -> CacheAwareRouter:
        return CacheAwareRouter([0], block_size=bs)

    return {
        "router_apply_step": (fresh_router, lambda r: r.apply(0, batches[0]), 200),
        "router_longest_prefix": (lambda: None, lambda _: warm.longest_prefix(args.instances - 1, prompt), 50),
        "router_pick": (lambda: None, lambda _: warm.pick(prompt), 50),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print one line per measurement and write the JSON report.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The report written to ``--out``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256, help="decoding sequences per step")
    parser.add_argument("--prefill-blocks", type=int, default=64, help="blocks of a prefilled prompt")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per measurement (best kept)")
    parser.add_argument("--out", type=Path, default=Path("stress/results/bench_events.json"))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    events = step_events(args, rng)
    results = _best(key_index_cases(args, rng), args.repeats)
    results.update(_best(hub_cases(events), args.repeats))
    results.update(_best(router_cases(args, events, rng), args.repeats))
    per_block = {
        "chain_keys_prefill": args.prefill_blocks,
        "stored_prefill": args.prefill_blocks,
        "stored_events_prefill": args.prefill_blocks,
        "stored_events_decode_step": max(1, args.batch // args.block_size),
        "removed_prefill": args.prefill_blocks,
    }
    report = {
        "benchmark": "bench_events",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "events_per_step": len(events),
        "us_per_call": results,
        "us_per_block": {name: results[name] / blocks for name, blocks in per_block.items()},
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    for name, us in results.items():
        extra = f"  ({us / per_block[name]:.2f} µs/block)" if name in per_block else ""
        print(f"{name:28s} {us:10.2f} µs/call{extra}")
    print(f"load average {report['load_average']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
