"""Independent reference count of prefix-cache hits for an unbounded cache.

Computed from trace hash ids only (no tokens, no akv radix tree), so it can
check a real cache end to end: replaying a trace through akv with a cache large
enough never to evict must report exactly these cached-token counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from akv.errors import InvalidInput
from akv.trace.reader import TraceRequest

__all__ = ["expected_cached_tokens", "hit_rate"]


def expected_cached_tokens(
    requests: Sequence[TraceRequest],
    *,
    block_size: int = 16,
    trace_block_tokens: int = 512,
) -> list[int]:
    """Prompt tokens of each request served from an unbounded prefix cache.

    Requests are processed in sequence order; each one sees every earlier
    request's prompt in the cache. For request ``r`` and an earlier request
    ``e`` whose first ``k_e`` hash ids equal ``r``'s::

        shared_e = min(k_e * trace_block_tokens, input_length_e, input_length_r)
        cached_r = max_e min(shared_e // block_size,
                             (input_length_r - 1) // block_size) * block_size

    (0 when no earlier request shares ``r``'s first hash id). Why: an earlier
    request publishes only its full prompt blocks (``block_size`` tokens each);
    hits are whole blocks; and the last prompt token is always computed (its
    logits produce the first output token), so a prompt that is an exact
    multiple of ``block_size`` and fully cached still reports
    ``input_length - block_size``. Generated tokens are not counted as
    published: only prompts are.

    Implementation: a trie over hash-id sequences whose nodes store the largest
    ``input_length`` of earlier requests through them. Walking ``r``'s ids, the
    candidate at depth ``d`` is ``min(d * trace_block_tokens, maxlen_d)``; the
    best over ``d`` equals the best over earlier requests. ``r`` is inserted
    after its count is taken. Time and memory O(total hash ids).

    Args:
        requests: Trace requests, in arrival (replay) order.
        block_size: KV-cache block size in tokens (>= 1).
        trace_block_tokens: Tokens per hash id in the trace (512 for Mooncake).

    Returns:
        Cached prompt tokens per request, same order as ``requests``; each a
        multiple of ``block_size`` in ``[0, input_length - 1]``.

    Raises:
        InvalidInput: ``block_size`` or ``trace_block_tokens`` is not an int >= 1.
    """
    for name, v in (("block_size", block_size), ("trace_block_tokens", trace_block_tokens)):
        if type(v) is not int or v < 1:
            raise InvalidInput(f"{name} must be an int >= 1, got {v!r}")
    # Trie: node 0 is the root; children[(parent, hash_id)] -> node;
    # max_len[node] = largest input_length of an earlier request through node.
    children: dict[tuple[int, int], int] = {}
    max_len: list[int] = [0]
    out: list[int] = []
    for req in requests:
        n = req.input_length
        ids = req.hash_ids
        # Walk the shared prefix.
        node = 0
        shared = 0
        for depth, h in enumerate(ids, start=1):
            child = children.get((node, h))
            if child is None:
                break
            node = child
            cand = min(depth * trace_block_tokens, max_len[node])
            shared = max(shared, cand)
        shared = min(shared, n)
        out.append(min(shared // block_size, (n - 1) // block_size) * block_size if n > 0 else 0)
        # Publish this request: update the shared part, then extend.
        node = 0
        for h in ids:
            key = (node, h)
            child = children.get(key)
            if child is None:
                child = len(max_len)
                children[key] = child
                max_len.append(n)
            elif max_len[child] < n:
                max_len[child] = n
            node = child
    return out


def hit_rate(requests: Sequence[TraceRequest], cached: Sequence[int]) -> float:
    """Token-weighted prompt hit rate.

    Args:
        requests: Trace requests.
        cached: Cached prompt tokens per request (e.g. from
            :func:`expected_cached_tokens`), same length and order.

    Returns:
        ``sum(cached) / sum(input_length)``, in ``[0, 1]`` for valid counts;
        ``0.0`` if there are no prompt tokens.

    Raises:
        InvalidInput: ``cached`` and ``requests`` differ in length.
    """
    if len(cached) != len(requests):
        raise InvalidInput(f"cached has {len(cached)} entries but there are {len(requests)} requests")
    total = sum(r.input_length for r in requests)
    return sum(cached) / total if total else 0.0
