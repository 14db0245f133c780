"""The random programs a stress task runs, one request each.

- ``chat``: admit a prompt, decode in bursts, verify at random points, finish.
- ``beam``: beam search: each round forks every beam k ways, advances every
  candidate with different tokens, verifies, and frees the worse half (often
  in one step: several sequences sharing blocks freed together).
- ``parallel``: parallel sampling: n > 1 forks right after the prompt, the
  samples decode concurrently (appends to a shared partial tail race), some
  finish early.
- ``abort``: admit and write part of the prefill, then free it before
  committing: its blocks must never serve a later prompt.
- ``swap`` (host tier only): swap preemption: a sequence and its forks are
  swapped out (several at once), other tasks reuse the device blocks
  meanwhile, then they are swapped back in (several at once) and verified,
  or freed while swapped out; some swaps are called from a cancelled scope.

With a host tier, a ``chat`` sometimes continues one of its task's earlier
conversations (a prefix of its history plus a new turn: its blocks are
cached, demoted to the host or gone) and is sometimes preempted by a swap
mid-decode.

Programs raise :class:`~akv.stress.client.GiveUp` when the pool stays
exhausted; the caller frees what they own (by id, so a cancelled program is
cleaned up the same way).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel

from akv.stress.client import Client
from akv.stress.seq_model import SeqModel
from akv.stress.workload import PromptSource, continuation, fresh_tokens, max_prompt_tokens

Program = Callable[[Client, PromptSource], Awaitable[None]]

#: Most decode bursts of a ``chat`` program, and the burst sizes it draws from.
CHAT_MAX_BURSTS = 12
CHAT_BURST_SIZES = (1, 1, 2, 3, 5, 8, 16)
#: Most tokens any other program appends to one sequence (``parallel``: 6 bursts of up to 4).
OTHER_MAX_APPENDED = 24


def max_sequence_blocks(block_size: int) -> int:
    """Most blocks one sequence of any program holds: the longest prompt plus the most appended tokens.

    A pool shard smaller than this cannot serve the workload: the manager
    refuses that sequence with ``RequestTooLarge``.

    Args:
        block_size: Tokens per block (``>= 1``).

    Returns:
        A block count (``>= 1``).
    """
    appended = max(CHAT_MAX_BURSTS * max(CHAT_BURST_SIZES), OTHER_MAX_APPENDED)
    return -(-(max_prompt_tokens(block_size) + appended) // block_size)


async def chat(c: Client, prompts: PromptSource) -> None:
    """One prompt, several decode bursts, random verifications, finish."""
    rng = c.rng
    namespace: object = ...  # a fresh prompt's tenant: drawn by admit
    if c.host_tier and c.conversations and rng.random() < 0.35:
        namespace, history = rng.choice(c.conversations)
        prompt = continuation(rng, history, c.block_size)
        c.metrics.continuations += 1
    else:
        prompt = prompts.prompt(rng)
    if rng.random() < 0.1:
        await c.lookup(prompt)
    seq = await c.admit(prompt, namespace=namespace)
    if rng.random() < 0.3:
        await c.verify(seq)
    for _ in range(rng.randint(1, CHAT_MAX_BURSTS)):
        if c.expired():
            break
        await c.append(seq, fresh_tokens(rng, rng.choice(CHAT_BURST_SIZES)))
        if rng.random() < 0.15:
            await c.verify(seq)
        if c.host_tier and rng.random() < 0.08:  # preempted: swapped out, resumed later
            await _preempt(c, seq)
    await c.verify(seq)
    if c.host_tier:
        c.remember(seq)
    await c.free(seq)


async def _preempt(c: Client, seq: SeqModel) -> None:
    """Swap ``seq`` out, let other tasks run, swap it back in and verify it."""
    if await c.swap_out(seq):
        await anyio.sleep(c.rng.uniform(0.0, 0.002))
        await c.swap_in(seq)
        await c.verify(seq)


async def beam(c: Client, prompts: PromptSource) -> None:
    """Beam search: fork k ways, advance each, keep the better half (random scores)."""
    rng = c.rng
    width = rng.randint(2, 3)
    expand = rng.randint(2, 3)
    beams = [await c.admit(prompts.prompt(rng))]
    for _ in range(rng.randint(1, 4)):
        if c.expired():
            break
        candidates: list[SeqModel] = []
        for b in beams:
            kids = await c.fork(b, expand - 1)
            for s in (b, *kids):
                await c.verify(s)
            candidates.extend((b, *kids))
        for s in candidates:
            await c.append(s, fresh_tokens(rng, rng.randint(1, 2)))
        rng.shuffle(candidates)  # the scores
        beams, losers = candidates[:width], candidates[width:]
        await _free_all(c, losers)
    for s in beams:
        await c.verify(s)
    await _free_all(c, beams)


async def _free_all(c: Client, seqs: list[SeqModel]) -> None:
    """Free ``seqs``: in one step (they share blocks) or one by one, at random."""
    if len(seqs) > 1 and c.rng.random() < 0.6:
        await c.free_many(seqs)
        return
    for s in seqs:
        await c.free(s)


async def parallel(c: Client, prompts: PromptSource) -> None:
    """Parallel sampling: n samples forked right after the prompt, decoded concurrently."""
    rng = c.rng
    root = await c.admit(prompts.prompt(rng))
    samples = [root, *await c.fork(root, rng.randint(1, 3))]
    for s in samples:
        await c.verify(s)
    plans = [[fresh_tokens(rng, rng.choice((1, 1, 2, 4))) for _ in range(rng.randint(1, 6))] for _ in samples]
    failures: list[BaseException] = []

    async def decode(seq: SeqModel, bursts: list[list[int]], scope: anyio.CancelScope) -> None:
        try:
            for tokens in bursts:
                if c.expired():
                    break
                await c.append(seq, tokens)
            await c.verify(seq)
            await c.free(seq)
        except Exception as exc:  # first failure ends the request; cleanup frees by id
            failures.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for seq, bursts in zip(samples, plans):
            tg.start_soon(decode, seq, bursts, tg.cancel_scope)
    if failures:
        raise failures[0]


async def abort(c: Client, prompts: PromptSource) -> None:
    """Admit, write part of the prefill, free before committing."""
    rng = c.rng
    seq = await c.admit(prompts.prompt(rng), commit=False, write_fraction=rng.choice((0.0, 0.5, 1.0)))
    c.metrics.aborts += 1
    if rng.random() < 0.5:
        await anyio.lowlevel.checkpoint()
    await c.verify(seq)  # only the cached (committed) positions are compared
    await c.free(seq)


async def swap(c: Client, prompts: PromptSource) -> None:
    """Swap preemption of a sequence and its forks: out (several at once), in again and verified, or freed swapped."""
    rng = c.rng
    seqs = [await c.admit(prompts.prompt(rng))]
    if rng.random() < 0.4:
        seqs += await c.fork(seqs[0], rng.randint(1, 2))  # blocks shared with the sequences swapped out
    for s in seqs:
        await c.append(s, fresh_tokens(rng, rng.choice((1, 2, 5))))
    for _ in range(rng.randint(1, 3)):
        if c.expired():
            break
        chosen = [s for s in seqs if rng.random() < 0.7] or seqs[:1]
        if rng.random() < 0.15:
            out = [s for s in chosen[:1] if await c.swap_out_cancelled(s)]
        else:
            out = [s for s, ok in zip(chosen, await _together(c.swap_out, chosen)) if ok]
        await anyio.sleep(rng.uniform(0.0, 0.003))  # other tasks reuse the device blocks meanwhile
        for s in [s for s in out if rng.random() < 0.15]:
            await c.free(s)  # a request cancelled while preempted: its host blocks go back
            seqs.remove(s)
            out.remove(s)
        if out and rng.random() < 0.15 and await c.swap_in_cancelled(out[0]):
            out = out[1:]
        await _together(c.swap_in, out)
        for s in seqs:
            await c.verify(s)
            await c.append(s, fresh_tokens(rng, rng.randint(1, 3)))
    for s in seqs:
        await c.verify(s)
    await _free_all(c, seqs)


async def _together(call: Callable[[SeqModel], Awaitable[object]], seqs: list[SeqModel]) -> list[object]:
    """``call(s)`` for every sequence at once, in one task group; their results in order (first error raised)."""
    results: list[object] = [None] * len(seqs)
    failures: list[BaseException] = []

    async def one(i: int, seq: SeqModel, scope: anyio.CancelScope) -> None:
        try:
            results[i] = await call(seq)
        except Exception as exc:  # the first failure ends the request; cleanup frees by id
            failures.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, seq in enumerate(seqs):
            tg.start_soon(one, i, seq, tg.cancel_scope)
    if failures:
        raise failures[0]
    return results


PROGRAMS: dict[str, Program] = {"chat": chat, "beam": beam, "parallel": parallel, "abort": abort, "swap": swap}
#: Relative frequency of each program without a host tier.
WEIGHTS: dict[str, float] = {"chat": 0.35, "beam": 0.25, "parallel": 0.25, "abort": 0.15}
#: Relative frequency of each program with a host tier (``swap`` added).
HOST_WEIGHTS: dict[str, float] = {"chat": 0.35, "beam": 0.2, "parallel": 0.2, "abort": 0.1, "swap": 0.15}
