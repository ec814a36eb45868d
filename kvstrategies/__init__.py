"""KV strategies: the KV seam (`kv`), strategies behind `KVStrategy` composed of three axes
(`formats`, `placement`, `selection`, put together by `composed`), the registry of the four
presets, selection by chip (kv_precision and bandwidth class)."""

from .base import KVStrategy
from .kv import KVCache, KVMemory, KVSpec, StepBatch
from .registry import Built, Plan, available, build, choose, create, get, plan, register, select

__all__ = [
    "Built",
    "KVCache",
    "KVMemory",
    "KVSpec",
    "KVStrategy",
    "Plan",
    "StepBatch",
    "available",
    "build",
    "choose",
    "create",
    "get",
    "plan",
    "register",
    "select",
]
