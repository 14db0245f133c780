"""The dense-equivalence checks of test_model_equivalence.py on a CUDA device.

Weights are generated on CPU from the seed and moved, K/V tensors live on the
GPU, copy-on-write copies run on the stream worker's dedicated CUDA stream and
the model runner orders its stream after them through ``result.copies.fences``
(:func:`akv.testing.generation.wait_for_copies`). Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from akv import Admit, KVCacheManager
from akv.testing.equivalence import (
    compare_beams,
    compare_generations,
    leak_report,
    make_prompt,
    run_equivalence_checks,
)
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

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.anyio,
]

DEVICE = "cuda"
ATOL = 1e-4
CONFIG = TinyLMConfig(seed=0)
BLOCK_SIZE = 4
PROMPT = make_prompt(21, vocab_size=CONFIG.vocab_size, seed=1)


@pytest.fixture(scope="module")
def model() -> TinyLM:
    return TinyLM(CONFIG, device=DEVICE)


def manager(num_blocks: int = 256) -> KVCacheManager:
    return KVCacheManager(CONFIG.kv_cache_config(num_blocks=num_blocks, block_size=BLOCK_SIZE, device=DEVICE))


async def test_greedy_matches_dense_on_cuda_including_prefix_hits(model: TinyLM) -> None:
    steps = 16
    other = make_prompt(26, vocab_size=CONFIG.vocab_size, seed=2)
    first = {"a": PROMPT, "b": other}
    async with manager() as kv:
        assert kv.storage.device.type == "cuda"
        paged = await greedy_paged(kv, model, first, max_new_tokens=steps)
        equal, diff = compare_generations(
            list(paged.values()), list(greedy_dense(model, first, max_new_tokens=steps).values())
        )
        assert equal and diff <= ATOL, diff
        follow = {"a2": [*PROMPT, *paged["a"].tokens[: steps - 1], 5, 6, 7], "c": [*other[:9], 1, 2, 3, 4, 5]}
        paged2 = await greedy_paged(kv, model, follow, max_new_tokens=steps)
        assert paged2["a2"].cached_tokens == 36 and paged2["c"].cached_tokens == 8
        dense2 = greedy_dense(model, follow, max_new_tokens=steps)
        equal, diff = compare_generations(list(paged2.values()), list(dense2.values()))
        assert equal and diff <= ATOL, diff
        ok, text = await leak_report(kv)
        assert ok, text


async def test_cow_step_returns_cuda_fences_and_the_copy_is_ordered(model: TinyLM) -> None:
    """Fork a sequence with a partial tail, append to both: one copy, fenced, and the runner sees it."""
    async with manager() as kv:
        result = await kv.step(admits=[Admit(seq_id="p", prompt=PROMPT)])
        model.forward_paged(torch.tensor(PROMPT), PagedBatch.from_step(result, DEVICE), kv.storage)
        result = await kv.step(commits={"p": len(PROMPT)}, forks=[("p", ["q"])], appends={"p": 1, "q": 2})
        assert result.copies.num_blocks == 1
        fences = result.copies.fences
        assert fences and all(isinstance(f, torch.cuda.Event) for f in fences)
        await wait_for_copies(result)
        paged = model.forward_paged(torch.tensor([1, 2]), PagedBatch.from_step(result, DEVICE), kv.storage)
        for row, token in enumerate((1, 2)):
            cache = model.new_dense_cache()
            model.forward_dense(torch.tensor(PROMPT), cache)
            dense = model.forward_dense(torch.tensor([token]), cache)[0]
            torch.testing.assert_close(paged[row], dense, atol=ATOL, rtol=0)
        await kv.step(frees=["p", "q"])
        ok, text = await leak_report(kv)
        assert ok, text


async def test_beam_search_matches_dense_on_cuda(model: TinyLM) -> None:
    async with manager() as kv:
        paged = await beam_search_paged(kv, model, PROMPT, beam_width=4, num_steps=32)
        stats = await kv.stats()
        assert stats.cow_copies > 0
        ok, text = await leak_report(kv)
        assert ok, text
    equal, diff = compare_beams(paged, beam_search_dense(model, PROMPT, beam_width=4, num_steps=32))
    assert equal and diff <= ATOL, diff


async def test_parallel_sampling_matches_independent_dense_runs_on_cuda(model: TinyLM) -> None:
    n, steps = 4, 24
    async with manager() as kv:
        paged = await sample_paged(kv, model, PROMPT, num_samples=n, max_new_tokens=steps, seed=11)
        stats = await kv.stats()
        assert stats.blocks_allocated < n * -(-(len(PROMPT) + steps) // BLOCK_SIZE)
        ok, text = await leak_report(kv)
        assert ok, text
    dense = sample_dense(model, PROMPT, num_samples=n, max_new_tokens=steps, seed=11)
    equal, diff = compare_generations(paged, dense)
    assert equal and diff <= ATOL, diff


async def test_generate_checks_all_pass_on_cuda() -> None:
    results = await run_equivalence_checks(device=DEVICE, seed=3, steps=24)
    assert all(r.passed for r in results), results
