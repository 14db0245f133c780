"""Reading a JSON-lines log written by ``--log-json``: the data behind ``akv inspect``.

Tolerates what a crashed run leaves: a truncated (or otherwise unparsable)
line is counted and skipped, never fatal.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

#: Gap between two ``eviction.batch`` events that ends a burst (seconds).
BURST_GAP_S = 1.0


@dataclass(kw_only=True, slots=True)
class LogFile:
    """The events of one log and the lines that could not be read.

    Attributes:
        events: Parsed events (dicts), in file order.
        bad_lines: 1-based numbers of lines that are not a JSON object with
            a string ``event`` (typically the last line of a crashed run).
    """

    events: list[dict] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)


def read_log(path: Path | str) -> LogFile:
    """Parse a JSON-lines log, gzipped or not; skip (and list) lines that are not complete JSON objects.

    Args:
        path: The log (``.jsonl``, or gzip data such as ``.jsonl.gz``, told by its first bytes).

    Returns:
        The events and the numbers of the unreadable lines.

    Raises:
        OSError: The file cannot be read, or is corrupt gzip data.
    """
    out = LogFile()
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                out.bad_lines.append(number)
                continue
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                out.events.append(event)
            else:
                out.bad_lines.append(number)
    return out


def _time(event: dict) -> float | None:
    ts = event.get("timestamp")
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def summarize(log: LogFile) -> dict[str, Any]:
    """Counts by event and by level, the errors (with their sequences), the canonical lines.

    Returns:
        ``{"events": {name: n}, "levels": {level: n}, "errors": [event...],
        "bad_lines": [...], "runs": [replay.finished / stress.finished events]}``.
    """
    names = Counter(e["event"] for e in log.events)
    levels = Counter(str(e.get("level", e.get("log_level", "?"))) for e in log.events)
    errors = [e for e in log.events if e.get("level", e.get("log_level")) in ("error", "critical")]
    runs = [e for e in log.events if e["event"] in ("replay.finished", "stress.finished")]
    return {
        "events": dict(names.most_common()),
        "levels": dict(levels.most_common()),
        "errors": errors,
        "bad_lines": list(log.bad_lines),
        "runs": runs,
    }


def eviction_bursts(log: LogFile, *, gap_s: float = BURST_GAP_S) -> list[dict[str, Any]]:
    """Group ``eviction.batch`` events closer than ``gap_s`` seconds into bursts.

    Returns:
        One dict per burst: ``start``, ``end`` (timestamps as logged),
        ``duration_s``, ``batches``, ``blocks``, ``usage_before`` (first),
        ``usage_after`` (last), ``shards``.
    """
    bursts: list[dict[str, Any]] = []
    last_t: float | None = None
    for e in log.events:
        if e["event"] != "eviction.batch":
            continue
        t = _time(e)
        if not bursts or t is None or last_t is None or t - last_t > gap_s:
            bursts.append(
                {
                    "start": e.get("timestamp"),
                    "t0": t,
                    "batches": 0,
                    "blocks": 0,
                    "usage_before": e.get("usage_before"),
                    "shards": set(),
                }
            )
        b = bursts[-1]
        b["end"] = e.get("timestamp")
        b["duration_s"] = round(t - b["t0"], 6) if t is not None and b["t0"] is not None else None
        b["batches"] += 1
        b["blocks"] += e["blocks"] if isinstance(e.get("blocks"), int) else 0
        b["usage_after"] = e.get("usage_after")
        b["shards"].add(e.get("shard"))
        last_t = t
    for b in bursts:
        b.pop("t0")
        b["shards"] = sorted(s for s in b["shards"] if s is not None)
    return bursts


def _mentions(event: dict, seq_id: str) -> bool:
    def same(value: Any) -> bool:
        return value is not None and str(value) == seq_id

    if same(event.get("seq_id")):
        return True
    return any(same(v) for key in ("seq_ids", "child_ids") for v in _as_list(event.get(key)))


def _as_list(value: Any) -> Iterable[Hashable]:
    return value if isinstance(value, list) else ()


def sequence_history(log: LogFile, seq_id: str) -> list[dict]:
    """Every event that names ``seq_id`` (as ``seq_id``, in ``seq_ids`` or in ``child_ids``), in order."""
    return [e for e in log.events if _mentions(e, seq_id)]
