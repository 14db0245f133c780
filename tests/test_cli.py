"""The ``akv`` command line: never a traceback, never a silent success.

Bad options exit 2 at parse time, bad traces exit 2 naming file and line before
anything is allocated, a run that can do nothing exits 2 saying what to change,
an unexpected error is one line and exit 1 (``--debug``: the traceback), and the
JSON log has its own level.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import akv
import akv.obs.inspect
from akv.cli import main
from tests.test_replay import restore_logging

__all__ = ["restore_logging"]  # the fixture, imported for its use here

REPO = Path(__file__).resolve().parent.parent
FAST = ["--storage", "none", "--no-progress"]


def _record(n_in: int = 600, n_out: int = 10, ids: object = None, ts: int = 0) -> str:
    if ids is None:
        ids = list(range(-(-n_in // 512)))
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def _trace(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _no_traceback(captured) -> None:
    assert "Traceback" not in captured.out + captured.err


# ---------------------------------------------------------------- 1. trace lengths and records
BAD_RECORDS = {
    "output_length_10_to_12": _record(n_out=10**12),
    "input_plus_output_above_max": _record(n_in=600, n_out=(1 << 20) - 599),
    "string_length": _record().replace('"output_length": 10', '"output_length": "10"'),
    "float_length": _record().replace('"output_length": 10', '"output_length": 10.0'),
    "bool_length": _record().replace('"output_length": 10', '"output_length": true'),
    "zero_output": _record(n_out=0),
    "hash_id_string": _record(ids=["a", 1]),
    "hash_id_negative": _record(ids=[-1, 1]),
    "hash_id_2_to_63": _record(ids=[2**63, 1]),
    "hash_ids_not_a_list": _record(ids={"a": 1}),
    "truncated_json": _record()[:-3],
}


@pytest.mark.parametrize("name", sorted(BAD_RECORDS))
def test_bad_trace_record_exits_2_naming_file_and_line(name: str, tmp_path: Path, restore_logging, capsys) -> None:
    path = _trace(tmp_path, [_record(), "", BAD_RECORDS[name], _record()])
    assert main(["replay", str(path), *FAST]) == 2
    captured = capsys.readouterr()
    assert f"{path}:3:" in captured.err
    _no_traceback(captured)


def test_request_token_limit_is_an_option(tmp_path: Path, restore_logging, capsys) -> None:
    path = _trace(tmp_path, [_record(n_in=600, n_out=10)])
    assert main(["replay", str(path), *FAST, "--max-request-tokens", "609"]) == 2
    assert "--max-request-tokens" in capsys.readouterr().err
    assert main(["replay", str(path), *FAST, "--max-request-tokens", "610"]) == 0


# ---------------------------------------------------------------- 2. options checked at parse time
BAD_OPTIONS = [
    ["replay", "--metrics-port", "99999"],
    ["replay", "--metrics-port", "-1"],
    ["replay", "--limit", "0"],
    ["replay", "--limit", "many"],
    ["replay", "--block-size", "0"],
    ["replay", "--block-size", "1000000"],
    ["replay", "--num-blocks", str(10**12)],
    ["replay", "--pool-gib", "nan"],
    ["replay", "--pool-gib", "-1"],
    ["replay", "--step-ms", "0"],
    ["replay", "--step-ms", "inf"],
    ["replay", "--max-batch", "0"],
    ["replay", "--max-output-tokens", "-5"],
    ["replay", "--max-request-tokens", "0"],
    ["replay", "--shards", "0"],
    ["replay", "--shards", "1000000"],
    ["replay", "--seed", "-1"],
    ["replay", "--log-level", "loud"],
    ["replay", "--log-json-level", "everything"],
    ["replay", "--json", "/no/such/dir/report.json"],
    ["replay", "--log-json", "/no/such/dir/log.jsonl"],
    ["replay", "--metrics-out", "."],
    ["replay", "--plot", "/no/such/dir/p.png"],
    ["replay", "--model", "gpt-9"],
    ["replay", "--plot", "x.out"],
    ["replay", "--plot", "noext"],
    ["replay", "--json", "/dev/full"],
    ["replay", "--json", ""],
    ["replay", "--metrics-out", "/dev/full"],
    ["replay", "--log-json", "/dev/full"],
    ["replay", "--limit", "99999999999999999999"],
    ["inspect", "log.jsonl", "--plot", "timeline.svg"],
    ["inspect", "log.jsonl", "--plot", "/no/such/dir/p.png"],
    ["generate", "--steps", "0"],
    ["generate", "--steps", str(10**9)],
    ["generate", "--prompt-len", str(10**7)],
    ["generate", "--beam-width", "100000"],
    ["generate", "--tolerance", "-1"],
    ["generate", "--tolerance", "nan"],
    ["generate", "--seed", "-1"],
    ["generate", "--threads", "0"],
    ["generate", "--log-level", "loud"],
]


@pytest.mark.parametrize("argv", BAD_OPTIONS, ids=" ".join)
def test_bad_option_exits_2_at_parse_time(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    option = next(a for a in argv if a.startswith("--"))
    assert f"argument {option}" in captured.err
    assert captured.err.count("error:") == 1
    _no_traceback(captured)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--host-gib", "1e-9"], "--host-gib"),  # ran with no host tier, exit 0, as the library refuses it
        (["--copy-thread", "--storage", "none", "--host-blocks", "64"], "--copy-thread"),
        (["--copy-thread"], "--copy-thread"),  # no host tier: no copies to move to a thread
    ],
)
def test_host_tier_options_that_would_do_nothing_exit_2(restore_logging, capsys, args: list[str], names: str) -> None:
    assert main(["replay", "--limit", "1", *FAST, *args]) == 2
    captured = capsys.readouterr()
    assert names in captured.err
    assert captured.err.startswith("akv replay: error: ")
    _no_traceback(captured)


def test_pool_gib_too_small_for_one_block_exits_2(restore_logging, capsys) -> None:
    assert main(["replay", "--limit", "1", "--pool-gib", "1e-9", *FAST]) == 2
    captured = capsys.readouterr()
    assert "--pool-gib" in captured.err
    assert captured.err.startswith("akv replay: error: ")  # as argparse's own errors, naming the command
    _no_traceback(captured)


def test_metrics_port_0_prints_the_port_it_chose(tmp_path: Path, restore_logging, capsys) -> None:
    path = _trace(tmp_path, [_record()])
    assert main(["replay", str(path), *FAST, "--metrics-port", "0"]) == 0
    match = re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", capsys.readouterr().err)
    assert match is not None and 0 < int(match.group(1)) <= 65535


# ---------------------------------------------------------------- 3. unexpected errors: one line, exit 1
def _log(tmp_path: Path) -> Path:
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"event": "manager.started", "level": "info"}) + "\n")
    return path


def _summarize_fails(log) -> dict:
    raise RuntimeError("boom in summarize")


def test_unexpected_error_is_one_line_and_exit_1(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(akv.obs.inspect, "summarize", _summarize_fails)
    assert main(["inspect", str(_log(tmp_path))]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "akv inspect: error: unexpected RuntimeError: boom in summarize (run with --debug for the traceback)"
    ]


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback(where: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(akv.obs.inspect, "summarize", _summarize_fails)
    argv = ["inspect", str(_log(tmp_path))]
    assert main(["--debug", *argv] if where == "before" else [*argv, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "_summarize_fails" in err
    assert err.splitlines()[-1] == "akv inspect: error: unexpected RuntimeError: boom in summarize"


def test_library_reads_no_environment_variables() -> None:
    root = Path(akv.__file__).parent
    readers = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"os\.environ|getenv\(", path.read_text(encoding="utf-8"))
    ]
    assert readers == []


# ---------------------------------------------------------------- 4. a run that can do nothing
def test_empty_trace_exits_2(tmp_path: Path, restore_logging, capsys) -> None:
    for name, lines in (("empty.jsonl", []), ("blank.jsonl", ["", "  "])):
        path = _trace(tmp_path, lines, name)
        assert main(["replay", str(path), *FAST]) == 2
        captured = capsys.readouterr()
        assert str(path) in captured.err and "no request" in captured.err
        _no_traceback(captured)


@pytest.mark.parametrize("pool", [["--num-blocks", "1"], ["--shards", "1000"]], ids=" ".join)
def test_every_request_dropped_exits_2_saying_what_to_change(pool: list[str], restore_logging, capsys) -> None:
    assert main(["replay", "--limit", "5", *FAST, *pool]) == 2
    captured = capsys.readouterr()
    assert "every one of the 5 requests would be dropped" in captured.err
    assert "--num-blocks" in captured.err and "--shards" in captured.err
    _no_traceback(captured)


def test_requests_that_outgrow_a_shard_while_decoding_exit_2(tmp_path: Path) -> None:
    """Prompts fit a 2-block pool but outputs do not; the replay used to retry such an append forever."""
    path = _trace(tmp_path, [_record(n_in=10, n_out=100, ids=[i], ts=i) for i in range(3)])
    argv = [sys.executable, "-m", "akv.cli", "replay", str(path), "--num-blocks", "2", *FAST]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)  # hang guard
    assert done.returncode == 2, done.stderr
    assert "no request finished: all 3 were dropped" in done.stderr
    assert "Traceback" not in done.stderr


def test_some_requests_dropped_is_a_note_and_exit_0(tmp_path: Path, restore_logging, capsys) -> None:
    path = _trace(tmp_path, [_record(n_in=10, n_out=2, ids=[1]), _record(n_in=600, n_out=2)])
    assert main(["replay", str(path), *FAST, "--num-blocks", "4"]) == 0
    assert "akv: note: 1 of 2 requests were dropped" in capsys.readouterr().err


# ---------------------------------------------------------------- 5. console and JSON log levels
def _levels(log: Path) -> set[str]:
    return {json.loads(line)["level"] for line in log.read_text().splitlines()}


def test_log_json_is_debug_while_the_console_stays_quiet(tmp_path: Path, restore_logging, capsys) -> None:
    trace, log = _trace(tmp_path, [_record(), _record()]), tmp_path / "log.jsonl"
    assert main(["replay", str(trace), *FAST, "--log-json", str(log)]) == 0
    assert _levels(log) == {"debug", "info"}
    assert "sequence.added" not in capsys.readouterr().err
    assert main(["inspect", str(log), "--seq", "r1"]) == 0
    history = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in history] == ["sequence.added", "sequence.freed"]


def test_log_json_level_and_log_level_are_separate(tmp_path: Path, restore_logging, capsys) -> None:
    trace, log = _trace(tmp_path, [_record()]), tmp_path / "log.jsonl"
    argv = ["replay", str(trace), *FAST, "--log-json", str(log), "--log-json-level", "info", "--log-level", "debug"]
    assert main(argv) == 0
    assert _levels(log) == {"info"}
    assert "sequence.added" in capsys.readouterr().err


# ---------------------------------------------------------------- 6. plot axes fit the data
def _timeline(n: int = 20) -> list[dict]:
    states = {"free": 100, "active": 20, "cached": 8, "in_flight": 0}
    return [
        {"simulated_s": i * 0.2, **states, "hit_rate": 0.035 + 0.005 * (i % 3), "evictions": 0, "preemptions": 0}
        for i in range(n)
    ]


def test_replay_plot_axes_fit_the_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from akv.obs.plot import plot_replay

    png = tmp_path / "replay.png"
    fig = plot_replay(_timeline(), png)
    ax_blocks, ax_hits, ax_evicted, ax_preempted = fig.axes
    bottom, top = ax_hits.get_ylim()
    assert 3.0 <= bottom < 3.5 and 4.5 < top <= 5.0  # percent, as the table shows; not 0..100 for a line near 4
    assert "%" in ax_hits.get_ylabel()
    assert ax_evicted.get_ylim() == ax_preempted.get_ylim() == (0.0, 1.0)  # not -0.04..0.04 for zeros
    assert ax_blocks.get_ylim()[0] == 0.0 and 128 < ax_blocks.get_ylim()[1] < 140
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_plot_usage_axis_fits_the_batches(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from akv.obs.inspect import LogFile
    from akv.obs.plot import plot_log

    batch = {"event": "eviction.batch", "blocks": 7, "usage_before": 0.99, "usage_after": 0.95}
    log = LogFile(events=[{**batch, "timestamp": f"2026-01-01T00:00:0{i}Z"} for i in range(4)])
    assert plot_log(log, tmp_path / "log.png") == 4
    assert plot_log(LogFile(), tmp_path / "empty.png") == 0


def test_fit_ylim() -> None:
    from akv.obs.plot import fit_ylim

    assert fit_ylim([], from_zero=True) == (0.0, 1.0)
    assert fit_ylim([0, 0, 0], from_zero=True) == (0.0, 1.0)
    assert fit_ylim([0, 50, 100], from_zero=True) == (0.0, 108.0)
    bottom, top = fit_ylim([0.95, 1.0], from_zero=False)
    assert 0.94 < bottom < 0.95 and 1.0 < top < 1.01
    assert fit_ylim([0.5, 0.5], from_zero=False) == (0.46, 0.54)
    assert fit_ylim([None, float("nan"), "x", 2], from_zero=True) == (0.0, 2.16)


# ---------------------------------------------------------------- 8. one default eviction policy
def test_default_eviction_policy_is_named_once() -> None:
    from akv import KVCacheConfig
    from akv.core.eviction_policy import DEFAULT_EVICTION_POLICY
    from akv.core.shard_state import ShardState

    assert ShardState(0, range(8), 4).pool.policy.name == DEFAULT_EVICTION_POLICY
    assert KVCacheConfig(num_blocks=8).eviction_policy == DEFAULT_EVICTION_POLICY == "slru"


# ---------------------------------------------------------------- 9. review 2: outputs, logs, inspect, pipes
def test_device_plot_path_is_refused_before_anything_is_written(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--plot", "/dev/full"])  # was accepted, and /dev/full.png written at the end
    assert exit_info.value.code == 2
    assert "--plot" in capsys.readouterr().err


def test_empty_path_is_named_as_empty(capsys) -> None:
    for argv in (["replay", ""], ["replay", "--json", ""], ["inspect", ""]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert "empty path" in err and "is a directory" not in err


def test_json_report_is_written_before_the_plot(tmp_path: Path, monkeypatch, restore_logging, capsys) -> None:
    pytest.importorskip("matplotlib")
    import akv.obs.plot

    report = tmp_path / "report.json"

    def plot_fails(timeline: list, path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(akv.obs.plot, "plot_replay", plot_fails)
    trace = str(_trace(tmp_path, [_record()]))
    assert main(["replay", trace, *FAST, "--json", str(report), "--plot", str(tmp_path / "p.png")]) == 2
    assert json.loads(report.read_text())["requests_finished"] == 1
    err = capsys.readouterr().err
    assert "--plot" in err and "No space left on device" in err


def test_write_failure_names_the_option_and_path() -> None:
    from akv.argtypes import UsageError, write_output

    with pytest.raises(UsageError, match=r"--json '/dev/full': cannot write: No space left on device"):
        write_output("--json", Path("/dev/full"), "{}\n")


def test_unwritable_log_file_is_reported_not_printed(restore_logging, capsys) -> None:
    import structlog

    from akv.obs.logging import configure_logging, log_file_error

    configure_logging(level="error", json_path="/dev/full", json_level="debug")
    structlog.get_logger("akv").info("test.event", n=1)
    failed = log_file_error()
    assert failed is not None and failed[0] == "/dev/full" and failed[1].errno == 28
    assert "Logging error" not in capsys.readouterr().err


def test_short_replay_has_a_first_and_last_timeline_sample(tmp_path: Path, restore_logging) -> None:
    pytest.importorskip("matplotlib")
    import anyio

    from akv import KVCacheConfig, KVCacheManager
    from akv.obs.plot import plot_replay
    from akv.replay import ReplayOptions, replay
    from akv.trace import read_trace

    requests = read_trace(_trace(tmp_path, [_record(n_out=7)]))

    async def run():
        async with KVCacheManager(KVCacheConfig(num_blocks=64, block_size=16, storage="none")) as kv:
            return await replay(kv, requests, ReplayOptions(timeline_every_steps=10, want_metadata=False))

    report = anyio.run(run)
    assert report.decode_steps < 10  # akv replay --plot samples every 10 steps
    times = [x["simulated_s"] for x in report.timeline]
    assert len(times) == 2 and times[0] < times[1]  # the first and the last step: a line, not a blank panel
    fig = plot_replay(report.timeline, tmp_path / "short.png")
    assert fig.axes[0].get_xlim()[1] > 0


@pytest.mark.parametrize("content", [b"", b"not json\n{also not\n"], ids=["empty", "garbage"])
def test_inspect_a_log_with_no_event_exits_2(content: bytes, tmp_path: Path, capsys) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(content)
    assert main(["inspect", str(path)]) == 2
    assert "no event could be read" in capsys.readouterr().err


def test_inspect_reads_a_gzipped_log(tmp_path: Path, capsys) -> None:
    import gzip

    path = tmp_path / "log.jsonl.gz"
    path.write_bytes(gzip.compress(_log(tmp_path).read_bytes()))
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["events"] == {"manager.started": 1}


def test_inspect_unknown_sequence_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(_log(tmp_path)), "--seq", "r99999"]) == 2
    assert "no event names sequence 'r99999'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "replay", "stress"])
def test_closed_stdout_exits_141_quietly(tmp_path: Path, command: str) -> None:
    # `akv replay | true` and `akv stress | true` exited 1 (rich's console on a broken pipe), which
    # for stress means "a check failed" (found by the fresh-user review).
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"event": f"e{i}", "level": "info"}) + "\n" for i in range(2000)))
    args = {
        "inspect": [str(log)],
        "replay": ["--limit", "20", *FAST],
        "stress": ["--duration-s", "1", "--sequences", "4", "--no-progress"],
    }[command]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-m", "akv.cli", command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    child.stdout.close()  # like `| head -1` that has already exited
    _, err = child.communicate(timeout=120)
    assert (child.returncode, err) == (141, b"")


def test_ipv6_metrics_address_is_bracketed(tmp_path: Path, restore_logging, capsys) -> None:
    path = _trace(tmp_path, [_record()])
    assert main(["replay", str(path), *FAST, "--metrics-port", "0", "--metrics-addr", "::1"]) == 0
    assert re.search(r"serving metrics on http://\[::1\]:\d+/metrics", capsys.readouterr().err)


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["--json", "{trace}"], "the trace and --json"),
        (["--log-json", "{trace}"], "the trace and --log-json"),
        (["--metrics-out", "{trace}"], "the trace and --metrics-out"),
        (["--json", "same.out", "--log-json", "same.out"], "--json and --log-json"),
        (["--json", "r.json", "--metrics-out", "./r.json"], "--json and --metrics-out"),
    ],
)
def test_two_path_arguments_naming_one_file_exit_2_and_touch_nothing(tmp_path, monkeypatch, capsys, options, names):
    """An output on the trace (or on another output) is refused before any file is opened: nothing is overwritten."""
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [1]}\n')
    before = trace.read_bytes()
    argv = ["replay", str(trace), "--no-progress", *(o.format(trace=trace) for o in options)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"akv replay: error: {names} name the same file ")
    assert err[0].endswith(": give each its own path")
    assert trace.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


@pytest.mark.parametrize(
    "options",
    [
        ["--json", "{d}/same.out", "--events-out", "{d}/same.out"],
        ["--requests-out", "{d}/a.jsonl", "--log-json", "{d}/./a.jsonl"],
    ],
)
def test_two_outputs_naming_one_file_exit_2(options, tmp_path: Path, restore_logging, capsys) -> None:
    # Found by a review: the report silently replaced the event stream written to the same path.
    args = [o.format(d=tmp_path) for o in options]
    assert main(["replay", "--limit", "5", *FAST, *args]) == 2
    captured = capsys.readouterr()
    assert "name the same file" in captured.err
    _no_traceback(captured)
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("copy_thread", [True, False])
def test_copy_thread_keeps_the_tier_copies_out_of_a_child_process(
    copy_thread: bool, monkeypatch, restore_logging
) -> None:
    started: list[object] = []

    class NoChild:
        def __init__(self, storage: object) -> None:
            started.append(storage)
            raise OSError("no copy process in this test")  # the executor falls back to its thread

    monkeypatch.setattr("akv.storage.process_lane.CopyProcess", NoChild)
    argv = ["replay", "--limit", "20", "--num-blocks", "256", "--host-blocks", "512", "--no-progress"]
    assert main([*argv, "--copy-thread"] if copy_thread else argv) == 0
    assert len(started) == (0 if copy_thread else 1)


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_sigterm_unwinds_the_replay_as_ctrl_c_does_and_exits_143(tmp_path: Path, sigint_ignored: bool) -> None:
    # SIGTERM killed `akv replay` with no message and left the copy child to notice on its own; and
    # where SIGINT is ignored (a background job of a non-interactive shell) it was ignored too, exit 0.
    from akv.trace import shared_trace_path

    trace = shared_trace_path("mooncake_conversation.jsonl")
    if trace is None:
        pytest.skip("the conversation trace is not in ../shared/traces")
    log = tmp_path / "log.jsonl"
    argv = [sys.executable, "-m", "akv.cli", "replay", str(trace), "--num-blocks", "8000", "--host-blocks", "20000"]
    argv += ["--no-progress", "--log-json", str(log), "--json", str(tmp_path / "report.json")]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    try:
        for _ in range(600):  # a hang guard only: started within 60 s
            if log.exists() and "sequence.added" in log.read_text():
                break
            if proc.poll() is not None:
                pytest.fail(f"the replay ended before it was signalled: {proc.communicate()}")
            subprocess.run(["sleep", "0.1"], check=True)
        proc.terminate()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out, err)
    assert err.strip().splitlines()[-1] == "akv replay: terminated"
    assert "Traceback" not in err
    stopped = [json.loads(line) for line in log.read_text().splitlines() if '"manager.stopped"' in line]
    assert [e["failed"] for e in stopped] == [False]  # left as on Ctrl-C, not failed by an interrupted handler
    assert '"actor.crashed"' not in log.read_text()
