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


# --------------------------------------------------------------------------- concurrent model
#
# The functions above model one request at a time. The ones below replay the event stream of a
# continuous-batching run (stress/peer_trace.py records it): admissions, decode growth and
# finishes interleave, blocks held by running sequences cannot be evicted (and serve hits while
# held), and only cached, unreferenced blocks are eviction candidates. Events:
#
#   ("A", r)      admit request r: look up its chain blocks[r][:caps[r]], hit the leading run
#                 present (held or cached), reference the hits, allocate the rest of its
#                 full prompt blocks (published at once, as vLLM and akv with prefill_done do)
#                 plus one private block for a partial prompt tail;
#   ("G", r, n)   request r needs n more private blocks (decode crossed block boundaries);
#   ("F", r)      request r finishes: its private blocks are released first (``out_cached[r]``
#                 of them are full output blocks the engines publish; they are never looked up
#                 again), then its prompt blocks deepest first; a block whose refcount drops to 0
#                 becomes cached;
#   ("S",)        end of a scheduler phase (where akv's eviction loop may run).
#
# A pool of ``capacity`` blocks holds free + held + cached blocks; an allocation takes a free
# block if there is one, else evicts one cached block by the policy.


class PoolOverflow(RuntimeError):
    """The event stream needs more held blocks than the pool has (the schedule is wrong)."""


def belady_next_uses(order: list[int], blocks: list[list[int]], caps: list[int], never: int) -> dict[int, list[int]]:
    """For each admitted request (``order`` = admission order) and each of its full prompt
    blocks, the admission position of the next request whose lookup chain (``blocks[r][:caps[r]]``)
    contains that block (``never`` if none)."""
    last: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    for pos in range(len(order) - 1, -1, -1):
        r = order[pos]
        ids = blocks[r]
        get = last.get
        out[r] = [get(b, never) for b in ids]
        for b in ids[: caps[r]]:
            last[b] = pos
    return out


