"""Snapshot files on real directories: round trips, every kind of damage refused whole, generations.

Everything here writes real files with real fsyncs under pytest's tmp dirs;
nothing is mocked. The kill -9 tests are in test_snapshot_crash.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv.config import KVCacheConfig, ModelShape
from akv.errors import InvalidInput, SnapshotError
from akv.storage.snapshot_demo import demo_blocks, demo_layers, save_demo_snapshot, tensor_reader
from akv.storage.snapshot_dir import save_snapshot
from akv.storage.snapshot_files import SafetensorsWriter
from akv.storage.snapshot_manifest import blocks_specs, current_line, manifest_bytes
from akv.storage.snapshot_reader import load_snapshot, snapshot_info, verify_snapshot
from akv.storage.snapshot_record import COLUMNS, SnapshotBlocks

VOCAB = 1000


def _config(dtype: str = "float16", storage: str = "tensors", **changes: object) -> KVCacheConfig:
    model = {"name": "t", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": dtype}
    model.update({k: changes.pop(k) for k in list(changes) if k in model})
    fields = {"num_blocks": 64, "block_size": 4, "vocab_size": VOCAB, "storage": storage, **changes}
    return KVCacheConfig(model=ModelShape(**model), **fields)


def _save(directory: Path, config: KVCacheConfig, n: int, seed: int = 0, **kw: object):
    blocks = demo_blocks(n, block_size=config.block_size, vocab_size=VOCAB, seed=seed)
    layers = demo_layers(config, n, seed) if config.storage == "tensors" else None
    reader = tensor_reader(layers, np.arange(n, dtype=np.int64)) if layers is not None else None
    generation = save_snapshot(directory, config, blocks, reader, **kw)
    return generation, blocks, layers


def assert_same_blocks(a: SnapshotBlocks, b: SnapshotBlocks) -> None:
    assert a.block_size == b.block_size
    assert [(type(x), x) for x in a.namespaces] == [(type(x), x) for x in b.namespaces]
    for name in COLUMNS:
        got, want = getattr(a, name), getattr(b, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def assert_same_layers(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))  # bytewise: float8 and NaN-safe


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_round_trip_with_tensors_is_exact(tmp_path: Path, dtype: str, n: int) -> None:
    config = _config(dtype)
    generation, blocks, layers = _save(tmp_path / "s", config, n, batch_bytes=300)  # several batches per layer
    snap = load_snapshot(tmp_path / "s", config.fingerprint())
    assert snap.generation == generation == 1 and snap.fingerprint == config.fingerprint()
    assert_same_blocks(snap.blocks, blocks)
    assert_same_layers(snap.layers, layers)
    for layer, want in enumerate(layers):  # the files are plain safetensors, readable by the library
        file = safetensors.torch.load_file(tmp_path / "s" / "gen-000001" / f"layer-{layer:05d}.safetensors")
        assert torch.equal(torch.stack([file["k"], file["v"]]).view(torch.uint8), want.view(torch.uint8))
    columns = safetensors.torch.load_file(tmp_path / "s" / "gen-000001" / "blocks.safetensors")
    assert np.array_equal(columns["tokens"].numpy(), blocks.tokens)


def test_round_trip_metadata_only_has_no_layer_files(tmp_path: Path) -> None:
    config = _config(storage="none")
    _, blocks, _ = _save(tmp_path / "s", config, 120)
    snap = load_snapshot(tmp_path / "s", config.fingerprint())
    assert snap.layers is None
    assert_same_blocks(snap.blocks, blocks)
    assert sorted(os.listdir(tmp_path / "s" / "gen-000001")) == ["blocks.safetensors", "manifest.json"]


def test_info_says_what_the_snapshot_holds(tmp_path: Path) -> None:
    config = _config("bfloat16")
    _save(tmp_path / "s", config, 10)
    _save(tmp_path / "s", config, 12, seed=1)
    info = snapshot_info(tmp_path / "s")
    assert (info["generation"], info["num_blocks"], info["num_layers"], info["storage"]) == (2, 12, 2, "tensors")
    assert info["fingerprint"] == config.fingerprint() and info["generations"] == ["gen-000001", "gen-000002"]
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "s" / "gen-000002").iterdir()}
    assert info["files"] == on_disk and info["bytes"] == sum(on_disk.values())


# ------------------------------------------------------------------ damage
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-generation snapshot shared by the damage tests (each restores what it changed)."""
    directory = tmp_path_factory.mktemp("snap") / "s"
    _save(directory, _config(), 30, seed=1)
    _save(directory, _config(), 40, seed=2)
    return directory


