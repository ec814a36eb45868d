"""Which replica serves a request: health share first, then prefix affinity, then queue length.

This is the policy of unikv's Ray Serve request router (`serving.ray_router` adapts it to Ray's
`RequestRouter`); it imports nothing from Ray, so it is tested in milliseconds.

1. **Health.** A cooling replica (`serving.cooling`) gets no new request. The others get at most
   their share of the traffic, by the colour of their health view: weight 1.0 green, 0.8 yellow,
   0.3 red (`serving.health.SHARES`), share = weight / sum of the weights of the replicas not
   cooling. A non-green replica whose count among the last `window` routed requests would pass
   its share is held back for this request. Green replicas take the rest, uncapped. If every
   replica is cooling or held back, all of them are candidates again: service never stops.
2. **Prefix affinity.** Among the candidates, the replica whose prefix cache holds the most of
   the request's leading blocks, by the pool's chained content hashes (the replicas report
   their newest cached hashes; the policy also remembers what it sent where, since reports are
   periodic), unless its queue is longer than the shortest queue by more than `imbalance`
   (default 2: a CPU replica runs a handful of requests at once, and two more ahead of a request
   cost about what recomputing a long prefix does; SGLang's cache-aware router scales the same
   rule to GPU batches with 64).
3. **Queue length.** Otherwise (no match, or too busy), the candidates by queue length; equal
   queues by how few of the last `window` requests each was sent.

The ranks returned are what Ray's router tries in order (within a rank, the shortest queue).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .health import SHARES


@dataclass(slots=True)
class ReplicaState:
    """What the policy knows of one replica."""

    id: str
    status: str = "green"  # its health colour
    cooling: bool = False
    queue: int = 0  # requests in flight on it (running + waiting)
    hashes: frozenset[bytes] = field(default_factory=frozenset)  # cached block hashes reported


@dataclass(frozen=True, slots=True)
class Decision:
    """The ranks for one request and why the first one was chosen."""

    ranks: list[list[str]]
    reason: str  # "affinity", "queue", "all_held" (every replica cooling or over its share)
    matched_blocks: int  # leading blocks of the request cached on the first choice


class RoutingPolicy:
    """unikv's ranking of replicas (rules in the module docstring)."""

    def __init__(self, imbalance: int = 2, window: int = 50, remember: int = 4096) -> None:
        if imbalance < 0 or window < 1 or remember < 0:
            raise ValueError(
                f"imbalance >= 0, window >= 1, remember >= 0 expected; got {imbalance}, "
                f"{window}, {remember}"
            )
        self.imbalance, self.remember = imbalance, remember
        self.recent: deque[str] = deque(maxlen=window)  # replicas of the last routed requests
        self._sent: dict[str, OrderedDict[bytes, None]] = {}  # hashes routed to each replica
        self.decisions: Counter[str] = Counter()

    # ---- the ranking ---------------------------------------------------------------------------

    def rank(self, replicas: Sequence[ReplicaState], hashes: Sequence[bytes]) -> Decision:
        """Ranks of replica ids for a request whose leading block hashes are `hashes`."""
        if not replicas:
            return Decision([], "none", 0)
        candidates = self._by_health(replicas)
        reason = "all_held" if candidates is None else ""
        if candidates is None:
            candidates = list(replicas)
        shortest = min(r.queue for r in candidates)
        best, matched = None, 0
        for r in candidates:
            m = self._matched(r, hashes)
            if m > matched or (m == matched and m and best is not None and r.queue < best.queue):
                best, matched = r, m
        # Equal queues go to the replica routed to least lately (a replica back from cooling
        # is not left idle behind one that always comes first).
        by_queue = sorted(candidates, key=lambda r: (r.queue, self.recent.count(r.id)))
        if best is not None and best.queue <= shortest + self.imbalance:
            rest = [r.id for r in by_queue if r is not best]
            ranks = [[best.id]] + ([rest] if rest else [])
            return Decision(ranks, reason or "affinity", matched)
        # Each replica its own rank: Ray then tries them shortest queue first.
        return Decision([[r.id] for r in by_queue], reason or "queue", 0)

    def _by_health(self, replicas: Sequence[ReplicaState]) -> list[ReplicaState] | None:
        """The replicas that may take this request by health, or None when none may."""
        warm = [r for r in replicas if not r.cooling]
        total = sum(SHARES.get(r.status, SHARES["red"]) for r in warm)
        n = len(self.recent) + 1
        allowed = []
        for r in warm:
            weight = SHARES.get(r.status, SHARES["red"])
            if weight >= 1.0 or self.recent.count(r.id) + 1 <= weight / total * n:
                allowed.append(r)
        return allowed or None

    def _matched(self, r: ReplicaState, hashes: Sequence[bytes]) -> int:
        sent = self._sent.get(r.id, {})
        n = 0
        for h in hashes:
            if h not in r.hashes and h not in sent:
                break
            n += 1
        return n

    # ---- what happened -------------------------------------------------------------------------

    def routed(self, replica_id: str, hashes: Sequence[bytes], reason: str) -> None:
        """Record that a request with leading block hashes `hashes` went to `replica_id`."""
        self.recent.append(replica_id)
        self.decisions[reason] += 1
        if not self.remember:
            return
        sent = self._sent.setdefault(replica_id, OrderedDict())
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.remember:
            sent.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """A replica is gone (died, or restarted with an empty cache)."""
        self._sent.pop(replica_id, None)


# ---- the live router of this process ------------------------------------------------------------

_lock = threading.Lock()
_routers: list[weakref.ref] = []


def register(router: object) -> None:
    """Note a router built in this process (Ray Serve builds it inside the deployment handle)."""
    with _lock:
        _routers[:] = [r for r in _routers if r() is not None] + [weakref.ref(router)]


def current() -> object | None:
    """The newest live router in this process: the front reads the replicas' reports from it."""
    with _lock:
        for ref in reversed(_routers):
            router = ref()
            if router is not None:
                return router
    return None
