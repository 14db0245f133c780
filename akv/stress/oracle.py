"""The K/V oracle: every value the harness writes is a pure function of the token history.

A token's K/V in layer ``l`` is a float32 vector derived from a 64-bit rolling
hash of the sequence's tokens up to and including that token, salted with the
layer, K or V, and the element index. Any reader that knows a sequence's token
history can therefore recompute what its block table must return, whichever
sequence wrote a shared (prefix-cached or forked) block first.

Values are ``(top 24 bits of a splitmix64 mix) / 2**24 - 0.5``, exactly
representable in float32, so writes and reads compare bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio
_SEED_HASH = 0x243F6A8885A308D3  # hash of the empty history


def splitmix64(x: int) -> int:
    """splitmix64 finalizer on a Python int (Steele, Lea, Flood, OOPSLA 2014)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def splitmix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wraps modulo 2**64, no warnings on arrays)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def extend_hashes(hashes: list[int], tokens: Iterable[int]) -> None:
    """Append the rolling hash of each new token's history to ``hashes`` (in place).

    ``hashes[p]`` identifies the exact history ``tokens[0..p]``: position and
    every earlier token are folded in. O(1) per token.
    """
    h = hashes[-1] if hashes else _SEED_HASH
    for token in tokens:
        h = splitmix64((h ^ ((int(token) + 1) * GOLDEN & MASK64)) + GOLDEN & MASK64)
        hashes.append(h)


def history_hashes(tokens: Iterable[int]) -> list[int]:
    """Rolling hashes of every prefix of ``tokens`` (one per token)."""
    out: list[int] = []
    extend_hashes(out, tokens)
    return out


class KVOracle:
    """Computes the expected K/V of token histories for one model shape.

    Args:
        num_layers: Attention layers.
        num_kv_heads: K/V heads per layer.
        head_dim: Elements per head.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        width = num_kv_heads * head_dim
        # (num_layers, 2, num_kv_heads * head_dim) salts, K then V
        idx = np.arange(num_layers * 2 * width, dtype=np.uint64) + np.uint64(1)
        self._salts = splitmix64_array(idx * np.uint64(GOLDEN)).reshape(num_layers, 2, width)

    def values(self, hashes: list[int] | np.ndarray) -> torch.Tensor:
        """Expected K and V of the tokens whose history hashes are ``hashes``.

        Args:
            hashes: ``(n,)`` rolling hashes (:func:`history_hashes`).

        Returns:
            float32 ``(num_layers, 2, n, num_kv_heads, head_dim)``, K then V.
        """
        h = np.asarray(hashes, dtype=np.uint64)
        # (n, 1, 1, 1) ^ (1, L, 2, H*D) -> (n, L, 2, H*D)
        mixed = splitmix64_array(h[:, None, None, None] ^ self._salts[None])
        vals = (mixed >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
        out = torch.from_numpy(np.ascontiguousarray(vals.transpose(1, 2, 0, 3)))
        return out.view(self.num_layers, 2, len(h), self.num_kv_heads, self.head_dim)