FILES = ["CURRENT", "gen-000002/manifest.json", "gen-000002/blocks.safetensors", "gen-000002/layer-00000.safetensors"]
FILES += ["gen-000002/layer-00001.safetensors"]


def _refused(directory: Path, causes: set[str]) -> SnapshotError:
    with pytest.raises(SnapshotError) as verified:
        verify_snapshot(directory, _config().fingerprint())
    with pytest.raises(SnapshotError) as loaded:
        load_snapshot(directory, _config().fingerprint())
    assert verified.value.cause in causes and loaded.value.cause == verified.value.cause, str(verified.value)
    return verified.value


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=150)
@given(data=st.data())
def test_any_flipped_byte_of_any_file_is_refused(saved: Path, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(FILES), label="file")
    path = saved / name
    original = path.read_bytes()
    offset = data.draw(st.integers(0, len(original) - 1), label="offset")
    flip = data.draw(st.integers(1, 255), label="xor")
    damaged = bytearray(original)
    damaged[offset] ^= flip
    path.write_bytes(bytes(damaged))
    try:
        _refused(saved, {"corrupt", "missing"} if name == "CURRENT" else {"corrupt"})
    finally:
        path.write_bytes(original)
    verify_snapshot(saved)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("keep", ["none", "one byte short", "half"])
def test_truncated_files_are_refused(saved: Path, name: str, keep: str) -> None:
    path = saved / name
    original = path.read_bytes()
    size = {"none": 0, "one byte short": len(original) - 1, "half": len(original) // 2}[keep]
    path.write_bytes(original[:size])
    try:
        error = _refused(saved, {"truncated"} if name.endswith(".safetensors") else {"corrupt"})
        assert str(path) in str(error)
    finally:
        path.write_bytes(original)


@pytest.mark.parametrize("name", FILES[2:])
def test_a_longer_file_is_refused(saved: Path, name: str) -> None:
    path = saved / name
    original = path.read_bytes()
    path.write_bytes(original + b"\0")
    try:
        _refused(saved, {"corrupt"})
    finally:
        path.write_bytes(original)


@pytest.mark.parametrize("name", [*FILES, "gen-000002"])
@pytest.mark.parametrize("how", ["delete", "rename"])
def test_missing_or_renamed_files_are_refused(saved: Path, name: str, how: str) -> None:
    path, aside = saved / name, saved.parent / "aside"
    shutil.move(path, aside)
    if how == "rename" and name != "CURRENT":
        target = path.with_name("layer-00009.safetensors" if path.suffix else "gen-000099")
        shutil.move(aside, target)
        aside = target
    try:
        error = _refused(saved, {"missing"})
        assert str(path) in str(error)
    finally:
        shutil.move(aside, path)
    verify_snapshot(saved)


def test_a_current_naming_an_absent_generation_is_missing(tmp_path: Path) -> None:
    _save(tmp_path / "s", _config(), 5)
    (tmp_path / "s" / "CURRENT").write_bytes(current_line(7, b"{}"))
    assert "gen-000007" in str(_refused(tmp_path / "s", {"missing"}))


FOREIGN = [
    ("model.name", {"name": "other"}),
    ("model.num_layers", {"num_layers": 3}),
    ("model.num_kv_heads", {"num_kv_heads": 4}),
    ("model.head_dim", {"head_dim": 16}),
    ("model.dtype", {"dtype": "bfloat16"}),
    ("block_size", {"block_size": 8}),
    ("vocab_size", {"vocab_size": 2000}),
]


@pytest.mark.parametrize(("field", "change"), FOREIGN)
def test_a_foreign_fingerprint_is_refused_naming_the_field(saved: Path, field: str, change: dict) -> None:
    other = _config(**change).fingerprint()
    for call in (verify_snapshot, load_snapshot):
        with pytest.raises(SnapshotError) as refused:
            call(saved, other)
        assert refused.value.cause == "foreign" and f"{field} " in str(refused.value)


def test_another_key_version_is_foreign(saved: Path) -> None:
    other = {**_config().fingerprint(), "key_version": 999}
    with pytest.raises(SnapshotError, match=r"key_version 1 \(expected 999\)") as refused:
        load_snapshot(saved, other)
    assert refused.value.cause == "foreign"


def _rewrite_manifest(directory: Path, change) -> None:
    """Edit the current manifest with ``change(dict)`` and re-point CURRENT at its new checksum."""
    path = directory / "gen-000001" / "manifest.json"
    fields = json.loads(path.read_text())
    change(fields)
    data = manifest_bytes(fields)
    path.write_bytes(data)
    (directory / "CURRENT").write_bytes(current_line(1, data))


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda m: m.update(format_version=2), "format"),
        (lambda m: m.update(format="zarr"), "format"),
        (lambda m: m.update(num_blocks=4), "corrupt"),
        (lambda m: m.update(generation=3), "corrupt"),
        (lambda m: m.update(checksum="sha256"), "corrupt"),
        (lambda m: m.update(namespaces=[["q", 1]] * 5), "corrupt"),
        (lambda m: m["files"].pop("layer-00001.safetensors"), "corrupt"),
        (lambda m: m.update(storage="none"), "corrupt"),
        (lambda m: m.update(extra=1), "corrupt"),
    ],
)
def test_a_manifest_that_checksums_but_does_not_fit_is_refused(tmp_path: Path, change, cause: str) -> None:
    _save(tmp_path / "s", _config(), 9)
    _rewrite_manifest(tmp_path / "s", change)
    _refused(tmp_path / "s", {cause})


