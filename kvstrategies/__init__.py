"""KV strategies: the KV seam (`kv`), one file per strategy behind `KVStrategy`, a registry,
selection by bandwidth class."""

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
