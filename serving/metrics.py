"""Prometheus metrics of `unikv serve`, all in one place (documented in docs/serving.md).

Names follow Prometheus conventions: a `unikv_` prefix, base units in the name (`_seconds`,
`_bytes`), `_total` on counters, `_ratio` on shares. Counters and histograms the server updates
as requests run; the gauges (and the counters the pool keeps) are read from the engine's memory
report when Prometheus scrapes, so they are never stale.

What does not live here: HTTP (`serving.app`), the health rules (`serving.health`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from unikv.engine.report import ServedReport

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUS_VALUE = {"green": 0, "yellow": 1, "red": 2}
# Latency buckets from 5 ms to 2 minutes (CPU decode steps are tens of milliseconds).
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Gauges and pool counters read from the engine's memory report at scrape time."""

    def __init__(self, report: Callable[[], ServedReport | None],
                 health: Callable[[], dict]) -> None:  # fmt: skip
        self.report, self.health = report, health

    def describe(self) -> list[Metric]:
        return []  # collected live; nothing to register up front

    def collect(self) -> Iterator[Metric]:
        mem = self.report()
        if mem is not None:  # (None until the engine is up)
            yield from _report_metrics(mem)
        view = self.health()
        yield GaugeMetricFamily(
            "unikv_health_status",
            "Health colour: 0 green, 1 yellow, 2 red.",
            value=STATUS_VALUE[view["status"]],
        )
        yield GaugeMetricFamily(
            "unikv_load_share_ratio",
            "Share of full load the health colour admits.",
            value=view["load_share"],
        )
        if mem is not None and mem.replicas is not None:
            yield from _replica_metrics(mem.replicas, mem.router or {})


def _report_metrics(mem: ServedReport) -> Iterator[Metric]:
    """Queues, KV bytes and usage per tier, the prefix cache and preemptions of a report."""
    counts = mem.requests
    for name, value, doc in (
        ("unikv_requests_running", counts.running, "Requests in the running batch."),
        ("unikv_requests_waiting", counts.waiting, "Requests waiting for admission."),
        ("unikv_requests_swapped", counts.swapped, "Requests swapped out to host."),
    ):
        yield GaugeMetricFamily(name, doc, value=value)
    used = GaugeMetricFamily("unikv_kv_bytes", "KV bytes held per tier.", labels=["tier"])
    usage = GaugeMetricFamily(
        "unikv_kv_usage_ratio", "Share of each tier's blocks in use.", labels=["tier"]
    )
    if mem.pool is not None:
        for tier, t in mem.pool.tiers.items():
            used.add_metric([tier], t.num_used * mem.pool.page_bytes)
            usage.add_metric([tier], t.usage)
    yield used
    yield usage
    yield GaugeMetricFamily(
        "unikv_kv_stored_bytes",
        "KV bytes stored for live sequences (all tiers).",
        value=mem.kv_bytes_used,
    )
    yield CounterMetricFamily(
        "unikv_prefix_cache_queries", "Prefix-cache block lookups.", value=mem.prefix.queries
    )
    yield CounterMetricFamily(
        "unikv_prefix_cache_hits", "Prefix-cache block hits.", value=mem.prefix.hits
    )
    yield CounterMetricFamily(
        "unikv_preemptions",
        "Requests preempted for memory (swapped or recomputed).",
        value=counts.preemptions,
    )
    yield CounterMetricFamily(
        "unikv_ssd_writes_skipped",
        "KV blocks a full or failing SSD tier could not take (they miss later).",
        value=mem.ssd_writes_skipped,
    )


def _replica_metrics(replicas: dict, router: dict) -> Iterator[Metric]:
    """Per-replica readings and the router's counts (`unikv serve --replicas`)."""
    temp = GaugeMetricFamily(
        "unikv_replica_temperature_celsius",
        "Last sensor reading of each replica.",
        labels=["replica"],
    )
    cooling = GaugeMetricFamily(
        "unikv_replica_cooling", "1 while a replica is in a cooling window.", labels=["replica"]
    )
    status = GaugeMetricFamily(
        "unikv_replica_health_status",
        "Replica health colour: 0 green, 1 yellow, 2 red.",
        labels=["replica"],
    )
    moves = CounterMetricFamily(
        "unikv_replica_cooling_transitions",
        "Cooling windows entered and left, per replica.",
        labels=["replica", "direction"],
    )
    inflight = GaugeMetricFamily(
        "unikv_replica_requests_in_flight",
        "Requests in flight on each replica.",
        labels=["replica"],
    )
    hits = CounterMetricFamily(
        "unikv_replica_prefix_cache_hits",
        "Prefix-cache block hits per replica.",
        labels=["replica"],
    )
    for name, r in replicas.items():
        if r.get("temperature_c") is not None:
            temp.add_metric([name], r["temperature_c"])
        cooling.add_metric([name], 1.0 if r.get("cooling") else 0.0)
        status.add_metric([name], STATUS_VALUE.get(r.get("status", "green"), 2))
        moves.add_metric([name, "enter"], r.get("cooling_entered", 0))
        moves.add_metric([name, "leave"], r.get("cooling_left", 0))
        inflight.add_metric([name], r.get("in_flight", 0))
        hits.add_metric([name], r.get("prefix_hits", 0))
    yield from (temp, cooling, status, moves, inflight, hits)
    routed = CounterMetricFamily(
        "unikv_router_decisions",
        "Requests routed, by the rule that chose the replica.",
        labels=["reason"],
    )
    for reason, n in sorted((router.get("decisions") or {}).items()):
        routed.add_metric([reason], n)
    yield routed
    yield CounterMetricFamily(
        "unikv_router_retries",
        "Requests retried on another replica before any text.",
        value=router.get("retried", 0),
    )
    yield CounterMetricFamily(
        "unikv_router_lost_streams",
        "Started streams ended with an error because their replica died.",
        value=router.get("lost_streams", 0),
    )


class ServerMetrics:
    """The server's metrics in a registry of their own (one per app, so tests can run many)."""

    def __init__(self, report: Callable[[], ServedReport | None],
                 health: Callable[[], dict]) -> None:  # fmt: skip
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "unikv_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter("unikv_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "unikv_requests",
            "Requests finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "unikv_requests_rejected",
            "Requests refused before running, by reason.",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "unikv_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "unikv_inter_token_latency_seconds",
            "Time between consecutive streamed pieces.",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "unikv_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY,
            registry=r,
        )
        r.register(_EngineCollector(report, health))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
