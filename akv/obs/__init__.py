"""Observability helpers: logging set-up for applications (akv itself never configures logging)."""

from akv.obs.logging import configure_logging

__all__ = ["configure_logging"]
