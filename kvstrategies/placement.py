"""The `resident` placement: every block on the device tier.

Prefixes are shared through the pool's prefix cache (device blocks, and host blocks the pool
revives); swapping out moves a sequence's blocks to the host tier. All of it is `Placement`'s
default behaviour. What does not live here: the `tiered` placement (offload.py).
"""

from __future__ import annotations

from .axes import PLACEMENTS, Placement


@PLACEMENTS.register
class ResidentPlacement(Placement):
    """Every block on the device tier."""

    name = "resident"
    help = "every block on the device tier"
