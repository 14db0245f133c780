"""asyncio actors on anyio: runtime, prefix tree, pool shards, eviction loop (stream worker lives in akv.storage)."""
