"""Trace replay: a continuous-batching scheduler that drives a KVCacheManager with a real trace."""

from akv.replay.options import ReplayOptions, ReplayReport
from akv.replay.scheduler import replay

__all__ = ["ReplayOptions", "ReplayReport", "replay"]
