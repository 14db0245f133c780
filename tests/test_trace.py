"""Tests for akv.trace: trace reader, token synthesis, reference hit counts."""

from __future__ import annotations

import gzip
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.errors import InvalidInput, TraceError
from akv.trace import (
    TraceRequest,
    default_trace_path,
    expected_cached_tokens,
    hit_rate,
    mix64,
    read_trace,
    shared_trace_path,
    synthesize_output,
    synthesize_prompt,
)

U64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


# --------------------------------------------------------------------------- #
# helpers


def _rec(ts: int = 0, n_in: int = 600, n_out: int = 10, ids: list[int] | None = None) -> dict:
    if ids is None:
        ids = list(range(math.ceil(n_in / 512)))
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def _write(path: Path, lines: list[str], *, trailing_newline: bool = True) -> Path:
    text = "\n".join(lines) + ("\n" if trailing_newline else "")
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)
    return path


def _good_lines(k: int = 3) -> list[str]:
    return [json.dumps(_rec(ts=100 * i, n_in=600 + i, ids=[2 * i, 2 * i + 1])) for i in range(k)]


def _req(index: int, n_in: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index=index, line=index + 1, timestamp_ms=0, input_length=n_in, output_length=1, hash_ids=ids)


def _py_mix64(x: int) -> int:
    """Pure-Python splitmix64 finalizer (independent of the numpy code)."""
    x &= U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


# --------------------------------------------------------------------------- #
# reader: happy paths


def test_default_slice_loads() -> None:
    path = default_trace_path()
    assert path.name == "mooncake_conversation_head.jsonl.gz"
    assert path.is_file()
    reqs = read_trace(path)
    assert len(reqs) == 3000
    first = reqs[0]
    assert first == TraceRequest(
        index=0,
        line=1,
        timestamp_ms=0,
        input_length=6758,
        output_length=500,
        hash_ids=tuple(range(14)),
    )
    assert reqs[1].input_length == 7322 and reqs[1].output_length == 490
    assert reqs[1].hash_ids == (0, *range(14, 28))
    assert reqs[-1].index == 2999 and reqs[-1].line == 3000
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)
        assert r.output_length >= 1


def test_trace_request_is_frozen_slotted_kwonly() -> None:
    r = _req(0, 10, (1,))
    with pytest.raises(AttributeError):
        r.input_length = 5  # type: ignore[misc]
    assert not hasattr(r, "__dict__")
    with pytest.raises(TypeError):
        TraceRequest(0, 1, 0, 10, 1, (1,))  # type: ignore[misc]


def test_limit() -> None:
    path = default_trace_path()
    assert [r.index for r in read_trace(path, limit=5)] == [0, 1, 2, 3, 4]
    assert read_trace(path, limit=0) == []
    assert len(read_trace(path, limit=10**9)) == 3000
    with pytest.raises(InvalidInput):
        read_trace(path, limit=-1)


def test_limit_stops_before_bad_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [*_good_lines(2), "garbage"])
    assert len(read_trace(path, limit=2)) == 2
    with pytest.raises(TraceError):
        read_trace(path)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_plain_and_gzip(tmp_path: Path, name: str) -> None:
    path = _write(tmp_path / name, _good_lines(3))
    reqs = read_trace(path)
    assert [r.timestamp_ms for r in reqs] == [0, 100, 200]
    assert [r.input_length for r in reqs] == [600, 601, 602]
    assert reqs[2].hash_ids == (4, 5)
    assert [r.line for r in reqs] == [1, 2, 3]


