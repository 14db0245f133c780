"""The test suite's own settings (tests/conftest.py): hypothesis profiles and the anyio backend switch."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sniffio
from conftest import CI_MAX_EXAMPLES, parse_backends
from hypothesis import settings

PROBE = """
import asyncio
import os

import pytest
import sniffio


def record(name: str) -> None:
    lib = sniffio.current_async_library()
    if lib == "asyncio" and type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        lib = "uvloop"
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(f"{name} {lib}\\n")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_module_choice():
    record("module")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_own_choice(anyio_backend):
    record("own")
"""


def test_hypothesis_profile_in_use_has_no_deadline() -> None:
    # A loaded machine must not fail a test by hypothesis's 200 ms default deadline.
    assert settings.default.deadline is None
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        assert settings.default.derandomize is True
        assert settings.default.database is None
        assert settings.default.max_examples == CI_MAX_EXAMPLES


def test_ci_profile_is_reproducible() -> None:
    ci = settings.get_profile("ci")
    assert (ci.derandomize, ci.deadline, ci.database, ci.max_examples) == (True, None, None, CI_MAX_EXAMPLES)
    dev = settings.get_profile("dev")
    assert (dev.derandomize, dev.deadline) == (False, None)


def test_backend_names_parse_to_anyio_arguments() -> None:
    params = parse_backends("asyncio, trio,uvloop")
    assert [p.values for p in params] == [("asyncio",), ("trio",), (("asyncio", {"use_uvloop": True}),)]
    assert [p.id for p in params] == ["asyncio", "trio", "uvloop"]
    for bad in ("", " , ", "asyncio,tokio", "UVLOOP"):
        with pytest.raises(pytest.UsageError, match="AKV_TEST_BACKENDS"):
            parse_backends(bad)


@pytest.mark.anyio
async def test_anyio_tests_run_on_the_backend_they_are_given(anyio_backend) -> None:
    lib = sniffio.current_async_library()
    if anyio_backend == "trio":
        assert lib == "trio"
    else:
        uvloop = isinstance(anyio_backend, tuple) and anyio_backend[1].get("use_uvloop", False)
        assert lib == "asyncio"
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop") == uvloop


def test_forced_backends_override_module_fixtures_not_marks(tmp_path: Path) -> None:
    # A pytest process of its own (about as long as importing torch) over a
    # probe module with both kinds of backend choice.
    pytest.importorskip("uvloop")
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "ran.txt"
    env = {**os.environ, "PROBE_OUT": str(out), "AKV_TEST_BACKENDS": "asyncio,uvloop"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # hang guard only
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(out.read_text().splitlines()) == ["module asyncio", "module uvloop", "own trio"]
