"""Actors on anyio: the runtime, pool shards (each owning its blocks' prefix tree), the eviction loop.

The stream worker lives in :mod:`akv.storage`.
"""
