"""OpenTelemetry spans: one request's spans form a tree across the actors (SDK in-memory exporter)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from akv import KVCacheManager
from tests.eviction_passes import EvictionPasses


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test of this module on asyncio and on trio."""
    return request.param


@pytest.fixture
def spans():
    """A local TracerProvider (the global one is never touched) and its in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def children(finished, parent) -> list:
    return [s for s in finished if s.parent is not None and s.parent.span_id == parent.context.span_id]


@pytest.mark.anyio
@pytest.mark.parametrize("num_shards", [1, 2])
async def test_public_calls_form_a_span_tree_across_actors(tiny_config, spans, num_shards: int) -> None:
    provider, exporter = spans
    async with KVCacheManager(tiny_config(num_blocks=16, num_shards=num_shards), tracer_provider=provider) as kv:
        prompt = list(range(1, 11))
        await kv.add_sequence("a", prompt)
        await kv.commit("a", 10)
        await kv.fork("a", ["b"])
        await kv.append("b", [5])  # shared partial tail: copy-on-write
        await kv.wait_copies()
    finished = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)

    (add,) = by_name["akv.add_sequence"]
    assert add.parent is None
    assert dict(add.attributes) == {"akv.seq_id": "a", "akv.cached_tokens": 0}
    (step,) = children(finished, add)
    assert step.name == "akv.step"
    assert step.context.trace_id == add.context.trace_id
    assert step.attributes["akv.admits"] == 1 and step.attributes["akv.scheduled"] == 1
    (shard_step,) = children(finished, step)  # started inside the shard actor, in the caller's context
    assert shard_step.name == "akv.shard_step"
    assert shard_step.attributes["akv.blocks_allocated"] == 3

    (append,) = by_name["akv.append"]
    (step,) = children(finished, append)
    assert step.attributes["akv.copy_blocks"] == 1
    assert step.attributes["akv.copy_bytes"] == kv.config.bytes_per_block
    (shard_step,) = children(finished, step)
    (copy,) = children(finished, shard_step)
    assert copy.name == "akv.copy_blocks"
    assert (copy.attributes["akv.blocks"], copy.attributes["akv.bytes"]) == (1, kv.config.bytes_per_block)
    assert len({s.context.trace_id for s in finished}) == 4  # add, commit, fork, append: one trace each
    for name in ("akv.commit", "akv.fork"):
        (span,) = by_name[name]
        assert [c.name for c in children(finished, span)] == ["akv.step"]


@pytest.mark.anyio
async def test_eviction_loop_batches_are_spans(tiny_config, spans, monkeypatch) -> None:
    provider, exporter = spans
    passes = EvictionPasses(monkeypatch)
    cfg = tiny_config(num_blocks=8, low_watermark=0.5, high_watermark=0.75)
    async with KVCacheManager(cfg, tracer_provider=provider) as kv:
        for i in range(3):  # 2 blocks each, published, then cached once freed
            prompt = [10 * i + j + 1 for j in range(8)]
            await kv.add_sequence(f"s{i}", prompt)
            await kv.commit(f"s{i}", 8)
            await kv.free(f"s{i}")
        await kv.add_sequence("big", list(range(100, 109)))  # pushes usage above the low watermark
        # The loop evicts every cached block (the high mark of 6 free is out of reach while big holds 3).
        await passes.wait_for(lambda done: any(p.free_blocks == 8 - 3 for p in done))
        stats = await kv.stats()
        assert (stats.free, stats.cached, stats.blocks_evicted) == (5, 0, 6)
    # A pass that found nothing left to evict is a span too (akv.blocks == 0).
    batches = [s for s in exporter.get_finished_spans() if s.name == "akv.evict_batch" and s.attributes["akv.blocks"]]
    assert stats.eviction_loop_batches > 0
    assert len(batches) == stats.eviction_loop_batches
    assert all(s.parent is None for s in batches)
    assert sum(s.attributes["akv.blocks"] for s in batches) == stats.eviction_loop_blocks


def test_spans_are_nearly_free_without_a_provider() -> None:
    from opentelemetry import trace

    from akv.obs.tracing import AkvTracer

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider is set in this process")
    tracer = AkvTracer()
    assert not tracer.enabled and tracer.context() is None
    with tracer.span("akv.step") as span:
        assert not span.is_recording()
    assert AkvTracer(TracerProvider()).enabled
