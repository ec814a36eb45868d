"""The attention + MoE engine and its async API.

`from unikv.engine import Engine, SamplingParams` is the public entry point (imported on first
use, so the command line starts without loading torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine
    from .sampling import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
