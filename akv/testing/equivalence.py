"""Dense-equivalence checks: greedy, beam search and parallel sampling through akv vs a dense cache.

Each check runs a generation driver of :mod:`akv.testing.generation` through
a fresh :class:`~akv.manager.KVCacheManager` and its dense reference, and
compares tokens exactly and logits (or beam scores) within a tolerance. It
also checks what the paged run must show besides equal outputs: prefix hits
for the follow-up prompts, copy-on-write copies for beam search, shared
prompt blocks for parallel sampling, and no leaked block once every
sequence is freed. ``akv generate --check`` prints these results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from akv.config import KVCacheConfig
from akv.manager import KVCacheManager
from akv.testing.generation import (
    BeamSearchResult,
    Generation,
    beam_search_dense,
    beam_search_paged,
    greedy_dense,
    greedy_paged,
    sample_dense,
    sample_paged,
)
from akv.testing.model import TinyLM, TinyLMConfig

__all__ = ["CheckResult", "compare_beams", "compare_generations", "leak_report", "run_equivalence_checks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    """Outcome of one paged-vs-dense comparison.

    Attributes:
        name: What was run, e.g. ``"beam search (width 4)"``.
        sequences: Sequences compared.
        tokens_equal: Every sequence generated exactly the same tokens.
        max_abs_diff: Largest absolute difference of ``diff_of`` values.
        diff_of: ``"logits"`` (greedy, sampling) or ``"scores"`` (beam search).
        tolerance: Allowed ``max_abs_diff``.
        cache_ok: The cache-side expectation held (see ``cache_note``).
        cache_note: What the cache did (prefix hits, copies, blocks), briefly.
        leak_free: After freeing everything, the invariant check passed and
            every block was free or cached; ``None`` if not checked here.
    """

    name: str
    sequences: int
    tokens_equal: bool
    max_abs_diff: float
    diff_of: str
    tolerance: float
    cache_ok: bool
    cache_note: str
    leak_free: bool | None = None

    @property
    def passed(self) -> bool:
        """Tokens equal, differences within tolerance, cache expectation met, nothing leaked."""
        return (
            self.tokens_equal and self.max_abs_diff <= self.tolerance and self.cache_ok and self.leak_free is not False
        )


def compare_generations(paged: Sequence[Generation], dense: Sequence[Generation]) -> tuple[bool, float]:
    """``(all tokens equal, max |logit difference|)`` of paired generations (NaN-safe: NaN counts as inf)."""
    equal = len(paged) == len(dense) and all(p.tokens == d.tokens for p, d in zip(paged, dense))
    diff = 0.0
    for p, d in zip(paged, dense):
        if p.logits.shape != d.logits.shape:
            return False, float("inf")
        if p.logits.numel():
            delta = float((p.logits - d.logits).abs().max())
            diff = max(diff, delta if delta == delta else float("inf"))
    return equal, diff


def compare_beams(paged: BeamSearchResult, dense: BeamSearchResult) -> tuple[bool, float]:
    """``(same beams in the same order, max |score difference|)``."""
    equal = len(paged.beams) == len(dense.beams) and all(p.tokens == d.tokens for p, d in zip(paged.beams, dense.beams))
    diff = max((abs(p.score - d.score) for p, d in zip(paged.beams, dense.beams)), default=0.0)
    return equal, diff if diff == diff else float("inf")


async def leak_report(kv: KVCacheManager) -> tuple[bool, str]:
    """After every sequence is freed: full invariant check, and every block free or cached.

    Returns:
        ``(ok, text)``; ``kv.check()`` raising is left to propagate (the
        manager crashes loudly on a broken invariant).
    """
    await kv.check()
    stats = await kv.stats()
    ok = stats.active == 0 and stats.in_flight == 0 and stats.free + stats.cached == stats.num_blocks
    text = f"free {stats.free} + cached {stats.cached} of {stats.num_blocks}, active {stats.active}"
    return ok, text


def make_prompt(length: int, *, vocab_size: int, seed: int) -> list[int]:
    """``length`` token ids drawn uniformly from the vocabulary with a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


