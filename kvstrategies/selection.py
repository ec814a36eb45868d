"""The `all` selection: every token keeps its KV and every step reads all of it.

What does not live here: the `pruned` selection (prune.py).
"""

from __future__ import annotations

from .axes import SELECTIONS, Selection


@SELECTIONS.register
class AllSelection(Selection):
    """Every token keeps its KV."""

    name = "all"
    help = "every token keeps its KV"
    layer_hooks = False  # nothing to observe or choose