def test_tokens_that_do_not_match_the_keys_are_refused_even_with_good_checksums(tmp_path: Path) -> None:
    config = _config(storage="none")
    _, blocks, _ = _save(tmp_path / "s", config, 20)
    tokens = blocks.tokens.copy()
    tokens[7, 2] = (tokens[7, 2] + 1) % VOCAB
    gen = tmp_path / "s" / "gen-000001"
    (gen / "blocks.safetensors").unlink()
    writer = SafetensorsWriter(gen / "blocks.safetensors", blocks_specs(20, config.block_size))
    for index, name in enumerate(COLUMNS):
        writer.append(index, tokens if name == "tokens" else getattr(blocks, name))
    entry = writer.finish(lambda point: None)
    _rewrite_manifest(tmp_path / "s", lambda m: m["files"].update({"blocks.safetensors": entry}))
    assert "block 7's key does not match" in str(_refused(tmp_path / "s", {"corrupt"}))


def test_not_a_snapshot_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for path, cause in ((tmp_path / "empty", "missing"), (tmp_path / "file", "io"), (tmp_path / "absent", "missing")):
        with pytest.raises(SnapshotError) as refused:
            verify_snapshot(path)
        assert refused.value.cause == cause


# ------------------------------------------------------------------ saving
def test_generations_keep_the_current_and_previous_and_skip_leftovers(tmp_path: Path) -> None:
    directory = tmp_path / "s"
    for seed in range(3):
        _save(directory, _config(), 5 + seed, seed=seed)
    assert sorted(os.listdir(directory)) == ["CURRENT", "gen-000002", "gen-000003"]
    (directory / "gen-000009").mkdir()  # a crashed save's partial generation
    (directory / "gen-000009" / "manifest.json").write_text("{")
    (directory / "CURRENT.tmp").write_text("junk")
    assert load_snapshot(directory).generation == 3
    generation, blocks, _ = _save(directory, _config(), 4, seed=7)
    assert generation == 10 and sorted(os.listdir(directory)) == ["CURRENT", "gen-000003", "gen-000010"]
    assert_same_blocks(load_snapshot(directory).blocks, blocks)


def test_progress_points_name_every_durable_step(tmp_path: Path) -> None:
    _save(tmp_path / "s", _config(), 3)
    points: list[str] = []
    _save(tmp_path / "s", _config(), 3, on_progress=points.append)
    _save(tmp_path / "s", _config(), 3, on_progress=points.append)
    first = points[: points.index("fsynced directory") + 1]
    assert first[0] == "mkdir gen-000002" and first[-3:] == [
        "fsynced CURRENT.tmp",
        "renamed CURRENT",
        "fsynced directory",
    ]
    for name in ("layer-00000.safetensors", "layer-00001.safetensors", "blocks.safetensors", "manifest.json"):
        assert first.index(f"wrote gen-000002/{name}") + 1 == first.index(f"fsynced gen-000002/{name}")
    assert first.index("fsynced gen-000002/manifest.json") < first.index("fsynced gen-000002")
    assert points[-1] == "deleted gen-000001"


