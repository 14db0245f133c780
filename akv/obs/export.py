"""Exporting a manager's metrics from akv's commands: serve them over HTTP, render them for a file.

For applications (akv's own commands use them); the library itself never
starts a server or writes a file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import generate_latest, start_http_server


@contextmanager
def serve_metrics(registry: Any, port: int, *, addr: str = "127.0.0.1") -> Iterator[int]:
    """Serve ``registry`` in the Prometheus text format on ``http://addr:port/metrics`` while inside.

    Args:
        registry: A ``prometheus_client.CollectorRegistry`` (e.g. ``kv.metrics_registry``).
        port: TCP port; 0 picks a free one.
        addr: Address to bind (default loopback only).

    Yields:
        The port actually bound.
    """
    server, thread = start_http_server(port, addr=addr, registry=registry)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)


def metrics_text(registry: Any) -> bytes:
    """The current values of ``registry`` in the Prometheus text format (UTF-8 bytes)."""
    return generate_latest(registry)
