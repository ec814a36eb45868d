"""The unified memory pool's pure-Python core: allocation, prefix caching and statistics.

Re-exports the public API of `memory.allocator`, `memory.prefix` and `memory.stats`. Nothing
here imports torch; the torch arenas and the pool built on them live in their own modules. The
pool's settings (config files, chip profiles) live a floor below, in `unikv.settings`.
"""

from unikv.memory.allocator import SHARED, Block, BlockTable, FreeBlockQueue, TierAllocator
from unikv.memory.health import HealthInputs, HealthView, evaluate
from unikv.memory.prefix import BlockRef, PrefixCache, block_hash, chain_hashes
from unikv.memory.stats import (
    HealthMonitor,
    OomPredictor,
    OomWarning,
    PoolCounters,
    PoolReport,
    PoolStats,
    PrefixCounts,
    TierUsage,
)

__all__ = [
    "SHARED",
    "Block",
    "BlockRef",
    "BlockTable",
    "FreeBlockQueue",
    "HealthInputs",
    "HealthMonitor",
    "HealthView",
    "OomPredictor",
    "OomWarning",
    "PoolCounters",
    "PoolReport",
    "PoolStats",
    "PrefixCache",
    "PrefixCounts",
    "TierAllocator",
    "TierUsage",
    "block_hash",
    "chain_hashes",
    "evaluate",
]
