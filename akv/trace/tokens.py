"""Deterministic synthetic token ids for trace replay.

Mooncake traces publish one hash id per 512-token prompt block but no tokens.
A replayer needs real token ids whose sharing matches the trace exactly: equal
``(hash_id, offset)`` must give equal tokens in every request, and different
hash ids must give (with overwhelming probability) different tokens, so that a
prefix cache over tokens sees exactly the sharing the trace describes.

Tokens are drawn from a well-mixed 64-bit hash (the splitmix64 finalizer) of
``(hash_id, offset)``; never a linear formula, which would make unrelated blocks
collide or line up by accident.

Domains of the inner key (before the offset is added):

- prompt block: ``mix64(hash_id ^ seed_key)`` with ``hash_id < 2**63``;
- generated tokens of request ``i``: ``mix64((i | 2**63) ^ seed_key)``.

The top bit separates the two, and ``mix64`` is a bijection, so a prompt block
and an output stream never share a key.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from akv.errors import InvalidInput

__all__ = ["mix64", "synthesize_output", "synthesize_prompt"]

_U64_MASK = (1 << 64) - 1
_OUTPUT_DOMAIN = 1 << 63
#: splitmix64 increment (2**64 / golden ratio), used to derive the seed key.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_CHUNK_TOKENS = 8192


def mix64(x: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """Splitmix64 finalizer, vectorized, with wrapping uint64 arithmetic.

    From Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators" (OOPSLA 2014), constants as in ``java.util.SplittableRandom``::

        z = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
        z = (z ^ (z >> 27)) * 0x94d049bb133111eb
        return z ^ (z >> 31)

    It is a bijection on 64-bit integers with full avalanche.

    Args:
        x: Array (any shape) of values convertible to ``uint64``.

    Returns:
        A new ``uint64`` array of the same shape as ``x``.
    """
    z = np.array(x, dtype=np.uint64, copy=True)
    with np.errstate(over="ignore"):  # 0-d inputs take the scalar path, which warns
        _mix64_inplace(z, np.empty_like(z))
    return z


def _mix64_inplace(z: npt.NDArray[np.uint64], tmp: npt.NDArray[np.uint64]) -> None:
    """:func:`mix64` in place on ``z``, using ``tmp`` (same shape) as scratch."""
    np.right_shift(z, _S30, out=tmp)
    z ^= tmp
    z *= _C1
    np.right_shift(z, _S27, out=tmp)
    z ^= tmp
    z *= _C2
    np.right_shift(z, _S31, out=tmp)
    z ^= tmp


def _mix64_int(x: int) -> int:
    """Scalar :func:`mix64` on a Python int (faster than numpy for one value)."""
    x &= _U64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64_MASK
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=64)
def _seed_key(seed: int) -> int:
    if type(seed) is not int:
        raise InvalidInput(f"seed must be an int, got {seed!r}")
    return _mix64_int(seed + _GOLDEN_GAMMA)


def _check_vocab(vocab_size: int) -> None:
    if type(vocab_size) is not int or not 1 <= vocab_size <= 2**31:
        raise InvalidInput(f"vocab_size must be an int in [1, 2**31], got {vocab_size!r}")


def _stream(keys: npt.NDArray[np.uint64], length: int, vocab_size: int) -> npt.NDArray[np.int32]:
    """Tokens ``mix64(key + o) % vocab`` for each key and offset ``o < length``, flattened.

    Works in chunks of about ``_CHUNK_TOKENS`` tokens so the scratch arrays stay
    in cache (several times faster than one pass over a 100k-token prompt).
    """
    out = np.empty(keys.shape[0] * length, dtype=np.int32)
    if out.size == 0:
        return out
    offsets = np.arange(length, dtype=np.uint64)
    vocab = np.uint64(vocab_size)
    step = max(1, _CHUNK_TOKENS // length)
    z_buf = np.empty(min(keys.shape[0], step) * length, dtype=np.uint64)
    tmp_buf = np.empty_like(z_buf)
    for start in range(0, keys.shape[0], step):
        k = keys[start : start + step]
        n = k.shape[0] * length
        z = z_buf[:n]
        np.add(k[:, None], offsets[None, :], out=z.reshape(k.shape[0], length))
        _mix64_inplace(z, tmp_buf[:n])
        np.remainder(z, vocab, out=z)
        out[start * length : start * length + n] = z
    return out


def synthesize_prompt(
    hash_ids: Sequence[int] | npt.ArrayLike,
    input_length: int,
    *,
    vocab_size: int = 128_256,
    trace_block_tokens: int = 512,
    seed: int = 0,
) -> npt.NDArray[np.int32]:
    """Synthesize the prompt tokens of a trace request.

    Token at offset ``o`` of trace block ``j`` (prompt position
    ``j * trace_block_tokens + o``)::

        mix64(mix64(hash_ids[j] ^ seed_key) + o) % vocab_size

    with ``seed_key = mix64(seed + 0x9e3779b97f4a7c15)`` (wrapping uint64
    arithmetic; :func:`mix64` is the splitmix64 finalizer). Equal
    ``(hash_id, offset)`` give equal tokens in any request, so requests that
    share leading hash ids share leading tokens. A partial last block of
    ``k`` tokens uses offsets ``0..k-1`` of its hash id. Fully vectorized.

    Args:
        hash_ids: Trace block ids, each in ``[0, 2**63)``; at least
            ``ceil(input_length / trace_block_tokens)`` of them (extra ids are
            ignored, so a prefix of a request can be synthesized).
        input_length: Prompt length in tokens (>= 0).
        vocab_size: Token ids are in ``[0, vocab_size)``; at most ``2**31``.
        trace_block_tokens: Tokens per hash id (512 for Mooncake).
        seed: Selects an independent token universe (any int; used mod 2**64).

    Returns:
        ``int32`` array of shape ``(input_length,)``.

    Raises:
        InvalidInput: Too few hash ids, a hash id outside ``[0, 2**63)``, a
            negative ``input_length``, or a bad ``vocab_size`` /
            ``trace_block_tokens`` / ``seed``.
    """
    _check_vocab(vocab_size)
    if type(trace_block_tokens) is not int or trace_block_tokens < 1:
        raise InvalidInput(f"trace_block_tokens must be an int >= 1, got {trace_block_tokens!r}")
    if type(input_length) is not int or input_length < 0:
        raise InvalidInput(f"input_length must be an int >= 0, got {input_length!r}")
    key = np.uint64(_seed_key(seed))
    n_blocks = -(-input_length // trace_block_tokens)
    ids = np.asarray(hash_ids)
    if ids.ndim != 1 or ids.shape[0] < n_blocks:
        raise InvalidInput(
            f"need {n_blocks} hash ids for input_length {input_length} "
            f"(trace_block_tokens {trace_block_tokens}), got shape {ids.shape}"
        )
    ids = ids[:n_blocks]
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= _OUTPUT_DOMAIN):
        raise InvalidInput("hash ids must be integers in [0, 2**63)")
    keys = mix64(ids.astype(np.uint64) ^ key)
    return _stream(keys, trace_block_tokens, vocab_size)[:input_length]


def synthesize_output(
    request_index: int,
    output_length: int,
    *,
    vocab_size: int = 128_256,
    seed: int = 0,
) -> npt.NDArray[np.int32]:
    """Synthesize deterministic generated tokens for a trace request.

    Token at generated position ``p``::

        mix64(mix64((request_index | 2**63) ^ seed_key) + p) % vocab_size

    The top bit keeps these keys disjoint from prompt blocks (hash ids are
    below ``2**63``), so generated tokens never coincide with a prompt block's
    stream by construction. Fully vectorized.

    Args:
        request_index: Index of the request in its trace, in ``[0, 2**63)``.
        output_length: Number of generated tokens (>= 0).
        vocab_size: Token ids are in ``[0, vocab_size)``; at most ``2**31``.
        seed: Selects an independent token universe (any int; used mod 2**64).

    Returns:
        ``int32`` array of shape ``(output_length,)``.

    Raises:
        InvalidInput: ``request_index`` outside ``[0, 2**63)``, a negative
            ``output_length``, or a bad ``vocab_size`` / ``seed``.
    """
    _check_vocab(vocab_size)
    if type(request_index) is not int or not 0 <= request_index < _OUTPUT_DOMAIN:
        raise InvalidInput(f"request_index must be an int in [0, 2**63), got {request_index!r}")
    if type(output_length) is not int or output_length < 0:
        raise InvalidInput(f"output_length must be an int >= 0, got {output_length!r}")
    keys = np.array([_mix64_int((request_index | _OUTPUT_DOMAIN) ^ _seed_key(seed))], dtype=np.uint64)
    return _stream(keys, output_length, vocab_size)
