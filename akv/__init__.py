"""akv: a paged KV cache manager for LLM inference, driven by asyncio actors.

The public entry point is :class:`KVCacheManager` with a :class:`KVCacheConfig`.
"""

from akv.config import MODEL_SHAPES, KVCacheConfig, ModelShape, model_shape
from akv.core.step import Admit
from akv.manager import KVCacheManager
from akv.results import BlockInfo, CacheStats, CopyCompletion, StepResult

__all__ = [
    "MODEL_SHAPES",
    "Admit",
    "BlockInfo",
    "CacheStats",
    "CopyCompletion",
    "KVCacheConfig",
    "KVCacheManager",
    "ModelShape",
    "StepResult",
    "model_shape",
]
__version__ = "0.1.0"
