"""KV strategies: one file per strategy behind `KVStrategy`, a registry, selection by class."""

from .base import KVSpec, KVStrategy
from .registry import Built, available, build, choose, create, get, register, select

__all__ = [
    "Built",
    "KVSpec",
    "KVStrategy",
    "available",
    "build",
    "choose",
    "create",
    "get",
    "register",
    "select",
]