def _old_is_intact(directory: Path, blocks: SnapshotBlocks) -> None:
    assert sorted(os.listdir(directory)) == ["CURRENT", "gen-000001"]
    assert_same_blocks(load_snapshot(directory).blocks, blocks)


def test_a_failing_reader_leaves_the_old_generation_current_and_nothing_behind(tmp_path: Path) -> None:
    _, old, _ = _save(tmp_path / "s", _config(), 8)
    config = _config()

    def broken(layer: int, rows: np.ndarray) -> torch.Tensor:
        if layer == 1:
            raise RuntimeError("stream worker failed")
        return torch.zeros(2, rows.size, 4, 2, 8, dtype=torch.float16)

    with pytest.raises(RuntimeError, match="stream worker failed"):
        save_snapshot(tmp_path / "s", config, demo_blocks(8, block_size=4, vocab_size=VOCAB), broken)
    _old_is_intact(tmp_path / "s", old)
    wrong = lambda layer, rows: torch.zeros(2, rows.size, 4, 2, 8, dtype=torch.float32)  # noqa: E731
    with pytest.raises(InvalidInput, match=r"must return a torch\.float16 tensor"):
        save_snapshot(tmp_path / "s", config, demo_blocks(8, block_size=4, vocab_size=VOCAB), wrong)
    _old_is_intact(tmp_path / "s", old)


def test_bad_arguments_are_invalid_input_and_write_nothing(tmp_path: Path) -> None:
    blocks = demo_blocks(4, block_size=4, vocab_size=VOCAB)
    reader = tensor_reader(demo_layers(_config(), 4), np.arange(4))
    cases = [
        (_config(storage="none"), blocks, reader, {}),
        (_config(), blocks, None, {}),
        (_config(block_size=8), blocks, reader, {}),
        (_config(), blocks, reader, {"batch_bytes": 0}),
        (_config(vocab_size=10), blocks, reader, {}),
        (_config(), "blocks", reader, {}),
    ]
    for config, record, read, kw in cases:
        with pytest.raises(InvalidInput):
            save_snapshot(tmp_path / "s", config, record, read, **kw)
    assert not (tmp_path / "s").exists()


def test_a_file_where_the_directory_should_be_is_an_io_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    for directory in (tmp_path / "f", tmp_path / "f" / "s"):
        with pytest.raises(SnapshotError) as refused:
            save_demo_snapshot(directory, _config(storage="none"), 3)
        assert refused.value.cause == "io"
    assert (tmp_path / "f").read_text() == "x"


def test_snapshot_error_refuses_an_unknown_cause() -> None:
    with pytest.raises(ValueError, match="unknown snapshot error cause"):
        SnapshotError("bad", "p", "r")


class Stop(Exception):
    """Raised by a progress callback to fail a save at one point."""


def _raise_at(point: str):
    def on_progress(reached: str) -> None:
        if reached == point:
            raise Stop(point)

    return on_progress


@pytest.mark.parametrize("point", ["fsynced gen-000002", "fsynced CURRENT.tmp", "renamed CURRENT", "fsynced directory"])
def test_a_save_failing_after_the_rename_keeps_the_new_generation(tmp_path: Path, point: str) -> None:
    directory = tmp_path / "s"
    _, old, _ = _save(directory, _config(), 6, seed=1)
    with pytest.raises(Stop):
        _save(directory, _config(), 7, seed=2, on_progress=_raise_at(point))
    switched = point in ("renamed CURRENT", "fsynced directory")
    want = demo_blocks(7, block_size=4, vocab_size=VOCAB, seed=2) if switched else old
    assert_same_blocks(load_snapshot(directory).blocks, want)  # CURRENT never names a deleted generation
    assert sorted(os.listdir(directory)) == ["CURRENT", "gen-000001", *(["gen-000002"] if switched else [])]
