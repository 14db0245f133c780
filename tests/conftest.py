"""Shared test settings: hypothesis profiles, the anyio backends and a small-config factory.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, default ``dev``):

- ``dev``: no deadline (a loaded machine must not fail a test), hypothesis's
  default example budget and random search.
- ``ci``: no deadline, ``derandomize=True`` (the same examples on every run
  and machine), a fixed budget of :data:`CI_MAX_EXAMPLES` where a test does not
  set its own, no example database. ``.ci/run`` selects it.

Event-loop backends (``AKV_TEST_BACKENDS``, a comma-separated list of
``asyncio``, ``trio``, ``uvloop``): unset, every ``@pytest.mark.anyio`` test
runs on asyncio, or on the backends its module's own ``anyio_backend``
fixture gives (e.g. ``@pytest.fixture(params=["asyncio", "trio"])``). Set,
it is authoritative: every test that uses the ``anyio_backend`` fixture runs
on exactly the listed backends, module overrides included (``.ci/run`` runs
a uvloop pass this way). Tests that parametrize ``anyio_backend`` themselves
(``@pytest.mark.parametrize``) keep their choice.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from akv.config import KVCacheConfig

#: Examples per hypothesis test in the ``ci`` profile (tests with their own ``max_examples`` keep it).
CI_MAX_EXAMPLES = 100

# derandomize=False explicitly: hypothesis derandomizes its default settings when it sees a CI
# environment variable, and dev (random search, no deadline) must mean the same everywhere.
settings.register_profile("dev", deadline=None, derandomize=False)
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=CI_MAX_EXAMPLES, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

#: anyio's backend argument for each name ``AKV_TEST_BACKENDS`` accepts.
_BACKEND_ARGS: dict[str, object] = {
    "asyncio": "asyncio",
    "trio": "trio",
    "uvloop": ("asyncio", {"use_uvloop": True}),
}


def parse_backends(spec: str) -> list:
    """``pytest.param`` per backend named in ``spec`` (e.g. ``"asyncio,uvloop"``), ids the names.

    Raises:
        pytest.UsageError: ``spec`` names no backend or one anyio does not know.
    """
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in _BACKEND_ARGS]
    if not names or unknown:
        raise pytest.UsageError(
            f"AKV_TEST_BACKENDS={spec!r}: expected a comma-separated list of {', '.join(_BACKEND_ARGS)}"
        )
    return [pytest.param(_BACKEND_ARGS[name], id=name) for name in names]


#: Backends from ``AKV_TEST_BACKENDS``, or ``None`` when it is unset (each module chooses).
FORCED_BACKENDS = parse_backends(os.environ["AKV_TEST_BACKENDS"]) if os.environ.get("AKV_TEST_BACKENDS") else None


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With ``AKV_TEST_BACKENDS`` set, parametrize ``anyio_backend`` with it, over any fixture's params."""
    if FORCED_BACKENDS is None or "anyio_backend" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "anyio_backend" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return  # the test chose its backends itself
    # A marker rather than metafunc.parametrize: pytest then skips the fixture's own params.
    metafunc.definition.add_marker(pytest.mark.parametrize("anyio_backend", FORCED_BACKENDS))


@pytest.fixture
def anyio_backend() -> str:
    """Run ``@pytest.mark.anyio`` tests on asyncio (the backend akv is built for) unless forced otherwise."""
    return "asyncio"


# Where akv's modules live (found without importing akv: this conftest stays light).
_AKV_DIR = importlib.util.find_spec("akv").submodule_search_locations[0] + os.sep


def count_line_events(fn: Callable[[], object]) -> int:
    """Run ``fn()`` and count the source lines the interpreter executed in akv's own modules.

    A deterministic measure of work, independent of machine speed and load:
    an O(n) Python-level scan (a loop, a comprehension or a generator over n
    items) adds about n events, since every iteration re-enters its line.
    Work done inside C (numpy, ``dict``, ``list.remove``) counts as the one
    line that calls it.

    Args:
        fn: The operations to measure (called once, in this thread).

    Returns:
        The number of ``line`` trace events in files under the ``akv`` package.
    """
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> Callable | None:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def scope(frame: FrameType, event: str, arg: object) -> Callable | None:
        return local if frame.f_code.co_filename.startswith(_AKV_DIR) else None

    previous = sys.gettrace()
    sys.settrace(scope)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


@pytest.fixture
def line_events() -> Callable[[Callable[[], object]], int]:
    """:func:`count_line_events`, for tests that check a complexity claim by counting work."""
    return count_line_events


@pytest.fixture
def tiny_config() -> Callable[..., KVCacheConfig]:
    """Factory of small configs with real CPU tensors (tiny model, block_size 4, invariants checked).

    The eviction loop is off by default (``low_watermark=0``: the free fraction
    is never below 0), so eviction only happens on demand and tests can assert
    exact eviction order; pass watermarks to turn it on.
    """

    from akv.config import KVCacheConfig

    def make(**overrides) -> KVCacheConfig:
        fields = {
            "num_blocks": 16,
            "block_size": 4,
            "vocab_size": 1000,
            "debug_invariants": True,
            "low_watermark": 0.0,
            "high_watermark": 0.0,
        }
        fields.update(overrides)
        return KVCacheConfig(**fields)

    return make


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """Restore structlog's defaults after a test that configured logging (``akv.cli.main`` does).

    A level filter left behind by one test (the CLI's ``--log-level``) would
    hide the info events a later test captures with ``structlog.testing.capture_logs``.
    """
    import structlog

    before = structlog.get_config()
    yield
    if structlog.get_config() != before:
        structlog.reset_defaults()
