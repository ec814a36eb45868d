"""KV strategies: the KV seam (`kv`); a strategy made of three objects, a format, a placement
and a selection (`axes`), put together by one adapter (`strategy`); the presets as named
triples and the choice by chip (`registry`), any other triple by name (`composed`).

Importing the package registers every axis: a new format, placement or selection is one
module plus its import below.
"""

# Register the axes, in the order they are listed: formats, placements, selections.
# isort: off
from . import full, hybrid  # noqa: F401
from . import placement, offload  # noqa: F401
from . import selection, prune, sparse  # noqa: F401

# isort: on
from .axes import FORMATS, PLACEMENTS, SELECTIONS, Format, Placement, Selection, Step
from .kv import KVCache, KVMemory, KVReport, KVSpec, StepBatch
from .registry import Built, Plan, available, build, choose, create, get, plan, register, select
from .strategy import KVStrategy, Recipe

__all__ = [
    "FORMATS",
    "PLACEMENTS",
    "SELECTIONS",
    "Built",
    "Format",
    "KVCache",
    "KVMemory",
    "KVReport",
    "KVSpec",
    "KVStrategy",
    "Placement",
    "Plan",
    "Recipe",
    "Selection",
    "Step",
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
