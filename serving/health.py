"""Admission by the health colour's load share, and which failures count against health.

The colour itself comes from the one health rule (`memory.health`, re-exported here): the
server's view is that rule over the pool's readings (its `signals`) plus what only the server
sees (the request queue, failed requests, kernels on a fallback), so the pool and `/health`
never disagree on the same readings. What does not live here: HTTP (`serving.app`).
"""

from __future__ import annotations

import asyncio
import math

from unikv.memory.health import (
    ABNORMAL,
    NEAR,
    RECENT_S,
    SHARES,
    HealthInputs,
    HealthView,
    Indicator,
    RecentEvents,
    colour,
    evaluate,
)

__all__ = [
    "ABNORMAL",
    "NEAR",
    "RECENT_S",
    "SHARES",
    "Admission",
    "HealthInputs",
    "HealthView",
    "Indicator",
    "RecentEvents",
    "colour",
    "evaluate",
    "service_fault",
]


def service_fault(e: BaseException) -> bool:
    """Whether a request's failure is the service's own, counted against health, rather than
    the client's: a ValueError is bad input, and a client that leaves is no fault either."""
    return not isinstance(e, ValueError | asyncio.CancelledError)


class Admission:
    """How many requests may be in flight: the load share of the full capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    def limit(self, load_share: float) -> int:
        """Requests allowed in flight at this share (at least one, so a red server still
        serves)."""
        return max(1, math.floor(self.capacity * load_share))
