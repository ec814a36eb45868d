"""Name -> class registries: the generic `Registry`, and the one for block stores.

What lives here: `Registry` (used by block stores here and by KV strategies in
`kvstrategies.registry`) and the block-store registry with `create_store`. What does not: the
stores themselves (one module each, listed in `_MODULES` so importing the registry stays cheap
until a store is asked for).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .base import BlockStore

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes by their `name`, filled by modules that register themselves when imported."""

    def __init__(self, kind: str, modules: tuple[str, ...]) -> None:
        self.kind, self.modules = kind, modules
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: make `cls` available under `cls.name`."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes and self._classes[name] is not cls:
            raise RuntimeError(f"two {self.kind} classes are named {name!r}")
        self._classes[name] = cls
        return cls

    def _load(self) -> None:
        for module in self.modules:
            importlib.import_module(module)

    def available(self) -> list[str]:
        """Names of the registered classes."""
        self._load()
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class called `name`; a ValueError lists the supported names."""
        self._load()
        try:
            return self._classes[name]
        except KeyError:
            supported = ", ".join(sorted(self._classes))
            raise ValueError(f"unknown {self.kind} {name!r}; supported: {supported}") from None


# A new backend is one file plus a line here.
_stores: Registry[BlockStore] = Registry("block store", ("storage.lmdb_store",))
register = _stores.register
available = _stores.available
get = _stores.get


def create_store(name: str, **kwargs: Any) -> BlockStore:
    """A new store of kind `name` built with `kwargs` (e.g. `create_store("lmdb", path=...)`)."""
    return get(name)(**kwargs)
