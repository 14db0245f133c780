"""Generation drivers: greedy, beam search and parallel sampling, paged (through akv) and dense.

The paged drivers use the public :class:`~akv.manager.KVCacheManager` API the
way a serving stack does, one ``kv.step`` per scheduler step:

1. admit the prompt (``Admit``); a prefix hit shortens the tokens computed
   (``result.cached_tokens``);
2. wait for the step's copy-on-write copies (``await result.copies.wait()``;
   on CUDA the current stream waits on ``result.copies.fences``) *before*
   writing or reading any block;
3. run the model: it writes the new tokens' K/V at ``slot_mapping`` and
   attends through ``block_tables`` (:meth:`TinyLM.forward_paged`);
4. next step: ``commits`` of the tokens just written, ``forks`` for new beams
   or samples (children share every block), ``frees`` of dropped beams and
   ``appends`` of the chosen tokens; akv copies a shared partial tail block
   before it is written (copy-on-write).

The dense drivers compute the same thing with one :class:`DenseKVCache` per
sequence (a branching beam clones its parent's cache) and no akv at all.
Both share the token-choice code (:func:`select_beams`, :func:`sample_token`,
``argmax``), so a difference can only come from the KV cache path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from akv.core.step import Admit
from akv.manager import KVCacheManager
from akv.results import StepResult
from akv.testing.model import PagedBatch, TinyLM

__all__ = [
    "Beam",
    "BeamSearchResult",
    "Generation",
    "beam_search_dense",
    "beam_search_paged",
    "greedy_dense",
    "greedy_paged",
    "sample_dense",
    "sample_paged",
    "sample_token",
    "select_beams",
    "wait_for_copies",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """One generated sequence.

    Attributes:
        seq_id: Its id (in the manager, for the paged drivers).
        tokens: Generated token ids, in order.
        logits: float32 ``(len(tokens), vocab_size)`` on CPU: row ``i`` is the
            distribution ``tokens[i]`` was chosen from.
        cached_tokens: Prompt tokens served from the prefix cache (0 for dense).
    """

    seq_id: Hashable
    tokens: tuple[int, ...]
    logits: torch.Tensor
    cached_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Beam:
    """One finished beam.

    Attributes:
        tokens: Generated token ids.
        score: Sum of the tokens' log-probabilities (natural log, float64).
    """

    tokens: tuple[int, ...]
    score: float


@dataclass(frozen=True, kw_only=True, slots=True)
class BeamSearchResult:
    """Beams best first.

    Attributes:
        beams: ``beam_width`` beams, highest score first.
        seq_ids: Their sequence ids in the manager (paged), same order; empty for dense.
        cached_tokens: Prompt tokens served from the prefix cache.
    """

    beams: tuple[Beam, ...]
    seq_ids: tuple[Hashable, ...] = ()
    cached_tokens: int = 0


# ----------------------------------------------------------------- choices
def select_beams(
    scores: torch.Tensor, logprobs: torch.Tensor, beam_width: int
) -> tuple[list[int], list[int], torch.Tensor]:
    """The ``beam_width`` best continuations of the current beams.

    Candidates are every (beam, token) pair scored ``scores[beam] +
    logprobs[beam, token]``; ties go to the lower flat index (a stable sort),
    so the choice is deterministic.

    Args:
        scores: float64 ``(num_beams,)`` cumulative log-probabilities.
        logprobs: float64 ``(num_beams, vocab_size)`` next-token log-probabilities.
        beam_width: Beams to keep.

    Returns:
        ``(parents, tokens, new_scores)``: parent beam index and token of each
        kept candidate, best first, and their scores float64 ``(beam_width,)``.
    """
    vocab = logprobs.shape[1]
    candidates = (scores[:, None] + logprobs).flatten()
    best = torch.sort(candidates, descending=True, stable=True).indices[:beam_width]
    return (best // vocab).tolist(), (best % vocab).tolist(), candidates[best]


def sample_token(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0) -> int:
    """Draw one token from ``softmax(logits / temperature)`` (float64, on CPU).

    Args:
        logits: ``(vocab_size,)`` on any device.
        generator: A CPU generator (one per sample, seeded), advanced by one draw.
        temperature: Softmax temperature (> 0).
    """
    probs = torch.softmax(logits.detach().to("cpu", torch.float64) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to("cpu", torch.float64), dim=-1)


# ------------------------------------------------------------- paged plumbing
async def wait_for_copies(result: StepResult) -> None:
    """Order the model runner after ``result``'s copy-on-write copies.

    On CUDA the current stream waits on each fence (no host sync); copies
    without a fence (CPU) are awaited without blocking the event loop.
    """
    fences = result.copies.fences
    if fences:
        stream = torch.cuda.current_stream()
        for fence in fences:
            stream.wait_event(fence)
    if len(fences) != len(result.copies.tickets):
        await result.copies.wait()


async def _step(kv: KVCacheManager, **kwargs) -> StepResult:
    """``kv.step`` that raises the first rejection (tests size pools so nothing is rejected)."""
    result = await kv.step(**kwargs)
    if result.rejected:
        seq_id, error = next(iter(result.rejected.items()))
        raise RuntimeError(f"akv rejected {seq_id!r}: {error}") from error
    return result


def _forward_rows(
    kv: KVCacheManager, model: TinyLM, result: StepResult, inputs: Mapping[Hashable, Sequence[int]]
) -> dict[Hashable, torch.Tensor]:
    """Run the model over the step's rows; return each row's last-token logits (float32, CPU)."""
    flat = [int(t) for seq_id in result.seq_ids for t in inputs[seq_id]]
    if len(flat) != result.slot_mapping.numel():
        raise AssertionError(f"{len(flat)} input tokens for {result.slot_mapping.numel()} slots")
    if kv.storage is None:
        raise ValueError("the manager has no tensors (storage='none')")
    batch = PagedBatch.from_step(result, model.device)
    logits = model.forward_paged(torch.tensor(flat, dtype=torch.int64), batch, kv.storage)
    last = (result.query_start_loc[1:].to(torch.int64) - 1).to(logits.device)
    rows = logits[last].cpu()
    return {seq_id: rows[i] for i, seq_id in enumerate(result.seq_ids)}


async def _admit(
    kv: KVCacheManager, model: TinyLM, prompts: Mapping[Hashable, Sequence[int]]
) -> tuple[dict[Hashable, torch.Tensor], dict[Hashable, int], dict[Hashable, int]]:
    """Admit prompts in one step and prefill what the cache did not hold.

    Returns:
        ``(last_logits, cached_tokens, uncommitted)`` per sequence id.
    """
    result = await _step(kv, admits=[Admit(seq_id=s, prompt=[int(t) for t in p]) for s, p in prompts.items()])
    cached = dict(result.cached_tokens)
    inputs = {s: list(p)[cached[s] :] for s, p in prompts.items()}
    await wait_for_copies(result)
    last = _forward_rows(kv, model, result, inputs)
    return last, cached, {s: len(t) for s, t in inputs.items()}


async def _decode(
    kv: KVCacheManager,
    model: TinyLM,
    last: dict[Hashable, torch.Tensor],
    uncommitted: dict[Hashable, int],
    *,
    max_new_tokens: int,
    choose: Callable[[Hashable, torch.Tensor], int],
    forks: Sequence[tuple[Hashable, Sequence[Hashable]]] = (),
) -> tuple[dict[Hashable, list[int]], dict[Hashable, list[torch.Tensor]]]:
    """Token-by-token decoding of the sequences in ``last`` (one akv step per token).

    Step ``i`` commits the tokens computed at step ``i - 1``, forks (first step
    only), appends each sequence's chosen token and, unless it is the last,
    computes that token's K/V and the next logits. The last chosen tokens are
    appended (the manager's histories equal prompt + output) but not computed.
    """
    tokens: dict[Hashable, list[int]] = {s: [] for s in last}
    logits: dict[Hashable, list[torch.Tensor]] = {s: [] for s in last}
    for i in range(max_new_tokens):
        appends = {}
        for seq_id, row in last.items():
            token = choose(seq_id, row)
            tokens[seq_id].append(token)
            logits[seq_id].append(row)
            appends[seq_id] = token
        result = await _step(kv, commits=uncommitted, forks=forks if i == 0 else (), appends=appends)
        await wait_for_copies(result)
        uncommitted = {}
        if i + 1 < max_new_tokens:
            last = _forward_rows(kv, model, result, {s: [t] for s, t in appends.items()})
            uncommitted = dict.fromkeys(appends, 1)
    if uncommitted:  # max_new_tokens == 0
        await _step(kv, commits=uncommitted)
    return tokens, logits


def _stack(rows: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.zeros(0, vocab_size)


# ------------------------------------------------------------------ greedy
async def greedy_paged(
    kv: KVCacheManager,
    model: TinyLM,
    prompts: Mapping[Hashable, Sequence[int]],
    *,
    max_new_tokens: int,
    free: bool = True,
) -> dict[Hashable, Generation]:
    """Greedy decoding of a batch of prompts through the manager.

    All prompts are admitted in one step (a packed prefill of their uncached
    tokens) and decoded together, one step per token.

    Args:
        kv: A running manager with tensors matching ``model`` (``TinyLMConfig.kv_cache_config``).
        model: The model.
        prompts: New sequence id -> prompt token ids (non-empty).
        max_new_tokens: Tokens to generate per prompt.
        free: Free the sequences at the end (their committed full blocks stay
            in the prefix cache).

    Returns:
        Sequence id -> :class:`Generation` (with the prefix hit of its prompt).
    """
    last, cached, uncommitted = await _admit(kv, model, prompts)
    tokens, logits = await _decode(
        kv, model, last, uncommitted, max_new_tokens=max_new_tokens, choose=lambda _s, row: int(row.argmax())
    )
    if free:
        await kv.step(frees=list(prompts))
    vocab = model.config.vocab_size
    return {
        s: Generation(seq_id=s, tokens=tuple(tokens[s]), logits=_stack(logits[s], vocab), cached_tokens=cached[s])
        for s in prompts
    }


def greedy_dense(
    model: TinyLM, prompts: Mapping[Hashable, Sequence[int]], *, max_new_tokens: int
) -> dict[Hashable, Generation]:
    """Greedy decoding of each prompt with its own dense cache (the reference for :func:`greedy_paged`)."""
    out = {}
    for seq_id, prompt in prompts.items():
        cache = model.new_dense_cache()
        row = model.forward_dense(torch.tensor(list(prompt), dtype=torch.int64), cache)[-1].cpu()
        tokens, rows = [], []
        for i in range(max_new_tokens):
            token = int(row.argmax())
            tokens.append(token)
            rows.append(row)
            if i + 1 < max_new_tokens:
                row = model.forward_dense(torch.tensor([token]), cache)[-1].cpu()
        out[seq_id] = Generation(seq_id=seq_id, tokens=tuple(tokens), logits=_stack(rows, model.config.vocab_size))
    return out


# --------------------------------------------------------- parallel sampling
async def sample_paged(
    kv: KVCacheManager,
    model: TinyLM,
    prompt: Sequence[int],
    *,
    num_samples: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
    seq_id: Hashable = "sample",
    free: bool = True,
) -> list[Generation]:
    """Parallel sampling: one prompt, ``num_samples`` continuations sharing its blocks.

    The prompt is admitted and prefilled once as ``seq_id``; the first decode
    step forks it into ``f"{seq_id}/1" .. f"{seq_id}/{n-1}"``, which share
    every prompt block (the shared partial tail is copied on the first write).
    Sample ``i`` draws with ``torch.Generator().manual_seed(seed + i)``.

    Args:
        kv: A running manager with tensors matching ``model``.
        model: The model.
        prompt: Prompt token ids.
        num_samples: Continuations (``n``), sample 0 being ``seq_id`` itself.
        max_new_tokens: Tokens per sample.
        seed: Base seed of the per-sample generators.
        temperature: Softmax temperature.
        seq_id: Id of the prompt sequence.
        free: Free all samples at the end.

    Returns:
        The samples, sample 0 first.
    """
    last, cached, uncommitted = await _admit(kv, model, {seq_id: prompt})
    ids = [seq_id, *(f"{seq_id}/{i}" for i in range(1, num_samples))]
    gens = {s: torch.Generator().manual_seed(seed + i) for i, s in enumerate(ids)}
    start = dict.fromkeys(ids, last[seq_id])
    forks = [(seq_id, ids[1:])] if num_samples > 1 else []
    tokens, logits = await _decode(
        kv,
        model,
        start,
        uncommitted,
        max_new_tokens=max_new_tokens,
        choose=lambda s, row: sample_token(row, gens[s], temperature),
        forks=forks,
    )
    if free:
        await kv.step(frees=ids)
    vocab = model.config.vocab_size
    return [
        Generation(seq_id=s, tokens=tuple(tokens[s]), logits=_stack(logits[s], vocab), cached_tokens=cached[seq_id])
        for s in ids
    ]


def sample_dense(
    model: TinyLM,
    prompt: Sequence[int],
    *,
    num_samples: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
) -> list[Generation]:
    """``num_samples`` independent dense runs, run ``i`` seeded ``seed + i`` (reference for :func:`sample_paged`)."""
    out = []
    for i in range(num_samples):
        gen = torch.Generator().manual_seed(seed + i)
        cache = model.new_dense_cache()
        row = model.forward_dense(torch.tensor(list(prompt), dtype=torch.int64), cache)[-1].cpu()
        tokens, rows = [], []
        for step in range(max_new_tokens):
            token = sample_token(row, gen, temperature)
            tokens.append(token)
            rows.append(row)
            if step + 1 < max_new_tokens:
                row = model.forward_dense(torch.tensor([token]), cache)[-1].cpu()
        out.append(Generation(seq_id=i, tokens=tuple(tokens), logits=_stack(rows, model.config.vocab_size)))
    return out


# -------------------------------------------------------------- beam search
async def beam_search_paged(
    kv: KVCacheManager,
    model: TinyLM,
    prompt: Sequence[int],
    *,
    beam_width: int,
    num_steps: int,
    seq_id: Hashable = "beam",
    free: bool = True,
) -> BeamSearchResult:
    """Beam search through the manager: fork surviving beams, free dropped ones.

    Each step keeps the ``beam_width`` best (beam, token) continuations
    (:func:`select_beams`). A beam with ``c >= 1`` survivors keeps its id for
    the first and is forked into ``c - 1`` new sequences (they share all its
    blocks; akv copies the shared partial tail block before a write: CoW);
    a beam with no survivor is freed. All of it is one ``kv.step``.

    Args:
        kv: A running manager with tensors matching ``model``.
        model: The model.
        prompt: Prompt token ids.
        beam_width: Beams kept per step.
        num_steps: Tokens generated per beam.
        seq_id: Id of the prompt sequence; forks are ``f"{seq_id}/{k}"``.
        free: Free the final beams at the end.

    Returns:
        Final beams best first, with their sequence ids.
    """
    last, cached, uncommitted = await _admit(kv, model, {seq_id: prompt})
    ids: list[Hashable] = [seq_id]
    scores = torch.zeros(1, dtype=torch.float64)
    logprobs = _logprobs(last[seq_id])[None]
    histories: list[list[int]] = [[]]
    fresh = (f"{seq_id}/{k}" for k in itertools.count(1))
    for step in range(num_steps):
        parents, tokens, scores = select_beams(scores, logprobs, beam_width)
        new_ids: list[Hashable] = []
        forks: dict[Hashable, list[Hashable]] = {}
        for parent in parents:
            parent_id = ids[parent]
            if parent_id in new_ids:
                child = next(fresh)
                forks.setdefault(parent_id, []).append(child)
                new_ids.append(child)
            else:
                new_ids.append(parent_id)
        frees = [s for s in ids if s not in new_ids]
        commits = {s: n for s, n in uncommitted.items() if s in new_ids}
        appends = dict(zip(new_ids, tokens))
        result = await _step(kv, frees=frees, commits=commits, forks=list(forks.items()), appends=appends)
        await wait_for_copies(result)
        histories = [[*histories[p], t] for p, t in zip(parents, tokens)]
        ids = new_ids
        uncommitted = {}
        if step + 1 < num_steps:
            last = _forward_rows(kv, model, result, {s: [t] for s, t in appends.items()})
            logprobs = torch.stack([_logprobs(last[s]) for s in ids])
            uncommitted = dict.fromkeys(ids, 1)
    if uncommitted:  # num_steps == 0
        await kv.step(commits=uncommitted)
    if free:
        await kv.step(frees=ids)
    beams = tuple(Beam(tokens=tuple(h), score=float(s)) for h, s in zip(histories, scores.tolist()))
    return BeamSearchResult(beams=beams, seq_ids=tuple(ids), cached_tokens=cached[seq_id])


def beam_search_dense(model: TinyLM, prompt: Sequence[int], *, beam_width: int, num_steps: int) -> BeamSearchResult:
    """Beam search where every beam owns a dense cache; a branching beam clones its parent's.

    The reference for :func:`beam_search_paged` (same selection rule).
    """
    cache = model.new_dense_cache()
    row = model.forward_dense(torch.tensor(list(prompt), dtype=torch.int64), cache)[-1]
    caches = [cache]
    scores = torch.zeros(1, dtype=torch.float64)
    logprobs = _logprobs(row)[None]
    histories: list[list[int]] = [[]]
    for step in range(num_steps):
        parents, tokens, scores = select_beams(scores, logprobs, beam_width)
        histories = [[*histories[p], t] for p, t in zip(parents, tokens)]
        if step + 1 == num_steps:
            break
        caches = [caches[p].clone() for p in parents]
        rows = [model.forward_dense(torch.tensor([t]), c)[-1] for t, c in zip(tokens, caches)]
        logprobs = torch.stack([_logprobs(r) for r in rows])
    beams = tuple(Beam(tokens=tuple(h), score=float(s)) for h, s in zip(histories, scores.tolist()))
    return BeamSearchResult(beams=beams)
