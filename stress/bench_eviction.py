"""Benchmark: prefix-cache eviction quality, LRU against the offline optimum (Belady).

Offline simulator over the Mooncake conversation trace (issue 5, "Eviction
quality against the optimum"). The optimum is Belady's MIN policy: evict the
cached block whose next use lies farthest in the future (L. A. Belady, "A study
of replacement algorithms for a virtual-storage computer", IBM Systems Journal
5(2), 1966).

    python stress/bench_eviction.py                  # full trace, JSON to stress/results/
    python stress/bench_eviction.py --limit 2000     # first 2000 requests only

Model (standard offline prefix-cache model; no akv objects, trace hash ids only):

* Cache granularity is the 16-token KV block. Request ``r``'s prompt has
  ``input_length`` tokens; its full blocks are ``k = 0 .. input_length // 16 - 1``.
  Block ``k`` covers tokens ``[16k, 16k + 16)``, inside trace block
  ``j = 16k // 512``. Two requests share block ``k`` iff they share
  ``hash_ids[0..j]`` (prefix identity) and both have block ``k`` full. A block
  is identified by ``(prefix node of hash_ids[0..j], k % 32)``, the prefix
  node coming from a trie over hash-id prefixes.
* Requests are processed one at a time in trace order (no concurrency). The
  cache holds at most ``C`` blocks, all of them cached (none pinned).
* A request hits the longest run of its leading blocks present in the cache,
  capped at ``(input_length - 1) // 16`` blocks (the last prompt token is
  always computed). Afterwards all its full prompt blocks are in the cache
  (inserted or refreshed); then blocks are evicted until at most ``C`` remain.
* LRU: recency is the index of the last request that touched a block; among
  equal recency the deepest block goes first (vLLM's free queue receives a
  request's blocks tail first; SGLang's radix cache evicts leaves). Every
  request touching a block also touches its ancestors, so this only ever
  evicts leaves of the prefix tree. (Ordering blocks *within* a request by
  touch order would evict a chain's root before its tail and strand the tail.)
* Belady: evict the block whose next use (the next request having it among
  its full blocks) is farthest; never-used-again blocks first; ties deepest
  first. Next uses come from one backward pass; the heap uses lazy deletion.
  A block's next use is never earlier than its descendants', so this also
  evicts only leaves and every kept block can actually hit.
* Hit rate = cached prompt tokens / prompt tokens, cached tokens = hit blocks
  x 16. Sizes: tight = 30,720 blocks (60 GiB of Llama-3-8B KV at 16 tokens a
  block, 2 MiB per block), medium = 4x, roomy = 16x, and unbounded (the
  ceiling; checked against :func:`akv.trace.expected_cached_tokens`).
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from collections import OrderedDict
from pathlib import Path

from akv.trace import expected_cached_tokens, read_trace, shared_trace_path

BLOCK = 16
TRACE_BLOCK = 512
PER_TRACE_BLOCK = TRACE_BLOCK // BLOCK  # 32
TIGHT = 30_720
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_eviction.json"

# Belady heap entries are one int: (next_use << 44) | (depth << 30) | block_id,
# negated (heapq is a min-heap, we pop the largest).
_DEPTH_SHIFT = 30
_NU_SHIFT = 44
_BID_MASK = (1 << _DEPTH_SHIFT) - 1
_DEPTH_MASK = (1 << (_NU_SHIFT - _DEPTH_SHIFT)) - 1


def block_ids(requests) -> tuple[list[list[int]], list[int], list[int]]:
    """Per request: the ids of its full prompt blocks (in order), the hit cap, prompt length."""
    children: dict[tuple[int, int], int] = {}
    out: list[list[int]] = []
    caps: list[int] = []
    lens: list[int] = []
    for req in requests:
        n = req.input_length
        nfull = n // BLOCK
        ids: list[int] = []
        node = 0
        for j, h in enumerate(req.hash_ids):
            lo = j * PER_TRACE_BLOCK
            if lo >= nfull:
                break
            key = (node, h)
            child = children.get(key)
            if child is None:
                child = len(children) + 1
                children[key] = child
            node = child
            base = node * PER_TRACE_BLOCK
            ids.extend(range(base, base + min(PER_TRACE_BLOCK, nfull - lo)))
        out.append(ids)
        caps.append((n - 1) // BLOCK)
        lens.append(n)
    return out, caps, lens


def next_uses(blocks: list[list[int]], never: int) -> list[list[int]]:
    """For each request and block, the index of the next request using that block (``never`` if none)."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in blocks]
    for r in range(len(blocks) - 1, -1, -1):
        ids = blocks[r]
        get = last.get
        out[r] = [get(b, never) for b in ids]
        for b in ids:
            last[b] = r
    return out


def hits_of(cache, ids: list[int], cap: int) -> int:
    h = 0
    for b in ids:
        if h >= cap or b not in cache:
            break
        h += 1
    return min(h, cap)


def run_lru(blocks, caps, capacity: int | None) -> int:
    """Total hit blocks under LRU (``capacity`` None: unbounded)."""
    cache: OrderedDict[int, None] = OrderedDict()
    move = cache.move_to_end
    pop = cache.popitem
    total = 0
    for ids, cap in zip(blocks, caps):
        total += hits_of(cache, ids, cap)
        # Deepest first, so the front of the queue is (oldest request, deepest block).
        for b in reversed(ids):
            if b in cache:
                move(b)
            else:
                cache[b] = None
        if capacity is not None:
            while len(cache) > capacity:
                pop(last=False)
    return total


