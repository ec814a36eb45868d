"""unikv's routing policy (`serving.routing`) as a Ray Serve request router.

Ray Serve builds one router per deployment handle, in the process that holds the handle (the
HTTP front of `unikv serve --replicas`), and calls `choose_replicas` for every request. This
adapter turns Ray's replicas into `ReplicaState`s from what each replica last reported through
`record_routing_stats` (`serving.replicas.EngineReplica`) and from Ray's own count of requests
in flight on it, asks the policy for ranks, and tells the policy where each request went.

Selected with `RequestRouterConfig(request_router_class="unikv.serving.ray_router:UnikvRouter")`.
Ray pickles this module by value to ship the class, so it keeps no state of its own at module
level: the live router registers itself in `serving.routing` (`routing.current()`), where the
front finds it.
"""

from __future__ import annotations

from . import routing
from .routing import ReplicaState, RoutingPolicy

try:
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError:  # no 'replicas' extra: nothing builds these routers then (Ray Serve would)
    RequestRouter = PowerOfTwoChoicesRequestRouter = object  # type: ignore[assignment,misc]


def request_hashes(pending: PendingRequest | None) -> list[bytes]:
    """The leading block hashes the front put in the request's payload (none: no affinity)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []
    return list(pending.args[0].get("prefix_hashes") or ())


class _Reports:
    """What the front reads from the router in its process: each replica's last report."""

    def replica_stats(self) -> dict[str, dict]:
        """Each live replica's last report, with Ray's count of its requests in flight."""
        out = {}
        for rid, r in list(self.curr_replicas.items()):
            stats = dict(r.routing_stats or {})
            stats["in_flight"] = self._queue(r, stats)
            out[rid.unique_id] = stats
        return out

    def _queue(self, r: RunningReplica, stats: dict) -> int:
        cached = self.replica_queue_len_cache.get(r.replica_id)
        return int(cached) if cached is not None else int(stats.get("queue", 0))


class PowerOfTwoRouter(_Reports, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router, unchanged (the baseline of benchmarks/replicas.py), plus the
    registration through which the front reads the replicas' reports."""

    policy = None  # no unikv policy: no decisions to count

    def initialize_state(self, **kwargs: object) -> None:
        super().initialize_state(**kwargs)
        routing.register(self)


class UnikvRouter(_Reports, RequestRouter):
    """Health share, then prefix affinity, then queue length (see `serving.routing`)."""

    def initialize_state(self, imbalance: int = 2, window: int = 50, **_: object) -> None:
        self.policy = RoutingPolicy(imbalance=imbalance, window=window)
        self._hash_sets: dict[str, tuple[int, frozenset[bytes]]] = {}
        self._asked: dict[str, tuple[list[bytes], str]] = {}
        routing.register(self)

    # ---- Ray's hooks ---------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        hashes = request_hashes(pending_request)
        decision = self.policy.rank([self._state(r) for r in candidate_replicas], hashes)
        if pending_request is not None:
            rid = pending_request.metadata.internal_request_id
            self._asked[rid] = (hashes, decision.reason)
        return [[by_id[i] for i in rank if i in by_id] for rank in decision.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        hashes, reason = self._asked.pop(
            pending_request.metadata.internal_request_id, ([], "queue")
        )
        self.policy.routed(replica_id.unique_id, hashes, reason)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self._hash_sets.pop(replica_id.unique_id, None)

    # ---- helpers -------------------------------------------------------------------------------

    def _state(self, r: RunningReplica) -> ReplicaState:
        stats = r.routing_stats or {}
        uid = r.replica_id.unique_id
        seq = stats.get("seq", -1)
        known = self._hash_sets.get(uid)
        if known is None or known[0] != seq:  # a new report: decode its hashes once
            known = (seq, frozenset(bytes.fromhex(h) for h in stats.get("hashes", ())))
            self._hash_sets[uid] = known
        return ReplicaState(
            id=uid,
            status=stats.get("status", "green"),
            cooling=bool(stats.get("cooling", False)),
            queue=self._queue(r, stats),
            hashes=known[1],
        )
