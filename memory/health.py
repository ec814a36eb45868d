"""The one health rule: indicators, each normal, near its limit or abnormal, and the colour.

Every health answer in unikv comes from `evaluate` here: the pool's (`UnifiedMemoryPool.health`,
from what the pool alone measures) and the server's `/health` (the pool's readings plus the
request queue, failed requests and kernel fallbacks). So the two never disagree on the same
readings.

| indicator | near its limit | abnormal |
|---|---|---|
| KV memory (device tier) | ≥ 85% used | ≥ 95% used |
| waiting queue | ≥ 50% of `max_waiting` | ≥ 90% |
| preemptions | one in the last minute | ≥ 10 in the last minute |
| failed requests (engine errors) | one in the last minute | ≥ 5 in the last minute |
| stored KV integrity | | a checksum failure in the last minute |
| OOM predictor | | it fired in the last minute (red on its own) |
| store tiers' health | a tier reports a problem (e.g. a remote tier skipped) | |
| kernels | an operator runs on a fallback | |

Green: every indicator normal, full load (share 1.0). Yellow: one or two indicators off, 80% of
the load (share 0.8). Red: three or more off, or the OOM predictor firing: 30% (share 0.3).
A checksum failure alone is yellow, not red: the value was detected, deleted and recomputed,
never served; what it says is that a store needs looking at, not that the server must shed
load. The share is enforced by the server's admission (`serving.health.Admission`).

What does not live here: the counters and the OOM predictor (`memory.stats`), admission and
HTTP (`serving/`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

NEAR, ABNORMAL = "near", "abnormal"
SHARES = {"green": 1.0, "yellow": 0.8, "red": 0.3}
RECENT_S = 60.0
KV_NEAR, KV_ABNORMAL = 0.85, 0.95  # device tier usage


@dataclass(frozen=True, slots=True)
class Indicator:
    """One indicator's state ("normal" | "near" | "abnormal") and the sentence that explains it."""

    name: str
    state: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HealthView:
    """The colour, the load share it sets and the reasons, in plain words."""

    status: str
    load_share: float
    reasons: tuple[str, ...]
    indicators: tuple[Indicator, ...]

    def as_dict(self) -> dict:
        """The `/health` body."""
        return {
            "status": self.status,
            "load_share": self.load_share,
            "reasons": list(self.reasons),
            "indicators": {i.name: i.state for i in self.indicators},
        }


def colour(indicators: list[Indicator], oom_firing: bool) -> HealthView:
    """Green / yellow / red from the indicators (rules in the module docstring)."""
    off = [i for i in indicators if i.state != "normal"]
    if oom_firing or len(off) >= 3:
        status = "red"
    elif off:
        status = "yellow"
    else:
        status = "green"
    reasons = tuple(i.reason for i in off)
    return HealthView(status, SHARES[status], reasons, tuple(indicators))


class RecentEvents:
    """Timestamps of events (preemptions, failures) kept for `RECENT_S`."""

    def __init__(self, clock=time.monotonic, window_s: float = RECENT_S) -> None:
        self.clock, self.window_s = clock, window_s
        self._times: deque[float] = deque()

    def add(self, n: int = 1) -> None:
        """Record `n` events now."""
        t = self.clock()
        self._times.extend([t] * n)

    def count(self) -> int:
        """Events within the last `window_s` seconds."""
        cutoff = self.clock() - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
        return len(self._times)


@dataclass(frozen=True, slots=True)
class HealthInputs:
    """What the health rule reads: the pool's readings (`PoolSignals`), and the server's."""

    device_usage: float
    waiting: int = 0
    max_waiting: int = 0
    preemptions_recent: int = 0
    failures_recent: int = 0
    oom_firing: bool = False
    checksum_failure: bool = False
    tier_problems: tuple[str, ...] = field(default_factory=tuple)
    operator_fallbacks: tuple[str, ...] = field(default_factory=tuple)  # kernels on a fallback


def _grade(name: str, abnormal: bool, near: bool, reason: str) -> Indicator:
    """One indicator: abnormal, near its limit, or normal (the reason only when not)."""
    if abnormal:
        return Indicator(name, ABNORMAL, reason)
    return Indicator(name, NEAR, reason) if near else Indicator(name, "normal")


def evaluate(x: HealthInputs) -> HealthView:
    """The health view for one set of readings (thresholds in the module docstring)."""
    u, w, m = x.device_usage, x.waiting, x.max_waiting
    queue = w / m if m else 0.0
    p, f = x.preemptions_recent, x.failures_recent
    kv_word = "full" if u >= KV_ABNORMAL else "almost full"
    q_word = "full" if queue >= 0.9 else "filling"
    ind = [
        _grade("kv_memory", u >= KV_ABNORMAL, u >= KV_NEAR,
               f"KV memory {kv_word}: {u:.0%} of the device tier"),
        _grade("queue", queue >= 0.9, queue >= 0.5,
               f"request queue {q_word}: {w} waiting of {m} allowed"),
        _grade("preemptions", p >= 10, p > 0,
               f"memory pressure: {p} request(s) paused for memory in the last minute"),
        _grade("failures", f >= 5, f > 0, f"{f} request(s) failed in the last minute"),
        _grade("integrity", x.checksum_failure, False,
               "stored KV failed its checksum in the last minute (recomputed, not served)"),
        _grade("oom", x.oom_firing, False,
               "the OOM predictor expects the device tier to run out of KV memory soon"),
        _grade("tiers", False, bool(x.tier_problems), "; ".join(x.tier_problems)),
        _grade("operators", False, bool(x.operator_fallbacks), "; ".join(x.operator_fallbacks)),
    ]  # fmt: skip
    return colour(ind, x.oom_firing)
