"""The unified memory pool's pure-Python core: allocation, prefix caching, stats and config.

Re-exports the public API of `memory.allocator`, `memory.prefix`, `memory.stats`,
`memory.config` and `memory.profiles`. Nothing here imports torch; the torch arenas and the
pool built on them live in their own modules.
"""

from unikv.memory.allocator import SHARED, Block, BlockTable, FreeBlockQueue, TierAllocator
from unikv.memory.config import (
    TIER_ORDER,
    ConfigError,
    MoEOptions,
    PoolConfig,
    SchedulerOptions,
    TierConfig,
    load_config,
    parse_size,
)
from unikv.memory.prefix import BlockRef, PrefixCache, block_hash, chain_hashes
from unikv.memory.profiles import (
    ChipProfile,
    TunedParams,
    bandwidth_class,
    choose_topk,
    format_report,
    list_profiles,
    load_profile,
    measure_host_bandwidth,
    profile_report,
)
from unikv.memory.stats import (
    Health,
    HealthMonitor,
    HealthReport,
    OomPredictor,
    OomWarning,
    PoolStats,
)

__all__ = [
    "SHARED",
    "TIER_ORDER",
    "Block",
    "BlockRef",
    "BlockTable",
    "ChipProfile",
    "ConfigError",
    "FreeBlockQueue",
    "Health",
    "HealthMonitor",
    "HealthReport",
    "MoEOptions",
    "SchedulerOptions",
    "OomPredictor",
    "OomWarning",
    "PoolConfig",
    "PoolStats",
    "PrefixCache",
    "TierAllocator",
    "TierConfig",
    "TunedParams",
    "bandwidth_class",
    "block_hash",
    "chain_hashes",
    "choose_topk",
    "format_report",
    "list_profiles",
    "load_config",
    "load_profile",
    "measure_host_bandwidth",
    "parse_size",
    "profile_report",
]
