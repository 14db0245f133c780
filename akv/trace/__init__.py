"""Request traces: reading Mooncake JSONL, synthesizing tokens, reference hit counts.

Pure Python + numpy (no torch, no asyncio).
"""

from __future__ import annotations

from akv.trace.expected_hits import expected_cached_tokens, hit_rate
from akv.trace.reader import (
    MAX_HASH_ID,
    MAX_REQUEST_TOKENS,
    TraceRequest,
    default_trace_path,
    read_trace,
    shared_trace_path,
)
from akv.trace.tokens import mix64, synthesize_output, synthesize_prompt

__all__ = [
    "MAX_HASH_ID",
    "MAX_REQUEST_TOKENS",
    "TraceRequest",
    "default_trace_path",
    "expected_cached_tokens",
    "hit_rate",
    "mix64",
    "read_trace",
    "shared_trace_path",
    "synthesize_output",
    "synthesize_prompt",
]
