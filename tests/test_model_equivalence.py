"""A tiny transformer decoding through akv computes exactly what it computes with a dense KV cache.

Greedy (with prefix-cache hits), beam search (fork / free / copy-on-write) and
parallel sampling (shared prompt blocks) through the public
``KVCacheManager`` API, against the same model with one dense cache per
sequence. Tokens must be identical; logits and beam scores agree to 1e-4.
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator

import pytest
import torch
from rich.console import Console

from akv import Admit, KVCacheManager
from akv.generate import main_generate, register
from akv.storage import KVStorage
from akv.storage.paged_attention import paged_decode_attention, paged_prefill_attention
from akv.testing.equivalence import compare_beams, compare_generations, leak_report, make_prompt
from akv.testing.generation import (
    beam_search_dense,
    beam_search_paged,
    greedy_dense,
    greedy_paged,
    sample_dense,
    sample_paged,
    wait_for_copies,
)
from akv.testing.model import PagedBatch, TinyLM, TinyLMConfig

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


DEVICE = "cpu"
ATOL = 1e-4
CONFIG = TinyLMConfig(seed=0)
BLOCK_SIZE = 4
PROMPT = make_prompt(21, vocab_size=CONFIG.vocab_size, seed=1)  # 5 full blocks + a partial tail of 1


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The model is tiny: intra-op threads only add OpenMP sync (3x slower on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(CONFIG, device=DEVICE)


def manager(num_blocks: int = 256, block_size: int = BLOCK_SIZE, cfg: TinyLMConfig = CONFIG) -> KVCacheManager:
    return KVCacheManager(cfg.kv_cache_config(num_blocks=num_blocks, block_size=block_size, device=DEVICE))


def assert_same_generations(paged, dense) -> None:
    for p, d in zip(paged, dense, strict=True):
        assert p.tokens == d.tokens, f"{p.seq_id}: paged {p.tokens} != dense {d.tokens}"
        torch.testing.assert_close(p.logits, d.logits, atol=ATOL, rtol=0)


async def test_paged_forward_matches_dense_for_every_position_with_chunked_prefill(model: TinyLM) -> None:
    """Prefill in two chunks (admit, then a multi-token append), then decode: all logits match dense."""
    dense_cache = model.new_dense_cache()
    dense = model.forward_dense(torch.tensor([*PROMPT, 7, 8, 9]), dense_cache)  # (24, vocab)
    async with manager() as kv:
        result = await kv.step(admits=[Admit(seq_id="s", prompt=PROMPT[:10])])
        await wait_for_copies(result)
        first = model.forward_paged(torch.tensor(PROMPT[:10]), PagedBatch.from_step(result, DEVICE), kv.storage)
        result = await kv.step(commits={"s": 10}, appends={"s": PROMPT[10:]})
        await wait_for_copies(result)
        batch = PagedBatch.from_step(result, DEVICE)
        assert not batch.is_decode and batch.positions.tolist() == list(range(10, 21))
        second = model.forward_paged(torch.tensor(PROMPT[10:]), batch, kv.storage)
        decoded = []
        for token in (7, 8, 9):
            result = await kv.step(commits={"s": result.slot_mapping.numel()}, appends={"s": token})
            await wait_for_copies(result)
            batch = PagedBatch.from_step(result, DEVICE)
            assert batch.is_decode
            decoded.append(model.forward_paged(torch.tensor([token]), batch, kv.storage))
        paged = torch.cat([first, second, *decoded])
        await kv.free("s")
        assert (await leak_report(kv))[0]
    torch.testing.assert_close(paged, dense, atol=ATOL, rtol=0)


async def test_greedy_matches_dense_including_prefix_cache_hits(model: TinyLM) -> None:
    steps = 16
    other = make_prompt(26, vocab_size=CONFIG.vocab_size, seed=2)
    first = {"a": PROMPT, "b": other}
    async with manager() as kv:
        paged = await greedy_paged(kv, model, first, max_new_tokens=steps)
        assert [g.cached_tokens for g in paged.values()] == [0, 0]
        assert_same_generations(paged.values(), greedy_dense(model, first, max_new_tokens=steps).values())

        # Next turn of "a" (prompt + reply + new tokens) and a prompt sharing only b's first 9 tokens.
        turn2 = [*PROMPT, *paged["a"].tokens[: steps - 1], 5, 6, 7]
        follow = {"a2": turn2, "c": [*other[:9], 1, 2, 3, 4, 5]}
        paged2 = await greedy_paged(kv, model, follow, max_new_tokens=steps, free=False)
        # a's prompt and all its committed decode tokens (21 + 15 = 36 = 9 full blocks); b's first 2 full blocks.
        assert paged2["a2"].cached_tokens == 36
        assert paged2["c"].cached_tokens == 8
        assert_same_generations(paged2.values(), greedy_dense(model, follow, max_new_tokens=steps).values())
        for seq_id, prompt in follow.items():
            info = await kv.sequence(seq_id)
            assert list(info.token_ids) == [*prompt, *paged2[seq_id].tokens]
        await kv.step(frees=list(follow))
        stats = await kv.stats()
        assert stats.cached_tokens == 44
        ok, text = await leak_report(kv)
        assert ok, text


async def test_beam_search_matches_dense_beam_search_through_cow(model: TinyLM) -> None:
    width, steps = 4, 32
    async with manager() as kv:
        paged = await beam_search_paged(kv, model, PROMPT, beam_width=width, num_steps=steps, free=False)
        for seq_id, beam in zip(paged.seq_ids, paged.beams, strict=True):
            assert list((await kv.sequence(seq_id)).token_ids) == [*PROMPT, *beam.tokens]
        stats = await kv.stats()
        assert stats.num_sequences == width
        assert stats.cow_copies > 0 and stats.forks > 0
        for seq_id in paged.seq_ids:
            await kv.free(seq_id)
        ok, text = await leak_report(kv)
        assert ok, text
        stats = await kv.stats()
        assert stats.free + stats.cached == stats.num_blocks
    dense = beam_search_dense(model, PROMPT, beam_width=width, num_steps=steps)
    assert [b.tokens for b in paged.beams] == [b.tokens for b in dense.beams]
    for p, d in zip(paged.beams, dense.beams, strict=True):
        assert p.score == pytest.approx(d.score, abs=ATOL)
    assert len({b.tokens for b in paged.beams}) == width
    assert paged.beams[0].score >= paged.beams[-1].score


async def test_parallel_sampling_matches_independent_dense_runs_and_shares_the_prompt(model: TinyLM) -> None:
    n, steps = 4, 24
    async with manager() as kv:
        paged = await sample_paged(kv, model, PROMPT, num_samples=n, max_new_tokens=steps, seed=11, free=False)
        tables = [(await kv.sequence(g.seq_id)).block_ids for g in paged]
        full_prompt_blocks = len(PROMPT) // BLOCK_SIZE
        assert len({t[:full_prompt_blocks] for t in tables}) == 1, "the prompt's full blocks are shared"
        assert len({t[full_prompt_blocks] for t in tables}) == n, "the partial tail was copied on write"
        stats = await kv.stats()
        unshared = n * -(-(len(PROMPT) + steps) // BLOCK_SIZE)
        assert stats.blocks_allocated == unshared - (n - 1) * full_prompt_blocks
        assert stats.cow_copies == n - 1
        await kv.step(frees=[g.seq_id for g in paged])
        ok, text = await leak_report(kv)
        assert ok, text
    dense = sample_dense(model, PROMPT, num_samples=n, max_new_tokens=steps, seed=11)
    assert_same_generations(paged, dense)
    assert len({g.tokens for g in paged}) == n


@pytest.mark.parametrize(
    ("cfg", "block_size"),
    [
        (TinyLMConfig(num_heads=4, num_kv_heads=1, seed=3), 1),  # multi-query, one token per block
        (TinyLMConfig(num_heads=4, num_kv_heads=4, seed=4), 3),  # multi-head
        (TinyLMConfig(num_heads=8, num_kv_heads=2, num_layers=3, tie_embeddings=True, seed=5), 16),
    ],
    ids=["mqa-bs1", "mha-bs3", "gqa4-tied-bs16"],
)
async def test_greedy_and_beams_match_across_shapes_and_block_sizes(cfg: TinyLMConfig, block_size: int) -> None:
    model = TinyLM(cfg, device=DEVICE)
    prompts = {"x": PROMPT, "y": PROMPT[:9]}
    async with manager(num_blocks=512, block_size=block_size, cfg=cfg) as kv:
        paged = await greedy_paged(kv, model, prompts, max_new_tokens=6)
        beams = await beam_search_paged(kv, model, PROMPT[:13], beam_width=3, num_steps=6)
        ok, text = await leak_report(kv)
        assert ok, text
    assert_same_generations(paged.values(), greedy_dense(model, prompts, max_new_tokens=6).values())
    equal, diff = compare_beams(beams, beam_search_dense(model, PROMPT[:13], beam_width=3, num_steps=6))
    assert equal and diff <= ATOL


async def test_the_comparison_catches_a_missing_copy_on_write(model: TinyLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: if the stream worker skipped CoW copies, beams and samples would differ from dense."""
    monkeypatch.setattr(KVStorage, "_copy_unchecked", lambda self, src, dst: None)
    async with manager() as kv:
        beams = await beam_search_paged(kv, model, PROMPT, beam_width=4, num_steps=8)
        samples = await sample_paged(kv, model, PROMPT, num_samples=4, max_new_tokens=8, seed=11)
    equal, diff = compare_beams(beams, beam_search_dense(model, PROMPT, beam_width=4, num_steps=8))
    assert not equal or diff > ATOL
    equal, diff = compare_generations(samples, sample_dense(model, PROMPT, num_samples=4, max_new_tokens=8, seed=11))
    assert not equal or diff > ATOL


