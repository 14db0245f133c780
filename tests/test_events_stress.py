"""Cache events under 256 concurrent sequences: consecutive numbers, removals only of stored keys."""

from __future__ import annotations

import pytest

from akv.events.types import BlockRemoved, EventBatch
from akv.stress.event_check import EventCheck
from akv.stress.metrics import Metrics
from akv.stress.options import StressOptions
from akv.stress.runner import run_manager


@pytest.mark.anyio
@pytest.mark.parametrize("shards", [1, 2])
async def test_256_concurrent_sequences_with_a_subscriber(shards: int) -> None:
    options = StressOptions(seed=3, sequences=256, operations=768, duration_s=900.0, shards=shards, events=True)
    out = await run_manager(options, Metrics(), tasks=options.sequences, duration_s=options.duration_s)
    assert out.invariant_violations == 0, out.errors
    assert out.clean, out.errors
    assert out.event_batches > 100  # the subscriber saw the run (evictions included: a tight pool)


class _NoManager:
    def subscribe_events(self, since, buffer):
        return None


def test_event_check_flags_a_skipped_number_and_a_removal_of_an_unstored_key() -> None:
    check = EventCheck(_NoManager())
    key = bytes(16)
    check.apply(EventBatch(seq=2, ts=0.0, events=(BlockRemoved(block_hashes=[key], medium="device"),)))
    assert len(check.errors) == 2
    assert "batch 2 after batch 0" in check.errors[0] and "removes" in check.errors[1]