def run_belady(blocks, caps, nus, capacity: int) -> int:
    """Total hit blocks under Belady's MIN."""
    cache: dict[int, int] = {}  # block id -> its current heap key
    heap: list[int] = []
    push = heapq.heappush
    hpop = heapq.heappop
    total = 0
    for ids, cap, nu in zip(blocks, caps, nus):
        total += hits_of(cache, ids, cap)
        for depth, (b, u) in enumerate(zip(ids, nu)):
            key = (u << _NU_SHIFT) | (depth << _DEPTH_SHIFT) | b
            cache[b] = key
            push(heap, -key)
        while len(cache) > capacity:
            key = -hpop(heap)
            b = key & _BID_MASK
            if cache.get(b) == key:
                del cache[b]
        if len(heap) > 4 * len(cache) + 100_000:  # drop stale entries
            heap = [-k for k in cache.values()]
            heapq.heapify(heap)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="trace JSONL (default: shared mooncake_conversation.jsonl)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests")
    ap.add_argument("--tight", type=int, default=TIGHT, help="tight capacity in blocks (default 30720)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    path = args.trace or shared_trace_path("mooncake_conversation.jsonl")
    if path is None:
        print("trace not found: pass --trace", file=sys.stderr)
        return 2
    requests = read_trace(path, limit=args.limit)
    blocks, caps, lens = block_ids(requests)
    n_req = len(requests)
    prompt_tokens = sum(lens)
    total_blocks = sum(len(b) for b in blocks)
    distinct = len({b for ids in blocks for b in ids})
    assert distinct <= _BID_MASK and max(map(len, blocks)) <= _DEPTH_MASK
    nus = next_uses(blocks, never=n_req)
    t_prep = time.perf_counter() - t0
    print(
        f"{n_req} requests, {prompt_tokens:,} prompt tokens, {total_blocks:,} full blocks, "
        f"{distinct:,} distinct; prep {t_prep:.1f}s",
        flush=True,
    )

    t = time.perf_counter()
    unb = run_lru(blocks, caps, None)
    t_unb = time.perf_counter() - t
    expected = sum(expected_cached_tokens(requests, block_size=BLOCK, trace_block_tokens=TRACE_BLOCK))
    assert unb * BLOCK == expected, (unb * BLOCK, expected)
    unb_rate = unb * BLOCK / prompt_tokens

    sizes = {"tight": args.tight, "medium": 4 * args.tight, "roomy": 16 * args.tight}
    rows = []
    for name, cap in sizes.items():
        t = time.perf_counter()
        lru = run_lru(blocks, caps, cap)
        t_lru = time.perf_counter() - t
        t = time.perf_counter()
        bel = run_belady(blocks, caps, nus, cap)
        t_bel = time.perf_counter() - t
        assert lru <= bel <= unb, (name, lru, bel, unb)
        row = {
            "size": name,
            "capacity_blocks": cap,
            "capacity_tokens": cap * BLOCK,
            "lru_hit_rate": lru * BLOCK / prompt_tokens,
            "belady_hit_rate": bel * BLOCK / prompt_tokens,
            "lru_over_belady": lru / bel if bel else None,
            "lru_cached_tokens": lru * BLOCK,
            "belady_cached_tokens": bel * BLOCK,
            "lru_seconds": round(t_lru, 2),
            "belady_seconds": round(t_bel, 2),
        }
        rows.append(row)
        print(
            f"  {name}: LRU {row['lru_hit_rate']:.4f}  Belady {row['belady_hit_rate']:.4f}  "
            f"({t_lru:.1f}s + {t_bel:.1f}s)",
            flush=True,
        )
    runtime = time.perf_counter() - t0

    print()
    print(f"{'size':<10}{'blocks':>10}{'LRU':>9}{'Belady':>9}{'LRU/Bel':>9}")
    for r in rows:
        print(
            f"{r['size']:<10}{r['capacity_blocks']:>10,}{r['lru_hit_rate']:>9.2%}"
            f"{r['belady_hit_rate']:>9.2%}{r['lru_over_belady']:>9.3f}"
        )
    print(f"{'unbounded':<10}{'-':>10}{unb_rate:>9.2%}{unb_rate:>9.2%}{1.0:>9.3f}")
    print(f"runtime {runtime:.1f}s")

    result = {
        "benchmark": "bench_eviction",
        "command": " ".join(["python", "stress/bench_eviction.py", *(sys.argv[1:] if argv is None else argv)]),
        "trace": str(path),
        "limit": args.limit,
        "requests": n_req,
        "prompt_tokens": prompt_tokens,
        "full_blocks": total_blocks,
        "distinct_blocks": distinct,
        "block_tokens": BLOCK,
        "trace_block_tokens": TRACE_BLOCK,
        "model": "sequential offline prefix cache; hit = leading cached run capped at (len-1)//16 blocks; "
        "LRU by last-touching request, ties deepest first; Belady MIN (1966), ties deepest first",
        "sizes": rows,
        "unbounded": {
            "hit_rate": unb_rate,
            "cached_tokens": unb * BLOCK,
            "matches_expected_cached_tokens": True,
            "seconds": round(t_unb, 2),
        },
        "runtime_seconds": round(runtime, 1),
        "prep_seconds": round(t_prep, 1),
        "python": platform.python_version(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