def simulate(
    events,
    blocks: list[list[int]],
    caps: list[int],
    out_cached: list[int],
    capacity: int | None,
    policy: str = "lru",
    watermarks: tuple[float, float] | None = None,
    tail_private: list[bool] | None = None,
) -> dict:
    """Replay a concurrent event stream; return per-request hit blocks and counters.

    Args:
        events: Iterable of event tuples (see above).
        blocks: Per request, the ids of its full prompt blocks in order (equal ids = equal
            prefix, as from :func:`block_ids`).
        caps: Per request, the most blocks a hit may cover (``(len - 1) // 16``).
        out_cached: Per request, the private blocks that become cached (published full output
            blocks) at finish; the rest of its private blocks are freed.
        capacity: Pool blocks (``None``: unbounded, nothing is ever evicted).
        policy: ``"lru"`` (least recently released first, a request's blocks deepest first:
            akv's and vLLM's order) or ``"belady"`` (MIN: farthest next lookup first, never
            looked up again first, ties deepest first; published output blocks count as never
            used, so they are simply freed).
        watermarks: ``(low, high)`` free fractions: after every ("S",) event, if fewer than
            ``low * capacity`` blocks are free, evict until ``ceil(high * capacity)`` are (akv's
            background eviction loop). ``None``: evict on demand only.
        tail_private: Per request, whether it has a partial prompt tail block (default: none).

    Returns:
        ``{"hits": {r: hit_blocks}, "evicted": n, "peak_held": n, "admitted": [r, ...]}``.
    """
    if policy not in ("lru", "belady"):
        raise ValueError(f"unknown policy {policy!r}")
    events = list(events)
    order = [e[1] for e in events if e[0] == "A"]
    never = len(order)
    nus = belady_next_uses(order, blocks, caps, never) if policy == "belady" else {}
    unbounded = capacity is None
    cap_n = 0 if unbounded else capacity
    ref: dict[int, int] = {}  # named block -> refcount (held blocks only)
    present: set[int] = set()  # named blocks held or cached
    lru: OrderedDict[int, None] = OrderedDict()  # cached entries; anonymous ones are negative
    bkey: dict[int, int] = {}  # belady: cached named block -> heap key
    heap: list[int] = []
    nextuse: dict[int, int] = {}
    depth_of: dict[int, int] = {}
    free = cap_n
    held = 0
    peak = 0
    evicted = 0
    anon = 0
    seq_named: dict[int, list[int]] = {}
    seq_private: dict[int, int] = {}
    hits: dict[int, int] = {}
    pos = -1

    def n_cached() -> int:
        return len(lru) if policy == "lru" else len(bkey)

    def evict_one() -> bool:
        nonlocal free, evicted, heap
        if policy == "lru":
            if not lru:
                return False
            b, _ = lru.popitem(last=False)
        else:
            while True:
                if not heap:
                    return False
                key = -heapq.heappop(heap)
                b = key & _BID_MASK
                if bkey.get(b) == key:
                    del bkey[b]
                    break
            if len(heap) > 4 * len(bkey) + 100_000:
                heap = [-k for k in bkey.values()]
                heapq.heapify(heap)
        if b >= 0:
            present.discard(b)
        free += 1
        evicted += 1
        return True

    def take(n: int) -> None:
        nonlocal free, held, peak
        if not unbounded:
            while free < n:
                if not evict_one():
                    raise PoolOverflow(f"need {n} blocks: {free} free, {held} held, nothing cached")
            free -= n
        held += n
        peak = max(peak, held)

    def cache(b: int) -> None:
        if policy == "lru":
            lru[b] = None
        else:
            key = (nextuse[b] << _NU_SHIFT) | (depth_of[b] << _DEPTH_SHIFT) | b
            bkey[b] = key
            heapq.heappush(heap, -key)

    def uncache(b: int) -> None:
        if policy == "lru":
            del lru[b]
        else:
            del bkey[b]  # its heap entry goes stale

    for ev in events:
        kind = ev[0]
        if kind == "A":
            r = ev[1]
            pos += 1
            ids = blocks[r]
            cap = caps[r]
            h = 0
            for b in ids:
                if h >= cap or b not in present:
                    break
                h += 1
            hits[r] = h
            nu = nus.get(r)
            named: list[int] = []
            private = 1 if tail_private is not None and tail_private[r] else 0
            new: list[int] = []
            dup = False
            for i, b in enumerate(ids):
                if i < h:
                    c = ref.get(b, 0)
                    if c == 0:
                        if not unbounded:
                            uncache(b)
                        held += 1
                    ref[b] = c + 1
                    named.append(b)
                elif dup or b in present:
                    dup = True  # the engines stop publishing at an existing copy: private
                    private += 1
                else:
                    new.append(b)
                if nu is not None and (i < h or not dup):
                    nextuse[b] = nu[i]
                    depth_of[b] = i
            take(len(new) + private)
            for b in new:
                ref[b] = 1
                present.add(b)
                named.append(b)
            seq_named[r] = named
            seq_private[r] = private
        elif kind == "G":
            r, n = ev[1], ev[2]
            take(n)
            seq_private[r] += n
        elif kind == "F":
            r = ev[1]
            private = seq_private.pop(r)
            keep = min(out_cached[r], private) if policy == "lru" and not unbounded else 0
            held -= private
            free += private - keep
            for _ in range(keep):
                anon -= 1
                lru[anon] = None
            for b in reversed(seq_named.pop(r)):
                c = ref[b] - 1
                if c:
                    ref[b] = c
                    continue
                del ref[b]
                held -= 1
                if unbounded:
                    continue  # stays present forever; not counted against any pool
                cache(b)
        elif kind == "S":
            if watermarks is not None and not unbounded and free < watermarks[0] * cap_n:
                target = -(-int(watermarks[1] * cap_n * 1_000_000) // 1_000_000)
                while free < target and evict_one():
                    pass
        else:
            raise ValueError(f"unknown event {ev!r}")
        if not unbounded and free + held + n_cached() != cap_n:
            raise AssertionError(f"pool accounting: {free} free + {held} held + {n_cached()} cached != {cap_n}")
    return {"hits": hits, "evicted": evicted, "peak_held": peak, "admitted": order}


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
