"""Smoke test of stress/bench_events.py at tiny sizes: it runs every case and writes its JSON report."""

from __future__ import annotations

import json
from pathlib import Path

from stress_scripts import load

bench_events = load("bench_events")


def test_bench_events_writes_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    report = bench_events.main(
        ["--batch", "8", "--prefill-blocks", "4", "--block-size", "4", "--repeats", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["events_per_step"] == 2  # 8 sequences, one block filling per 4
    assert set(report["us_per_call"]) == {
        "chain_keys_prefill",
        "stored_prefill",
        "stored_events_prefill",
        "stored_events_decode_step",
        "removed_prefill",
        "publish_0_subscribers",
        "publish_1_subscriber",
        "router_apply_step",
        "router_longest_prefix",
        "router_pick",
    }
    assert all(us > 0 for us in report["us_per_call"].values())
