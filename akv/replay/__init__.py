"""Trace replay: a continuous-batching scheduler that drives a KVCacheManager with a real trace."""

from akv.replay.scheduler import ReplayOptions, ReplayReport, replay

__all__ = ["ReplayOptions", "ReplayReport", "replay"]
