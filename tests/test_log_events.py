"""Log events carry the sequence that caused them (the catalog is docs/logging.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from akv import Admit, KVCacheManager

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.anyio
async def test_sequence_events_carry_their_sequence(tiny_config) -> None:
    with capture_logs() as logs:
        async with KVCacheManager(tiny_config(num_blocks=8)) as kv:
            prompt = list(range(1, 11))
            await kv.add_sequence("a", prompt)
            await kv.commit("a", 10)
            await kv.fork("a", ["b"])
            await kv.append("b", [5])
            await kv.step(admits=[Admit(seq_id="big", prompt=list(range(1, 30)))])  # 8 blocks: exhausted
            await kv.step(admits=[Admit(seq_id="huge", prompt=list(range(1, 40)))])  # 10 blocks: never fits
            await kv.free("b", preempted=True)
            await kv.wait_copies()
    events = {}
    for e in logs:
        events.setdefault(e["event"], []).append(e)
    (added,) = events["sequence.added"]
    assert (added["seq_id"], added["prompt_tokens"], added["cached_tokens"], added["blocks"]) == ("a", 10, 0, 3)
    (forked,) = events["sequence.forked"]
    assert (forked["seq_id"], forked["child_ids"], forked["shared_blocks"]) == ("a", ["b"], 3)
    (copy,) = events["cow.copy"]
    assert (copy["seq_ids"], copy["blocks"]) == (["b"], 1)
    (exhausted,) = events["pool.exhausted"]
    assert exhausted["seq_id"] == "big" and exhausted["requested_blocks"] == 6  # 8 blocks, 2 of them prefix hits
    (too_large,) = events["request.too_large"]
    assert (too_large["seq_id"], too_large["requested_blocks"]) == ("huge", 10)
    (freed,) = events["sequence.freed"]
    assert (freed["seq_id"], freed["preempted"]) == ("b", True)
    assert all(
        e["log_level"] == "debug" for name in ("sequence.added", "cow.copy", "pool.exhausted") for e in events[name]
    )


def test_every_emitted_event_is_in_the_catalog() -> None:
    catalog = (ROOT / "docs" / "logging.md").read_text()
    emitted = set()
    for path in (ROOT / "akv").rglob("*.py"):
        if "testing" in path.parts:
            continue
        emitted |= set(re.findall(r"""\.(?:debug|info|warning|error|exception)\(\s*"([a-z_.]+)\"""", path.read_text()))
    assert emitted  # the scan works
    missing = sorted(e for e in emitted if f"`{e}`" not in catalog)
    assert not missing, f"events missing from docs/logging.md: {missing}"


def test_a_level_configured_after_import_silences_snapshot_and_copy_logs(tmp_path) -> None:
    # Found while checking the README: loggers bound at import time ignored the application's
    # later configure_logging(level=...), so snapshot.saved was printed at level "error".
    import subprocess
    import sys

    script = (
        "import anyio, akv.obs\n"
        "from akv import KVCacheConfig, KVCacheManager, Admit\n"
        "async def main():\n"
        "    akv.obs.configure_logging(level='error')\n"
        "    async with KVCacheManager(KVCacheConfig(num_blocks=64)) as kv:\n"
        "        await kv.step(admits=[Admit(seq_id='a', prompt=list(range(40)), prefill_done=True)])\n"
        f"        await kv.save_snapshot({str(tmp_path / 'snap')!r})\n"
        "anyio.run(main)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert (tmp_path / "snap" / "CURRENT").exists()
    assert "snapshot.saved" not in out.stdout + out.stderr


@pytest.mark.parametrize("tracebacks", [False, True])
def test_an_exception_on_the_console_is_one_line_unless_tracebacks_are_asked_for(tmp_path, tracebacks: bool) -> None:
    # A crashed copy process printed 700-1,600 lines on `akv replay`'s console (a rich traceback with
    # every frame's locals, block arrays included) where the README promises one line without --debug.
    import json
    import subprocess
    import sys

    script = (
        "import structlog, akv.obs\n"
        f"akv.obs.configure_logging(level='warning', tracebacks={tracebacks}, json_path={str(tmp_path / 'log.jsonl')!r})\n"
        "blocks = list(range(5000))\n"
        "try:\n"
        "    raise RuntimeError('copy failed')\n"
        "except RuntimeError as exc:\n"
        "    structlog.get_logger('akv').error('actor.crashed', actor='pool_shard_0', exc_info=exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stderr.strip().splitlines()
    assert "actor.crashed" in lines[0] and lines[-1] == "RuntimeError: copy failed"
    assert "4999" not in out.stderr  # never the frames' locals
    if tracebacks:
        assert "Traceback" in out.stderr
    else:
        assert len(lines) == 2
    (event,) = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert event["exception"][0]["exc_type"] == "RuntimeError"  # the file keeps the whole traceback
