"""Tests of serving.routing: the replica ranking (health share, prefix affinity, queue length),
without Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from unikv.serving.routing import ReplicaState, RoutingPolicy

H = [bytes([i]) * 8 for i in range(8)]  # a request's leading block hashes


def route(policy: RoutingPolicy, replicas: list[ReplicaState], hashes=H) -> str:
    """Rank, take the first choice as Ray would (shortest queue in the first rank), record."""
    d = policy.rank(replicas, hashes)
    by_id = {r.id: r for r in replicas}
    first = min(d.ranks[0], key=lambda i: by_id[i].queue)
    policy.routed(first, hashes, d.reason)
    by_id[first].queue += 1
    return first


def test_affinity_prefers_the_replica_holding_the_prefix():
    a = ReplicaState("a", queue=1, hashes=frozenset(H[:3]))
    b = ReplicaState("b", queue=0, hashes=frozenset(H[:1]))
    d = RoutingPolicy().rank([a, b], H)
    assert d.ranks[0] == ["a"] and d.reason == "affinity" and d.matched_blocks == 3
    assert d.ranks[1] == ["b"]


def test_affinity_stops_at_the_first_missing_block():
    a = ReplicaState("a", hashes=frozenset(H[1:]))  # everything but the first block
    b = ReplicaState("b", queue=2)
    d = RoutingPolicy().rank([a, b], H)
    assert d.reason == "queue" and d.ranks == [["a"], ["b"]]


def test_what_was_sent_counts_before_the_replica_reports_it():
    p = RoutingPolicy()
    a, b = ReplicaState("a"), ReplicaState("b")
    first = route(p, [a, b])
    a.queue = b.queue = 0
    assert route(p, [a, b]) == first  # the second request follows the first
    p.forget(first)
    assert p.rank([a, b], H).reason == "queue"


def test_imbalance_threshold_sends_work_elsewhere():
    a = ReplicaState("a", queue=5, hashes=frozenset(H))
    b = ReplicaState("b", queue=0)
    d = RoutingPolicy(imbalance=4).rank([a, b], H)
    assert d.reason == "queue" and d.ranks[0] == ["b"]
    a.queue = 4
    assert RoutingPolicy(imbalance=4).rank([a, b], H).ranks[0] == ["a"]


def test_cooling_replica_gets_nothing_even_with_the_prefix():
    a = ReplicaState("a", cooling=True, hashes=frozenset(H))
    b = ReplicaState("b", queue=10)
    p = RoutingPolicy()
    for _ in range(20):
        assert route(p, [a, b]) == "b"


def test_all_cooling_still_serves():
    a, b = ReplicaState("a", cooling=True), ReplicaState("b", cooling=True, queue=3)
    d = RoutingPolicy().rank([a, b], H)
    assert d.reason == "all_held" and d.ranks[0] == ["a"]


@pytest.mark.parametrize(("status", "weight"), [("red", 0.3), ("yellow", 0.8)])
def test_non_green_replica_gets_only_its_share(status, weight):
    # The sick replica holds the prefix, so affinity alone would send it everything.
    sick = ReplicaState("sick", status=status, hashes=frozenset(H))
    well = ReplicaState("well")
    p = RoutingPolicy(window=50)
    n = 200
    counts = Counter()
    for _ in range(n):
        counts[route(p, [sick, well])] += 1
        sick.queue = well.queue = 0  # requests finish between arrivals
    share = weight / (weight + 1.0)
    assert counts["sick"] / n == pytest.approx(share, abs=0.03)
    assert counts["sick"] + counts["well"] == n


def test_only_unhealthy_replicas_still_serve():
    a, b = ReplicaState("a", status="red"), ReplicaState("b", status="red")
    p = RoutingPolicy()
    seen = {route(p, [a, b]) for _ in range(10)}
    assert seen <= {"a", "b"} and seen


def test_queue_order_without_a_prefix():
    reps = [ReplicaState("a", queue=3), ReplicaState("b", queue=1), ReplicaState("c", queue=2)]
    d = RoutingPolicy().rank(reps, [])
    assert d.ranks == [["b"], ["c"], ["a"]] and d.reason == "queue"


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="imbalance"):
        RoutingPolicy(imbalance=-1)
    assert RoutingPolicy().rank([], H).ranks == []


async def test_the_engine_and_the_replica_client_serve_through_one_protocol(model, tokenizer):
    """Issue 32: the server depends on `ServedEngine`, which both implement, and on nothing
    else of either (no private attribute, no monkeypatching)."""
    import inspect

    from unikv.engine.engine import Engine, ServedEngine
    from unikv.serving.replicas import ReplicaClient

    engine = Engine(model, tokenizer)
    info = {"context_length": 2048, "block_size": 16, "identity": "x", "max_batch": 4,
            "kv_choice": "full"}  # fmt: skip
    client = ReplicaClient(None, info, tokenizer, replicas=2)
    try:
        for served in (engine, client):
            assert isinstance(served, ServedEngine)
            params = inspect.signature(served.submit).parameters
            assert params["priority"].kind is inspect.Parameter.KEYWORD_ONLY
        assert client.max_batch == 8  # before any report: 4 per replica
    finally:
        await engine.close()
