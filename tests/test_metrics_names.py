"""Prometheus names follow its conventions and docs/metrics.md lists exactly the metrics a manager exports."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from akv import KVCacheConfig, KVCacheManager

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
#: The unit column of docs/metrics.md -> the word the metric's name must hold.
UNIT_WORDS = {
    "blocks": "blocks",
    "batches": "batches",
    "tokens": "tokens",
    "sequences": "sequences",
    "refusals": "refusals",
    "messages": "messages",
    "seconds": "seconds",
    "bytes": "bytes",
    "ratio 0-1": "ratio",
}


def _documented() -> dict[str, tuple[str, str]]:
    """Name -> (type, unit) of each row of the table in docs/metrics.md."""
    rows = re.findall(r"^\| `(akv_\w+)` \| (\w+) \|[^|]*\| ([^|]+) \|", DOC.read_text(), flags=re.M)
    return {name: (kind, unit.strip()) for name, kind, unit in rows}


def _exported() -> dict[str, str]:
    """Sample family name (counters with ``_total``) -> type, of a fresh manager's registry."""

    async def run() -> dict[str, str]:
        async with KVCacheManager(KVCacheConfig(num_blocks=16, block_size=4)) as kv:
            families = list(kv.metrics_registry.collect())
        return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in families}

    return anyio.run(run)


def test_docs_list_exactly_the_exported_metrics() -> None:
    documented = _documented()
    assert {name: kind for name, (kind, _) in documented.items()} == _exported()


@pytest.mark.parametrize("name", sorted(_documented()))
def test_metric_name_says_its_unit(name: str) -> None:
    kind, unit = _documented()[name]
    assert UNIT_WORDS[unit] in name.removeprefix("akv_").split("_")
    assert name.endswith("_total") == (kind == "counter")


def test_blocks_evicted_counter_is_named_for_blocks() -> None:
    assert "akv_blocks_evicted_total" in _exported()