def test_gzip_detected_by_magic(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(gzip.compress("\n".join(_good_lines(2)).encode() + b"\n"))
    assert len(read_trace(path)) == 2


def test_blank_lines_skipped_but_counted(tmp_path: Path) -> None:
    good = _good_lines(2)
    path = _write(tmp_path / "t.jsonl", ["", good[0], "   ", good[1], ""])
    reqs = read_trace(path)
    assert [(r.index, r.line) for r in reqs] == [(0, 2), (1, 4)]


def test_unsorted_timestamps_and_extra_keys_ok(tmp_path: Path) -> None:
    a = _rec(ts=500)
    b = _rec(ts=100)
    b["extra"] = "ignored"
    path = _write(tmp_path / "t.jsonl", [json.dumps(a), json.dumps(b)])
    assert [r.timestamp_ms for r in read_trace(path)] == [500, 100]


def test_last_line_without_newline_ok(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", _good_lines(2), trailing_newline=False)
    assert len(read_trace(path)) == 2


def test_custom_trace_block_tokens(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [json.dumps(_rec(n_in=65, ids=[1, 2, 3]))])
    assert read_trace(path, trace_block_tokens=32)[0].hash_ids == (1, 2, 3)
    with pytest.raises(TraceError):
        read_trace(path)  # 512 tokens per id: 65 tokens need 1 id, not 3
    with pytest.raises(InvalidInput):
        read_trace(path, trace_block_tokens=0)


# --------------------------------------------------------------------------- #
# reader: errors


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line is None
    assert str(path) in str(ei.value)
    assert "not found" in str(ei.value)
    with pytest.raises(TraceError) as ei:
        read_trace(path, limit=0)
    assert ei.value.line is None


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as ei:
        read_trace(tmp_path)
    assert ei.value.line is None


@pytest.mark.parametrize(
    "data",
    [b"this is not gzip at all", gzip.compress(b'{"timestamp": 0}\n' * 100)[:-30]],
    ids=["not-gzip", "truncated-gzip"],
)
def test_bad_gzip(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(data)
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line is None
    assert str(path) in str(ei.value)


BAD_RECORDS = {
    "not-json": ("{not json", "invalid JSON"),
    "list": ("[1, 2, 3]", "not a JSON object"),
    "number": ("42", "not a JSON object"),
    "missing-timestamp": (json.dumps({k: v for k, v in _rec().items() if k != "timestamp"}), "timestamp"),
    "missing-input": (json.dumps({k: v for k, v in _rec().items() if k != "input_length"}), "input_length"),
    "missing-output": (json.dumps({k: v for k, v in _rec().items() if k != "output_length"}), "output_length"),
    "missing-hash-ids": (json.dumps({k: v for k, v in _rec().items() if k != "hash_ids"}), "hash_ids"),
    "bool-input": (json.dumps({**_rec(), "input_length": True}), "input_length"),
    "bool-timestamp": (json.dumps({**_rec(), "timestamp": False}), "timestamp"),
    "float-output": (json.dumps({**_rec(), "output_length": 10.0}), "output_length"),
    "string-input": (json.dumps({**_rec(), "input_length": "600"}), "input_length"),
    "null-timestamp": (json.dumps({**_rec(), "timestamp": None}), "timestamp"),
    "negative-timestamp": (json.dumps(_rec(ts=-1)), "timestamp"),
    "negative-input": (json.dumps({**_rec(), "input_length": -5}), "input_length"),
    "zero-input": (json.dumps(_rec(n_in=0, ids=[])), "input_length"),
    "negative-output": (json.dumps(_rec(n_out=-1)), "output_length"),
    "zero-output": (json.dumps(_rec(n_out=0)), "output_length"),
    "hash-ids-not-list": (json.dumps({**_rec(), "hash_ids": "0,1"}), "hash_ids"),
    "hash-ids-too-few": (json.dumps(_rec(n_in=1025, ids=[1, 2])), "needs"),
    "hash-ids-too-many": (json.dumps(_rec(n_in=512, ids=[1, 2])), "needs"),
    "hash-ids-empty": (json.dumps(_rec(n_in=10, ids=[])), "needs"),
    "hash-id-bool": (json.dumps(_rec(ids=[0, True])), "hash_ids"),
    "hash-id-float": (json.dumps(_rec(ids=[0, 1.0])), "hash_ids"),
    "hash-id-negative": (json.dumps(_rec(ids=[0, -3])), "hash id -3"),
    "hash-id-too-big": (json.dumps(_rec(ids=[0, 2**63])), "hash id"),
}


@pytest.mark.parametrize("name", sorted(BAD_RECORDS))
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_bad_record(tmp_path: Path, name: str, suffix: str) -> None:
    bad, expect = BAD_RECORDS[name]
    good = _good_lines(3)
    # Line 1 good, line 2 blank, line 3 good, line 4 bad, line 5 good.
    path = _write(tmp_path / f"t{suffix}", [good[0], "", good[1], bad, good[2]])
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    err = ei.value
    assert err.line == 4
    assert err.path == path
    assert f"{path}:4" in str(err)
    assert expect in err.reason


def test_truncated_last_line(tmp_path: Path) -> None:
    good = _good_lines(3)
    cut = good[2][: len(good[2]) // 2]
    path = _write(tmp_path / "t.jsonl", [good[0], good[1], cut], trailing_newline=False)
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line == 3
    assert "truncated last line" in ei.value.reason
    assert str(path) in str(ei.value)


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_good_lines(1)[0].encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(TraceError) as ei:
        read_trace(path)
    assert ei.value.line == 2


def test_trace_error_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        read_trace(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- #
# tokens


def test_mix64_matches_splitmix64_reference() -> None:
    # First outputs of splitmix64 seeded with 0: mix64(k * gamma), k = 1, 2, 3.
    xs = np.array([(k * GAMMA) & U64 for k in (1, 2, 3)], dtype=np.uint64)
    assert [int(v) for v in mix64(xs)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    rng = np.random.default_rng(1)
    xs = rng.integers(0, 2**63, size=100, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert [int(v) for v in mix64(xs)] == [_py_mix64(int(v)) for v in xs]


def test_mix64_shapes_and_no_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = np.arange(12, dtype=np.uint64).reshape(3, 4) + np.uint64(U64 - 5)
        out = mix64(x)
        assert out.shape == (3, 4) and out.dtype == np.uint64
        scalar = mix64(np.uint64(U64))
        assert scalar.shape == () and int(scalar) == _py_mix64(U64)
    assert mix64(x[0]).tolist() == out[0].tolist()  # elementwise
    assert int(mix64(0)) == 0  # the finalizer fixes 0 (hence the seed key)
    assert mix64(np.array([], dtype=np.uint64)).shape == (0,)


def test_prompt_matches_documented_formula() -> None:
    ids = (7, 123456789, 2**62 + 3)
    seed, vocab, tbt = 5, 1000, 32
    toks = synthesize_prompt(ids, 80, vocab_size=vocab, trace_block_tokens=tbt, seed=seed)
    key = _py_mix64(seed + GAMMA)
    want = [_py_mix64((_py_mix64(ids[p // tbt] ^ key) + p % tbt) & U64) % vocab for p in range(80)]
    assert toks.tolist() == want


def test_prompt_dtype_shape_range() -> None:
    ids = list(range(1000, 1030))
    toks = synthesize_prompt(ids, 15_000)
    assert toks.dtype == np.int32 and toks.shape == (15_000,)
    assert toks.min() >= 0 and toks.max() < 128_256
    small = synthesize_prompt(ids, 15_000, vocab_size=7)
    assert set(np.unique(small).tolist()) == set(range(7))
    assert synthesize_prompt([], 0).shape == (0,)
    assert synthesize_prompt(np.array([3, 4], dtype=np.uint64), 600).shape == (600,)


def test_prompt_not_linear() -> None:
    toks = synthesize_prompt([42], 512).astype(np.int64)
    diffs = np.diff(toks)
    assert len(np.unique(diffs)) > 400
    # Neighbouring hash ids give unrelated blocks.
    a = synthesize_prompt([42], 512)
    b = synthesize_prompt([43], 512)
    assert np.mean(a == b) < 0.01


def test_prompt_deterministic_and_seeded() -> None:
    ids = (3, 9, 27)
    a = synthesize_prompt(ids, 1300)
    assert np.array_equal(a, synthesize_prompt(list(ids), 1300))
    assert np.array_equal(a, synthesize_prompt(np.array(ids), 1300))
    c = synthesize_prompt(ids, 1300, seed=1)
    assert np.mean(a == c) < 0.01


def test_prompt_equal_prefix_property() -> None:
    a = synthesize_prompt((5, 6, 7), 1500)
    b = synthesize_prompt((5, 6, 9), 1400)
    assert np.array_equal(a[:1024], b[:1024])
    assert np.mean(a[1024:1400] == b[1024:1400]) < 0.01
    c = synthesize_prompt((8, 6, 7), 1500)  # different first id: first block differs
    assert np.mean(a[:512] == c[:512]) < 0.01
    # Tokens are a function of (hash_id, offset) only, so ids 6 and 7 still give
    # the same tokens; a prefix cache will not reuse them (the prefix differs).
    assert np.array_equal(a[512:], c[512:])


def test_prompt_tokens_depend_on_hash_id_and_offset_only() -> None:
    block = synthesize_prompt((5,), 512)
    assert np.array_equal(synthesize_prompt((9, 5), 1024)[512:], block)


def test_prompt_partial_last_block() -> None:
    full = synthesize_prompt((5, 6), 1024)
    assert np.array_equal(synthesize_prompt((5, 6), 600), full[:600])
    assert np.array_equal(synthesize_prompt((5,), 100), full[:100])
    # Extra ids are ignored (a prefix of a request can be synthesized).
    assert np.array_equal(synthesize_prompt((5, 6, 7), 100), full[:100])


@pytest.mark.parametrize(
    ("ids", "n", "kwargs"),
    [
        ((1,), 513, {}),
        ((), 1, {}),
        ((-1,), 10, {}),
        ((2**63,), 10, {}),
        ((1.5,), 10, {}),
        ((1,), -1, {}),
        ((1,), 10, {"vocab_size": 0}),
        ((1,), 10, {"vocab_size": 2**31 + 1}),
        ((1,), 10, {"trace_block_tokens": 0}),
        ((1,), 10, {"seed": 1.0}),
    ],
)
def test_prompt_invalid(ids: tuple, n: int, kwargs: dict) -> None:
    with pytest.raises(InvalidInput):
        synthesize_prompt(ids, n, **kwargs)


def test_output_tokens() -> None:
    a = synthesize_output(3, 400)
    assert a.dtype == np.int32 and a.shape == (400,)
    assert a.min() >= 0 and a.max() < 128_256
    assert np.array_equal(a, synthesize_output(3, 400))
    assert np.array_equal(synthesize_output(3, 100), a[:100])
    assert np.mean(a == synthesize_output(4, 400)) < 0.01
    assert np.mean(a == synthesize_output(3, 400, seed=1)) < 0.01
    # Different domain from a prompt block whose hash id equals the index.
    assert np.mean(a == synthesize_prompt((3,), 400)) < 0.01
    assert synthesize_output(0, 0).shape == (0,)
    key = _py_mix64(GAMMA)
    want = [_py_mix64((_py_mix64((3 | 1 << 63) ^ key) + p) & U64) % 50 for p in range(20)]
    assert synthesize_output(3, 20, vocab_size=50).tolist() == want
    for bad in ({"request_index": -1}, {"request_index": 2**63}, {"output_length": -1}):
        args = {"request_index": 1, "output_length": 5, **bad}
        with pytest.raises(InvalidInput):
            synthesize_output(args["request_index"], args["output_length"])


@settings(max_examples=60, deadline=None)
@given(
    common=st.lists(st.integers(0, 2**63 - 1), min_size=0, max_size=4),
    tail_a=st.lists(st.integers(0, 1000), min_size=1, max_size=3),
    tail_b=st.lists(st.integers(1001, 2000), min_size=1, max_size=3),
    cut_a=st.integers(0, 7),
    cut_b=st.integers(0, 7),
    vocab=st.integers(1, 2**31),
    seed=st.integers(0, 2**64 - 1),
)
def test_prompt_prefix_property_hypothesis(
    common: list[int],
    tail_a: list[int],
    tail_b: list[int],
    cut_a: int,
    cut_b: int,
    vocab: int,
    seed: int,
) -> None:
    tbt = 8
    ids_a, ids_b = common + tail_a, common + tail_b
    n_a, n_b = len(ids_a) * tbt - cut_a, len(ids_b) * tbt - cut_b
    a = synthesize_prompt(ids_a, n_a, vocab_size=vocab, trace_block_tokens=tbt, seed=seed)
    b = synthesize_prompt(ids_b, n_b, vocab_size=vocab, trace_block_tokens=tbt, seed=seed)
    assert a.shape == (n_a,) and b.shape == (n_b,)
    assert a.dtype == np.int32
    assert a.min() >= 0 and a.max() < vocab
    k = len(common) * tbt
    assert np.array_equal(a[:k], b[:k])
    m = min(n_a, n_b)
    if vocab >= 2**20 and m > k:  # first tail ids differ: the tails are unrelated
        assert np.mean(a[k:m] == b[k:m]) < 0.5


# --------------------------------------------------------------------------- #
# expected hits


def _brute_force(reqs: list[TraceRequest], bs: int, tbt: int) -> list[int]:
    out = []
    for i, r in enumerate(reqs):
        best = 0
        for e in reqs[:i]:
            k = 0
            while k < min(len(e.hash_ids), len(r.hash_ids)) and e.hash_ids[k] == r.hash_ids[k]:
                k += 1
            if k == 0:
                continue
            shared = min(k * tbt, e.input_length, r.input_length)
            best = max(best, min(shared // bs, (r.input_length - 1) // bs) * bs)
        out.append(best)
    return out


def _hits(*reqs: tuple[int, tuple[int, ...]]) -> list[int]:
    trace = [_req(i, n, ids) for i, (n, ids) in enumerate(reqs)]
    return expected_cached_tokens(trace, block_size=16, trace_block_tokens=32)


def test_hits_no_sharing() -> None:
    assert _hits((64, (1, 2)), (64, (3, 4))) == [0, 0]
    # Equal later ids but a different first id: prefix semantics, no hit.
    assert _hits((64, (1, 2)), (64, (3, 2))) == [0, 0]


def test_hits_exact_multiple_fully_cached() -> None:
    # Fully cached 64-token prompt: the last token is recomputed, so 64 - 16.
    assert _hits((64, (1, 2)), (64, (1, 2))) == [0, 48]


def test_hits_earlier_shorter_request() -> None:
    # Earlier request has 20 tokens: publishes 1 full block (16 tokens).
    assert _hits((20, (1,)), (64, (1, 2))) == [0, 16]
    # Earlier request 40 tokens (second id partial, 8 tokens): 2 full blocks.
    assert _hits((40, (1, 2)), (90, (1, 2, 3))) == [0, 32]
    # Earlier request under one block publishes nothing.
    assert _hits((10, (1,)), (64, (1, 2))) == [0, 0]


def test_hits_partial_last_trace_block() -> None:
    # Later request ends inside its second trace block (50 tokens).
    assert _hits((96, (1, 2, 3)), (50, (1, 2))) == [0, 48]
    # 48 tokens: 3 full blocks, but the last token is computed: 2 blocks hit.
    assert _hits((96, (1, 2, 3)), (48, (1, 2))) == [0, 32]
    # One-token prompt can never hit.
    assert _hits((96, (1, 2, 3)), (1, (1,))) == [0, 0]


def test_hits_max_over_earlier_requests() -> None:
    assert _hits((64, (1, 2)), (64, (1, 5)), (80, (1, 2, 7))) == [0, 32, 64]
    # A later, longer request raises what a short prefix can reuse.
    assert _hits((10, (1,)), (64, (1, 2)), (30, (1,))) == [0, 0, 16]


def test_hits_other_block_sizes_and_errors() -> None:
    trace = [_req(0, 100, (1, 2, 3, 4)), _req(1, 70, (1, 2, 3))]
    assert expected_cached_tokens(trace, block_size=5, trace_block_tokens=32) == [0, 65]
    assert expected_cached_tokens(trace, block_size=1, trace_block_tokens=32) == [0, 69]
    assert expected_cached_tokens([]) == []
    with pytest.raises(InvalidInput):
        expected_cached_tokens(trace, block_size=0)
    with pytest.raises(InvalidInput):
        expected_cached_tokens(trace, trace_block_tokens=0)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=5),
            st.integers(0, 31),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([1, 4, 16, 10]),
)
def test_hits_match_brute_force(specs: list[tuple[list[int], int]], bs: int) -> None:
    tbt = 32
    reqs = [_req(i, len(ids) * tbt - cut, tuple(ids)) for i, (ids, cut) in enumerate(specs)]
    got = expected_cached_tokens(reqs, block_size=bs, trace_block_tokens=tbt)
    assert got == _brute_force(reqs, bs, tbt)
    for r, c in zip(reqs, got, strict=True):
        assert c % bs == 0 and 0 <= c <= r.input_length - 1


def test_hit_rate() -> None:
    reqs = [_req(0, 64, (1, 2)), _req(1, 64, (1, 2))]
    assert hit_rate(reqs, [0, 48]) == pytest.approx(48 / 128)
    assert hit_rate([], []) == 0.0
    with pytest.raises(InvalidInput):
        hit_rate(reqs, [0])


def test_hits_on_shipped_slice() -> None:
    reqs = read_trace(default_trace_path(), limit=500)
    cached = expected_cached_tokens(reqs)
    assert cached[0] == 0
    assert 0.0 < hit_rate(reqs, cached) < 1.0


# --------------------------------------------------------------------------- #
# full shared traces (optional)

_CONVERSATION = shared_trace_path("mooncake_conversation.jsonl")


@pytest.mark.skipif(
    _CONVERSATION is None,
    reason="full traces not found: ../shared/traces/mooncake_conversation.jsonl is absent",
)
def test_conversation_trace_expected_hits_plausible() -> None:
    assert _CONVERSATION is not None
    reqs = read_trace(_CONVERSATION, limit=2000)
    assert len(reqs) == 2000
    cached = expected_cached_tokens(reqs, block_size=16)
    rate = hit_rate(reqs, cached)
    assert 0.0 < rate < 1.0
    for r, c in zip(reqs, cached, strict=True):
        assert c % 16 == 0 and 0 <= c < r.input_length
    # The shipped slice is the head of this file, unchanged.
    assert read_trace(default_trace_path(), limit=2000) == reqs


def test_shared_trace_path_missing_name() -> None:
    assert shared_trace_path("no-such-trace-file.jsonl") is None
