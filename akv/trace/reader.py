"""Read and validate Mooncake request traces (JSONL, plain or gzip).

Each line of a trace is one JSON object::

    {"timestamp": 3000, "input_length": 6324, "output_length": 548, "hash_ids": [0, 415, ...]}

``timestamp`` is in milliseconds since the first request, the lengths are token
counts, and ``hash_ids`` holds one id per ``trace_block_tokens``-token prompt
block (512 in the published traces; the last block may be partial). Every
record is validated; the first malformed one raises :class:`akv.errors.TraceError`
naming the file and the 1-based line number.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from akv.errors import InvalidInput, TraceError

__all__ = [
    "MAX_HASH_ID",
    "MAX_REQUEST_TOKENS",
    "TraceRequest",
    "default_trace_path",
    "read_trace",
    "shared_trace_path",
]

#: Largest accepted hash id (ids must fit a signed 64-bit integer; the top bit
#: of the 64-bit domain is reserved for generated-token streams, see
#: :mod:`akv.trace.tokens`).
MAX_HASH_ID = (1 << 63) - 1

#: Default largest ``input_length + output_length`` of one request (tokens):
#: 1,048,576, above the longest context of today's models. A record above the
#: limit is a trace error, raised before any token is synthesized (a record of
#: ``10**12`` output tokens would otherwise ask numpy for 3.64 TiB).
MAX_REQUEST_TOKENS = 1 << 20

_GZIP_MAGIC = b"\x1f\x8b"
_DEFAULT_SLICE = "mooncake_conversation_head.jsonl.gz"
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        index: 0-based record index in the file (blank lines are not counted).
        line: 1-based line number of the record in the (decompressed) file.
        timestamp_ms: Arrival time in milliseconds since the first request.
        input_length: Prompt length in tokens (>= 1).
        output_length: Generated length in tokens (>= 1).
        hash_ids: One id per trace block of the prompt; equal ids at equal
            positions mean identical prompt tokens. ``len(hash_ids) ==
            ceil(input_length / trace_block_tokens)``.
    """

    index: int
    line: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    trace_block_tokens: int = 512,
    max_request_tokens: int = MAX_REQUEST_TOKENS,
) -> list[TraceRequest]:
    """Read and validate a Mooncake JSONL trace.

    The file is gzip-compressed if its name ends in ``.gz`` or it starts with
    the gzip magic bytes; otherwise it is plain UTF-8 JSONL. Blank lines are
    skipped (but still counted for line numbers). Timestamps need not be sorted.

    Args:
        path: Trace file.
        limit: Stop after this many records (``None``: read all). Lines after
            the limit are neither read nor validated.
        trace_block_tokens: Tokens per hash id in the trace (512 for Mooncake).
        max_request_tokens: Largest accepted ``input_length + output_length``
            of one record, in tokens (default :data:`MAX_REQUEST_TOKENS`).

    Returns:
        The records in file order, ``index`` 0, 1, 2, ...

    Raises:
        TraceError: The file is missing or unreadable (``line`` is ``None``),
            or a record is malformed (``line`` is its 1-based line number): not
            a JSON object, a missing key, a non-integer value (booleans and
            floats are rejected), a negative timestamp, ``input_length < 1``,
            ``output_length < 1``, ``input_length + output_length >
            max_request_tokens``, a hash id outside ``[0, 2**63)``, or a
            ``hash_ids`` list whose length is not
            ``ceil(input_length / trace_block_tokens)``. A truncated last line
            (no trailing newline, invalid JSON) is reported as such.
        InvalidInput: ``limit`` is negative, or ``trace_block_tokens`` or
            ``max_request_tokens`` is below 1.
    """
    if limit is not None and (_not_int(limit) or limit < 0):
        raise InvalidInput(f"limit must be None or an int >= 0, got {limit!r}")
    if _not_int(trace_block_tokens) or trace_block_tokens < 1:
        raise InvalidInput(f"trace_block_tokens must be an int >= 1, got {trace_block_tokens!r}")
    if _not_int(max_request_tokens) or max_request_tokens < 1:
        raise InvalidInput(f"max_request_tokens must be an int >= 1, got {max_request_tokens!r}")
    out: list[TraceRequest] = []
    try:
        with open(path, "rb") as raw_file:
            gz = str(path).endswith(".gz") or raw_file.read(2) == _GZIP_MAGIC
            raw_file.seek(0)
            stream: IO[bytes] = gzip.GzipFile(fileobj=raw_file, mode="rb") if gz else raw_file
            with stream:
                for line_no, raw in enumerate(stream, start=1):
                    if limit is not None and len(out) >= limit:
                        break
                    if not raw.strip():
                        continue
                    obj = _parse(path, line_no, raw)
                    request = _validate(path, line_no, len(out), obj, trace_block_tokens)
                    if request.input_length + request.output_length > max_request_tokens:
                        raise TraceError(
                            path,
                            line_no,
                            f"input_length + output_length = {request.input_length + request.output_length:,} "
                            f"tokens exceeds the limit of {max_request_tokens:,} per request "
                            "(max_request_tokens; akv replay --max-request-tokens)",
                        )
                    out.append(request)
    except TraceError:
        raise
    except FileNotFoundError as e:
        raise TraceError(path, None, "file not found") from e
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(path, None, f"cannot read file: {e}") from e
    return out


