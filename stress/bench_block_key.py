"""Micro-benchmark: the cost of content keys (akv.core.block_key) for one long prompt.

Times :func:`akv.core.block_key.chain_keys` over a prompt of ``--tokens`` token ids
(default 13,696: the Mooncake conversation trace's mean prompt, 856 blocks of 16),
next to :func:`akv.core.radix_tree.block_keys`, the per-block token bytes the tree
matches on today, in one run (alternating, best of ``--repeats``), so machine load
hits both alike. Prints a line and writes JSON.

    OMP_NUM_THREADS=1 python3 stress/bench_block_key.py                # JSON to stress/results/bench_block_key.json
    OMP_NUM_THREADS=1 python3 stress/bench_block_key.py --tokens 576 --out /tmp/k.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from akv.core.block_key import KEY_FUNCTION, KEY_VERSION, chain_keys
from akv.core.radix_tree import block_keys


def _best_us(fn, number: int) -> float:
    """Best-of-one-batch time per call, in µs."""
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number * 1e6


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print one line per timed function and write the JSON report.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The report written to ``--out``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=13_696)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--number", type=int, default=50, help="calls per timed batch")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per function (best kept)")
    parser.add_argument("--out", type=Path, default=Path("stress/results/bench_block_key.json"))
    args = parser.parse_args(argv)
    tokens = np.random.default_rng(0).integers(0, 128_256, args.tokens).astype(np.int32)
    num_blocks = args.tokens // args.block_size
    fns = {
        "chain_keys": lambda: chain_keys(tokens, args.block_size, ("lora", 7)),
        "block_keys": lambda: block_keys(tokens, args.block_size, num_blocks),
    }
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(args.repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], _best_us(fn, args.number))
    report = {
        "key_function": KEY_FUNCTION,
        "key_version": KEY_VERSION,
        "tokens": args.tokens,
        "block_size": args.block_size,
        "blocks": num_blocks,
        "us_per_prompt": best,
        "ns_per_block": {name: us * 1e3 / num_blocks for name, us in best.items()},
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1m": os.getloadavg()[0],
    }
    for name, us in best.items():
        print(
            f"{name}: {us:,.1f} us per {args.tokens:,}-token prompt ({num_blocks} blocks), "
            f"{report['ns_per_block'][name]:,.0f} ns per block"
        )
    print(f"OMP_NUM_THREADS={report['omp_num_threads']}, load average {report['load_average_1m']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
