"""Pure, synchronous data structures (no asyncio, no torch): block pool, radix tree, sequences, shard state."""