async def run_equivalence_checks(
    *,
    device: str = "cpu",
    seed: int = 0,
    steps: int = 32,
    beam_width: int = 4,
    samples: int = 4,
    block_size: int = 4,
    prompt_len: int = 21,
    tolerance: float = 1e-4,
    model_config: TinyLMConfig | None = None,
) -> list[CheckResult]:
    """Run every check with a :class:`TinyLM` (weights seeded by ``seed``) on ``device``.

    Checks, each on a fresh manager (invariants checked after every message):

    1. greedy: two prompts decoded as one batch, cold cache;
    2. greedy, prefix hit: a follow-up turn (first prompt + its output + new
       tokens) and a prompt sharing only a prefix, after 1 in the same
       manager; expects ``cached_tokens > 0`` for both;
    3. beam search: expects copy-on-write copies and no leak;
    4. parallel sampling: expects fewer blocks allocated than
       ``samples`` unshared sequences would need, and no leak.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        seed: Seed of the weights, prompts and samplers.
        steps: Tokens generated per sequence.
        beam_width: Beams kept per step.
        samples: Parallel samples ``n``.
        block_size: Tokens per block (small, so prompts span many blocks).
        prompt_len: Length of the prompts (not a multiple of the block size:
            forks then share a partial tail block).
        tolerance: Allowed absolute difference of logits and beam scores.
        model_config: Model sizes (default :class:`TinyLMConfig` with ``seed``).

    Returns:
        One :class:`CheckResult` per check, in the order above.
    """
    cfg = model_config or TinyLMConfig(seed=seed)
    model = TinyLM(cfg, device=device)
    vocab = cfg.vocab_size
    a = make_prompt(prompt_len, vocab_size=vocab, seed=seed + 1)
    b = make_prompt(prompt_len + 5, vocab_size=vocab, seed=seed + 2)
    per_seq = -(-(prompt_len + 2 * steps + 16) // block_size)
    num_blocks = max(64, 4 * per_seq * max(beam_width, samples, 2))

    def config() -> KVCacheConfig:
        return cfg.kv_cache_config(num_blocks=num_blocks, block_size=block_size, device=device)

    results = []
    async with KVCacheManager(config()) as kv:
        first = {"greedy-a": a, "greedy-b": b}
        paged = await greedy_paged(kv, model, first, max_new_tokens=steps)
        dense = greedy_dense(model, first, max_new_tokens=steps)
        equal, diff = compare_generations(list(paged.values()), list(dense.values()))
        cold = [paged[s].cached_tokens for s in first]
        results.append(
            CheckResult(
                name="greedy",
                sequences=len(first),
                tokens_equal=equal,
                max_abs_diff=diff,
                diff_of="logits",
                tolerance=tolerance,
                cache_ok=cold == [0, 0],
                cache_note=f"cold: cached tokens {cold}",
            )
        )
        # The next turn of conversation a (its prompt, the reply, new tokens) and a prompt sharing b's start.
        follow = {
            "turn-2": [*a, *paged["greedy-a"].tokens[: steps - 1], *make_prompt(7, vocab_size=vocab, seed=seed + 3)],
            "shared-start": [*b[: 2 * block_size + 1], *make_prompt(9, vocab_size=vocab, seed=seed + 4)],
        }
        paged2 = await greedy_paged(kv, model, follow, max_new_tokens=steps)
        dense2 = greedy_dense(model, follow, max_new_tokens=steps)
        equal, diff = compare_generations(list(paged2.values()), list(dense2.values()))
        hits = [paged2[s].cached_tokens for s in follow]
        leak_ok, _ = await leak_report(kv)
        results.append(
            CheckResult(
                name="greedy, prefix hits",
                sequences=len(follow),
                tokens_equal=equal,
                max_abs_diff=diff,
                diff_of="logits",
                tolerance=tolerance,
                cache_ok=all(h > 0 for h in hits),
                cache_note="hits " + ", ".join(f"{h}/{len(p)}" for h, p in zip(hits, follow.values())) + " tokens",
                leak_free=leak_ok,
            )
        )

    async with KVCacheManager(config()) as kv:
        paged_beams = await beam_search_paged(kv, model, a, beam_width=beam_width, num_steps=steps)
        dense_beams = beam_search_dense(model, a, beam_width=beam_width, num_steps=steps)
        equal, diff = compare_beams(paged_beams, dense_beams)
        stats = await kv.stats()
        leak_ok, _ = await leak_report(kv)
        results.append(
            CheckResult(
                name=f"beam search, width {beam_width}",
                sequences=beam_width,
                tokens_equal=equal,
                max_abs_diff=diff,
                diff_of="scores",
                tolerance=tolerance,
                # The first step forks the prompt's sequence: its shared tail must be
                # copied before the first write iff it is a partial block; with a
                # prompt of whole blocks, later steps may need no copy at all.
                cache_ok=stats.forks > 0 and (stats.cow_copies > 0 or len(a) % block_size == 0),
                cache_note=f"{stats.forks} forks, {stats.cow_copies} CoW copies"
                + ("" if len(a) % block_size else " (prompt of whole blocks: a copy is not required)"),
                leak_free=leak_ok,
            )
        )

    async with KVCacheManager(config()) as kv:
        paged_samples = await sample_paged(kv, model, a, num_samples=samples, max_new_tokens=steps, seed=seed)
        dense_samples = sample_dense(model, a, num_samples=samples, max_new_tokens=steps, seed=seed)
        equal, diff = compare_generations(paged_samples, dense_samples)
        stats = await kv.stats()
        unshared = samples * -(-(prompt_len + steps) // block_size)
        leak_ok, _ = await leak_report(kv)
        distinct = len({s.tokens for s in paged_samples})
        results.append(
            CheckResult(
                name=f"parallel sampling, n={samples}",
                sequences=samples,
                tokens_equal=equal,
                max_abs_diff=diff,
                diff_of="logits",
                tolerance=tolerance,
                cache_ok=stats.blocks_allocated < unshared,
                cache_note=f"{stats.blocks_allocated} blocks vs {unshared} unshared, {distinct} distinct samples",
                leak_free=leak_ok,
            )
        )
    return results
