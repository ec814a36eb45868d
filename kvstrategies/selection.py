"""The selection axis: which tokens keep KV.

`all`: every token. `pruned`: a scorer (the learned head or a baseline) ranks tokens, the
lowest lose their KV and the cache is compacted (`prune.PrunedSelection`, a mixin over any
format). What does not live here: the mechanics (prune.py), the formats, the composition.
"""

from __future__ import annotations

from .formats import AxisEntry, lookup

SELECTIONS: dict[str, AxisEntry] = {
    s.name: s
    for s in (
        AxisEntry("all", "every token keeps its KV"),
        AxisEntry("pruned", "a scorer evicts the lowest ranked tokens; compacted",
                  "unikv.kvstrategies.prune:PrunedSelection"),
    )
}  # fmt: skip


def get(name: str) -> AxisEntry:
    """The selection called `name`; a ValueError lists the selections."""
    return lookup("selection", SELECTIONS, name)
