"""The `resident` placement: every block on the device tier.

Prefixes are shared through the pool's prefix cache (device blocks, and host blocks the pool
revives) and, with an SSD tier, across processes through the pool's persistence service
(`memory.persistence`): a prefill's blocks are written through by content, and a later prompt's
stored blocks (the SSD tier's, or the remote tier's copied into it) are *loaded into device
blocks* when attached, since a resident cache attends only what the device holds. Swapping out
moves a sequence's blocks to the host tier. What does not live here: the `tiered` placement
(offload.py), which reads stored blocks where they are.
"""

from __future__ import annotations

import logging

from unikv.memory.tiers import TierKind

from .axes import PLACEMENTS, Placement

log = logging.getLogger(__name__)


@PLACEMENTS.register
class ResidentPlacement(Placement):
    """Every block on the device tier."""

    name = "resident"
    help = "every block on the device tier"
    layer_hooks = False  # every block is read where it is: nothing to stage per layer

    def _attach_stored(self, seq_id: int, first: int, hashes: list[bytes]) -> int:
        """Attach the stored blocks, then load them into device blocks (read once, here,
        before the step); with no room on the device the whole prefix is recomputed."""
        n = super()._attach_stored(seq_id, first, hashes)
        loaded = list(range(first, first + len(hashes)))
        try:
            moved = self.pool.move(seq_id, loaded, TierKind.DEVICE, relocate_cache=True)
        except OSError as e:  # a lost or corrupt stored value (BlockLostError), a failing disk
            log.warning("%s: stored prefix not loaded (%s); recomputing it", self.label, e)
            moved = False
        if not moved:
            self.pool.free(seq_id)
            self.persistence.hits["skipped_no_room"] = (
                self.persistence.hits.get("skipped_no_room", 0) + 1
            )
            return 0
        return n
