"""The placement axis: where a strategy's blocks live.

`resident`: every block on the device tier. `tiered`: by recency device -> host -> SSD ->
remote, with the prefetcher and write-through (`offload.TieredPlacement`, a mixin over any
format). What does not live here: the mechanics (offload.py), the formats, the composition.
"""

from __future__ import annotations

from .formats import AxisEntry, lookup

PLACEMENTS: dict[str, AxisEntry] = {
    p.name: p
    for p in (
        AxisEntry("resident", "every block on the device tier"),
        AxisEntry("tiered", "device -> host -> SSD -> remote by recency, prefetched",
                  "unikv.kvstrategies.offload:TieredPlacement"),
    )
}  # fmt: skip


def get(name: str) -> AxisEntry:
    """The placement called `name`; a ValueError lists the placements."""
    return lookup("placement", PLACEMENTS, name)
