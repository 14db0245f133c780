"""Shared fixtures: the anyio backend and a small-config factory."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from akv.config import KVCacheConfig


@pytest.fixture
def anyio_backend() -> str:
    """Run ``@pytest.mark.anyio`` tests on asyncio only (the backend akv is built for)."""
    return "asyncio"


@pytest.fixture
def tiny_config() -> Callable[..., KVCacheConfig]:
    """Factory of small configs with real CPU tensors (tiny model, block_size 4, invariants checked).

    The eviction loop is off by default (``low_watermark=0``: the free fraction
    is never below 0), so eviction only happens on demand and tests can assert
    exact eviction order; pass watermarks to turn it on.
    """

    def make(**overrides) -> KVCacheConfig:
        fields = {
            "num_blocks": 16,
            "block_size": 4,
            "vocab_size": 1000,
            "debug_invariants": True,
            "low_watermark": 0.0,
            "high_watermark": 0.0,
        }
        fields.update(overrides)
        return KVCacheConfig(**fields)

    return make
