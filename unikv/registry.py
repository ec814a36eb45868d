"""Name -> class registries, for every plug point: a registry lists the modules that register
its classes when imported, so asking for a name imports them (and a module whose optional
dependency is missing is left out and named when its name is asked for).

Used by the block stores (`unikv.storage.registry`) and the KV strategies
(`unikv.kvstrategies.registry`). It sits at the root of the namespace because every floor may
use it; it imports nothing of unikv (a contract in pyproject.toml says so).
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes by their `name`, filled by modules that register themselves when imported."""

    def __init__(self, kind: str, modules: tuple[str, ...]) -> None:
        self.kind, self.modules = kind, modules
        self._classes: dict[str, type[T]] = {}
        # Modules whose optional dependency is not installed -> what to install (their
        # ImportError's message), named when a class they would register is asked for.
        self.missing: dict[str, str] = {}

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: make `cls` available under `cls.name`."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes and self._classes[name] is not cls:
            raise RuntimeError(f"two {self.kind} classes are named {name!r}")
        self._classes[name] = cls
        return cls

    def _load(self) -> None:
        for module in self.modules:
            if module in self.missing:
                continue
            try:
                importlib.import_module(module)
            except ImportError as e:
                self.missing[module] = str(e)

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
            absent = "".join(f"; not installed: {why}" for why in self.missing.values())
            raise ValueError(
                f"unknown {self.kind} {name!r}; supported: {supported}{absent}"
            ) from None
