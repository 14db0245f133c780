"""``akv snapshot info | verify | demo``: output, exit codes, one line and no traceback on a refused snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from akv.cli import main
from tests.test_replay import restore_logging

__all__ = ["restore_logging"]  # the fixture, imported for its use here


@pytest.fixture
def snapshot(tmp_path: Path, restore_logging, capsys) -> Path:
    directory = tmp_path / "s"
    assert main(["snapshot", "demo", str(directory), "--blocks", "50", "--block-size", "4"]) == 0
    capsys.readouterr()
    return directory


def test_info_prints_and_json(snapshot: Path, capsys) -> None:
    assert main(["snapshot", "info", str(snapshot)]) == 0
    out = capsys.readouterr().out
    assert "generation 1" in out and "50 blocks, storage tensors" in out and "model tiny" in out
    assert main(["snapshot", "info", str(snapshot), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["generation"], info["num_blocks"], info["fingerprint"]["block_size"]) == (1, 50, 4)


def test_verify_valid_is_exit_0(snapshot: Path, capsys) -> None:
    assert main(["snapshot", "verify", str(snapshot)]) == 0
    assert "valid, generation 1, 50 blocks" in capsys.readouterr().out
    assert main(["snapshot", "verify", str(snapshot), "--model", "tiny", "--block-size", "4"]) == 0


def _one_line_exit_2(argv: list[str], capsys, cause: str) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"akv snapshot: error: snapshot {cause}: ")
    return lines[0]


def test_verify_refused_is_exit_2_with_the_cause_in_one_line(snapshot: Path, capsys) -> None:
    layer = snapshot / "gen-000001" / "layer-00000.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 1
    layer.write_bytes(bytes(data))
    line = _one_line_exit_2(["snapshot", "verify", str(snapshot)], capsys, "corrupt")
    assert str(layer) in line and "checksum of its v" in line


def test_verify_foreign_names_the_fields(snapshot: Path, capsys) -> None:
    line = _one_line_exit_2(["snapshot", "verify", str(snapshot), "--model", "tiny"], capsys, "foreign")
    assert "block_size 4 (expected 16)" in line


def test_missing_directory_is_exit_2(tmp_path: Path, capsys, restore_logging) -> None:
    for action in ("info", "verify"):
        _one_line_exit_2(["snapshot", action, str(tmp_path / "absent")], capsys, "missing")


def test_demo_into_a_file_is_exit_2(tmp_path: Path, capsys, restore_logging) -> None:
    (tmp_path / "f").write_text("x")
    _one_line_exit_2(["snapshot", "demo", str(tmp_path / "f"), "--storage", "none"], capsys, "io")
