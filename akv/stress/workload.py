"""Prompts of the stress run: shared system prompts plus user turns.

System prompts are few and of lengths chosen to hit the block boundaries: one
token, exactly one, two and three blocks, one block plus one token, and a
ragged length. A prompt is a system prompt plus a user turn that is empty
(the prompt *is* the system prompt, so a full hit must still compute its last
token), one of a few canned turns (second-level sharing), or fresh tokens.
"""

from __future__ import annotations

import random

#: Token ids are drawn from ``[0, VOCAB)``; well inside the manager's vocabulary.
VOCAB = 32_000


def system_prompt_lengths(block_size: int) -> list[int]:
    """Lengths of the shared system prompts for ``block_size``."""
    bs = block_size
    lengths = [1, bs, bs + 1, 2 * bs, 3 * bs, 4 * bs + bs // 2 - 1, 5]
    return sorted(set(lengths))


#: A fresh user turn has at most this many blocks of tokens (a canned one at most 2).
FRESH_TURN_BLOCKS = 4


def max_prompt_tokens(block_size: int) -> int:
    """Tokens of the longest prompt :class:`PromptSource` draws for ``block_size``."""
    return max(system_prompt_lengths(block_size)) + FRESH_TURN_BLOCKS * block_size


class PromptSource:
    """Draws prompts; the shared parts are fixed by the run's seed.

    Args:
        seed: Run seed (the system prompts and canned turns depend on it only).
        block_size: Tokens per block.
    """

    def __init__(self, seed: int, block_size: int) -> None:
        rng = random.Random(f"akv-stress-prompts-{seed}")
        self.block_size = block_size
        self.system_prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in system_prompt_lengths(block_size)]
        self.canned_turns = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 2 * block_size))] for _ in range(12)]

    def prompt(self, rng: random.Random) -> list[int]:
        """A new prompt: a system prompt plus an empty, canned or fresh user turn."""
        system = rng.choice(self.system_prompts)
        roll = rng.random()
        if roll < 0.2:
            turn: list[int] = []
        elif roll < 0.55:
            turn = rng.choice(self.canned_turns)
        else:
            turn = fresh_tokens(rng, rng.randint(1, FRESH_TURN_BLOCKS * self.block_size))
        return system + turn


def fresh_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids."""
    return [rng.randrange(VOCAB) for _ in range(n)]


def continuation(rng: random.Random, previous: list[int], block_size: int) -> list[int]:
    """A prompt continuing an earlier conversation: a prefix of its history plus a fresh user turn.

    At most :func:`max_prompt_tokens` long, so the workload's longest
    sequence (:func:`~akv.stress.programs.max_sequence_blocks`) still bounds
    it. Its full blocks are the earlier conversation's: cached on the device,
    demoted to the host tier since, or evicted.

    Args:
        rng: The task's random generator.
        previous: The earlier conversation's token history.
        block_size: Tokens per block.

    Returns:
        Token ids (at least one fresh token at the end).
    """
    turn = fresh_tokens(rng, rng.randint(1, block_size))
    keep = min(len(previous), max_prompt_tokens(block_size) - len(turn))
    return previous[:keep] + turn
