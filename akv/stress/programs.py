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

Programs raise :class:`~akv.stress.client.GiveUp` when the pool stays
exhausted; the caller frees what they own (by id, so a cancelled program is
cleaned up the same way).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel

from akv.stress.client import Client, SeqModel
from akv.stress.workload import PromptSource, fresh_tokens, max_prompt_tokens

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
    prompt = prompts.prompt(rng)
    if rng.random() < 0.1:
        await c.lookup(prompt)
    seq = await c.admit(prompt)
    if rng.random() < 0.3:
        await c.verify(seq)
    for _ in range(rng.randint(1, CHAT_MAX_BURSTS)):
        if c.expired():
            break
        await c.append(seq, fresh_tokens(rng, rng.choice(CHAT_BURST_SIZES)))
        if rng.random() < 0.15:
            await c.verify(seq)
    await c.verify(seq)
    await c.free(seq)


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


PROGRAMS: dict[str, Program] = {"chat": chat, "beam": beam, "parallel": parallel, "abort": abort}
#: Relative frequency of each program.
WEIGHTS: dict[str, float] = {"chat": 0.35, "beam": 0.25, "parallel": 0.25, "abort": 0.15}
