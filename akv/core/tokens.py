"""Validation of token ids coming from callers."""

from __future__ import annotations

import operator
import struct

import numpy as np

from akv.core.ids import safe_repr
from akv.errors import InvalidTokens


def _from_int_list(tokens: list | tuple, what: str) -> np.ndarray | None:
    """int32 array of a list of ints in one C pass, or None to take the checking path.

    ``struct.Struct("=<n>i").pack_into`` (writing into the new array) takes exactly the objects with ``__index__``
    (ints, bools, numpy and torch integer scalars) and raises on floats,
    strings, None and values outside int32 (which no vocabulary reaches), as
    ``array.array("i", ...)`` does. Bools (an int subclass) can only have
    become 0 or 1, so only those positions are looked at again. Measured on a
    13.7 k-token prompt (timeit, best of 7): 72 us, against 179 us for
    ``array.array("i")`` and 177 us for ``np.array(tokens, dtype=np.int32)``
    (100 k tokens: 540 against 1,310 us).
    """
    arr = np.empty(len(tokens), dtype=np.int32)
    try:
        struct.Struct(f"={len(tokens)}i").pack_into(arr, 0, *tokens)
    except Exception:  # anything an element's __index__ raises, or an overflow: the checking path words the error
        return None
    for i in np.flatnonzero(arr <= 1).tolist():
        if isinstance(tokens[i], (bool, np.bool_)):
            raise InvalidTokens(f"{what}: token {i} is {tokens[i]!r} (bool), not an int")
    return arr


def as_token_array(tokens, vocab_size: int, *, what: str = "tokens") -> np.ndarray:
    """Validate token ids and return them as a fresh int32 array.

    Args:
        tokens: 1-D integer ids: a list or tuple of ints (or of integer
            scalars with ``__index__``, such as numpy's and torch's; not
            bools), a numpy integer array (not a masked array), or a torch
            integer tensor (anything with ``.numpy()``).
        vocab_size: Ids must lie in ``[0, vocab_size)``.
        what: Name used in error messages (e.g. ``"prompt of 'req-1'"``).

    Returns:
        int32 array of shape ``(n,)``, ``n >= 1``, owned by the caller of this
        function (later changes to ``tokens`` do not affect it).

    Raises:
        InvalidTokens: Empty, not 1-D, not integers (floats, bools, strings,
            None), out of range, or a numpy masked array; the message names
            the first bad position.
    """
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise InvalidTokens(f"{what}: expected a sequence of int token ids, got {type(tokens).__name__}")
    if hasattr(tokens, "detach") and hasattr(tokens, "numpy"):
        try:
            tokens = tokens.detach().cpu().numpy()
        except (TypeError, RuntimeError) as exc:  # e.g. bfloat16, which numpy lacks
            raise InvalidTokens(
                f"{what}: token ids must be integers, got a tensor of dtype {tokens.dtype} ({exc})"
            ) from None
    if isinstance(tokens, np.ma.MaskedArray):  # its data under the mask is not the caller's tokens
        raise InvalidTokens(f"{what}: a numpy masked array is not accepted; pass the ids to use as a plain array")
    fresh = False  # arr is an int32 array no caller can reach
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        arr = None
        if isinstance(tokens, (list, tuple)):
            arr = _from_int_list(tokens, what)
            fresh = arr is not None
        if arr is None and isinstance(tokens, (list, tuple)):
            for i, t in enumerate(tokens):  # the first bad element, in order
                try:
                    if isinstance(t, (bool, np.bool_)):
                        raise TypeError
                    v = operator.index(t)
                except Exception:  # whatever its __index__ raises
                    raise InvalidTokens(
                        f"{what}: token {i} is {safe_repr(t)} ({type(t).__name__}), not an int"
                    ) from None
                if not 0 <= v < vocab_size:
                    raise InvalidTokens(f"{what}: token {i} is {v}, outside [0, {vocab_size})")
        if arr is None:
            try:
                arr = np.asarray(tokens)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidTokens(f"{what}: not an array of token ids ({exc})") from None
            except Exception as exc:  # whatever else the caller's object raises while converted
                raise InvalidTokens(
                    f"{what}: not an array of token ids (converting it raised {type(exc).__name__})"
                ) from None
    if arr.ndim == 0 and arr.dtype.kind in "iu":
        arr = arr.reshape(1)  # one token as a numpy or torch integer scalar
    if arr.ndim != 1:
        raise InvalidTokens(
            f"{what}: expected a 1-D sequence of int token ids, got {type(tokens).__name__} of shape {arr.shape}"
        )
    if arr.size == 0:
        raise InvalidTokens(f"{what}: empty; at least one token is required")
    if arr.dtype.kind not in "iu":
        raise InvalidTokens(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = int(np.flatnonzero((arr < 0) | (arr >= vocab_size))[0])
        raise InvalidTokens(f"{what}: token {bad} is {int(arr[bad])}, outside [0, {vocab_size})")
    return arr if fresh else np.array(arr, dtype=np.int32)