def run_generate(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="akv")
    register(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    code = main_generate(parser.parse_args(["generate", *argv]), Console(file=out, width=160))
    return code, out.getvalue()


def test_generate_check_exits_zero_when_all_match_and_one_on_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    code, text = run_generate("--check", "--steps", "6", "--seed", "2")
    assert code == 0, text
    assert "all 4 checks match" in text and "beam search, width 4" in text
    monkeypatch.setattr(KVStorage, "_copy_unchecked", lambda self, src, dst: None)  # a broken CoW
    code, text = run_generate("--check", "--steps", "6", "--seed", "2")
    assert code == 1, text
    assert "MISMATCH" in text and "checks failed" in text


def test_generate_without_check_prints_the_paged_outputs() -> None:
    code, text = run_generate("--steps", "3", "--samples", "2", "--beam-width", "2")
    assert code == 0
    assert "greedy" in text and "beam 1" in text and "sample 1" in text


@pytest.mark.parametrize("argv", [("--block-size", "1", "--steps", "4"), ("--block-size", "3", "--steps", "1")])
def test_generate_check_needs_no_copy_when_forks_share_only_whole_blocks(argv: tuple[str, ...]) -> None:
    """A 21-token prompt fills whole blocks of 1 or 3 tokens: beam search forks it without any copy-on-write."""
    code, text = run_generate("--check", "--seed", "2", *argv)
    assert code == 0, text
    assert "all 4 checks match" in text


def _dense_reference(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_from: int | None) -> torch.Tensor:
    """float32 softmax attention of ``(Q, H, D)`` queries over ``(T, H_kv, D)`` keys and values.

    ``causal_from``: the first query's position (query ``i`` sees keys ``<= causal_from + i``);
    None: every query sees every key.
    """
    group = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,thd->hqt", query, k) / query.shape[-1] ** 0.5
    if causal_from is not None:
        pos_q = torch.arange(query.shape[0])[:, None] + causal_from
        scores = scores.masked_fill(torch.arange(k.shape[0])[None] > pos_q, float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)


def test_bfloat16_paged_attention_matches_a_float32_reference_within_bf16_tolerance() -> None:
    """bf16 cache and queries (GQA, 3 sequences over scattered blocks): decode and prefill outputs
    agree with float32 dense attention on the same (unrounded) values within bf16 tolerance."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, num_kv_heads, num_heads, head_dim = 24, 4, 2, 8, 16
    # (2, num_blocks, block_size, num_kv_heads, head_dim), K then V
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    lens = [13, 4, 22]
    tables = torch.zeros(3, 6, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lens):
        count = -(-n // block_size)
        tables[row, :count] = perm[used : used + count]
        used += count
    dense = [
        (
            cache[0][tables[r, : -(-n // block_size)].long()].flatten(0, 1)[:n],
            cache[1][tables[r, : -(-n // block_size)].long()].flatten(0, 1)[:n],
        )
        for r, n in enumerate(lens)
    ]
    context_lens = torch.tensor(lens, dtype=torch.int32)
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2}  # bf16 keeps 8 significant bits: ~4e-3 per rounding

    query = torch.randn(3, num_heads, head_dim, generator=gen)
    out16 = paged_decode_attention(query.bfloat16(), cache.bfloat16(), tables, context_lens)
    assert out16.dtype is torch.bfloat16
    want = torch.stack(
        [_dense_reference(query[r : r + 1], k, v, causal_from=None)[0] for r, (k, v) in enumerate(dense)]
    )
    torch.testing.assert_close(out16.float(), want, **tolerance)

    q_lens = [5, 4, 1]  # the last 5, 4 and 1 tokens of each context are new (chunked prefill)
    packed = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, 5, 9, 10], dtype=torch.int32)
    out16 = paged_prefill_attention(packed.bfloat16(), cache.bfloat16(), tables, starts, context_lens)
    assert out16.dtype is torch.bfloat16
    want = torch.cat(
        [
            _dense_reference(packed[starts[r] : starts[r + 1]], k, v, causal_from=lens[r] - q_lens[r])
            for r, (k, v) in enumerate(dense)
        ]
    )
    torch.testing.assert_close(out16.float(), want, **tolerance)