def default_trace_path() -> Path:
    """Path of the trace slice shipped with the package.

    Returns:
        ``akv/data/mooncake_conversation_head.jsonl.gz``: the first 3,000
        requests of the Mooncake conversation trace, gzip-compressed (see
        ``akv/data/README.md``).
    """
    return Path(__file__).resolve().parent.parent / "data" / _DEFAULT_SLICE


def shared_trace_path(name: str) -> Path | None:
    """Locate a full trace in the shared traces folder, if present.

    Looks for ``../shared/traces/<name>`` relative to the current working
    directory, then relative to the repository root (the parent of the ``akv``
    package directory).

    Args:
        name: File name, e.g. ``"mooncake_conversation.jsonl"``.

    Returns:
        The first existing candidate path, or ``None`` if neither exists.
    """
    repo_root = Path(__file__).resolve().parent.parent.parent
    for base in (Path.cwd(), repo_root):
        candidate = base.parent / "shared" / "traces" / name
        if candidate.is_file():
            return candidate
    return None


# --------------------------------------------------------------------------- #
# internals


def _not_int(v: object) -> bool:
    return type(v) is not int


def _parse(path: str | Path, line_no: int, raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        if not raw.endswith(b"\n"):
            reason = f"truncated last line (no trailing newline): invalid JSON: {e}"
        else:
            reason = f"invalid JSON: {e}"
        raise TraceError(path, line_no, reason) from None


def _validate(path: str | Path, line_no: int, index: int, obj: object, tbt: int) -> TraceRequest:
    if type(obj) is not dict:
        raise TraceError(path, line_no, f"record is not a JSON object (got {type(obj).__name__})")
    for key in _KEYS:
        if key not in obj:
            raise TraceError(path, line_no, f"missing key {key!r}")
    ts = obj["timestamp"]
    n_in = obj["input_length"]
    n_out = obj["output_length"]
    ids = obj["hash_ids"]
    for key, v in (("timestamp", ts), ("input_length", n_in), ("output_length", n_out)):
        if _not_int(v):
            raise TraceError(path, line_no, f"{key} must be an integer, got {v!r}")
    if ts < 0:
        raise TraceError(path, line_no, f"timestamp must be >= 0, got {ts}")
    if n_in < 1:
        raise TraceError(path, line_no, f"input_length must be >= 1, got {n_in}")
    if n_out < 1:
        raise TraceError(path, line_no, f"output_length must be >= 1, got {n_out}")
    if type(ids) is not list:
        raise TraceError(path, line_no, f"hash_ids must be a list of integers, got {ids!r}")
    if ids and not (all(type(h) is int for h in ids) and min(ids) >= 0 and max(ids) <= MAX_HASH_ID):
        for h in ids:
            if _not_int(h):
                raise TraceError(path, line_no, f"hash_ids must hold integers, got {h!r}")
            if h < 0 or h > MAX_HASH_ID:
                raise TraceError(path, line_no, f"hash id {h} outside [0, 2**63)")
    want = -(-n_in // tbt)
    if len(ids) != want:
        raise TraceError(
            path,
            line_no,
            f"hash_ids has {len(ids)} ids but input_length {n_in} needs ceil({n_in}/{tbt}) = {want}",
        )
    return TraceRequest(
        index=index,
        line=line_no,
        timestamp_ms=ts,
        input_length=n_in,
        output_length=n_out,
        hash_ids=tuple(ids),
    )
