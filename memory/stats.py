"""Pool statistics, the out-of-memory predictor and what the pool feeds the health rule.

What lives here: `PoolStats` (usage per tier, prefix hit rate, allocations, frees, evictions,
preemptions, moves between tiers, checksum failures; `snapshot()` gives them as
`PoolCounters`, and the pool adds its health and layout in a `PoolReport`: dataclasses read by
attribute, `as_dict()` for JSON),
`OomPredictor` (warns when the device tier is nearly full and still filling fast) and
`HealthMonitor` (the pool's recent events, as `HealthInputs` for the one health rule).

What does not: the health rule itself (`memory.health`: the pool and the server both colour
through it), exporting metrics (`serving.metrics`), and any decision taken on a warning
(preempting, offloading: the scheduler and the strategies).

OOM prediction: each `record(usage)` adds a (time, usage) sample and keeps the samples of the
last `OOM_WINDOW_S` (60 s). A warning fires when usage > `OOM_USAGE` (95%) AND the least-squares
slope of usage over that window exceeds `OOM_SLOPE_PP_PER_MIN` (5 percentage points per
minute). The slope needs at least two samples spanning `OOM_MIN_SPAN_S` (1 s), so two samples
a microsecond apart cannot fake a steep rise. Warnings repeat at most once per
`OOM_COOLDOWN_S` (60 s); each one is appended to `events`, passed to the `on_warning` callback
and logged with `logging.warning`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from unikv.memory.allocator import TierAllocator
from unikv.memory.health import RECENT_S, HealthInputs, HealthView, RecentEvents, evaluate
from unikv.memory.prefix import PrefixCache

logger = logging.getLogger(__name__)


OOM_USAGE = 0.95  # predictor: usage must exceed this ...
OOM_SLOPE_PP_PER_MIN = 5.0  # ... and rise faster than this (percentage points per minute)
OOM_WINDOW_S = 60.0  # sliding window of samples the slope is fitted over
OOM_MIN_SPAN_S = 1.0  # the window's samples must span at least this long
OOM_COOLDOWN_S = 60.0  # at most one warning per this many seconds
MAX_EVENTS = 256  # warnings kept in OomPredictor.events (oldest dropped)

Clock = Callable[[], float]


@dataclass(slots=True)
class PoolStats:
    """Counters of one pool; reads tier and prefix counters live from their owners.

    The allocators count allocations, frees and evictions, the prefix cache counts queries and
    hits; the pool records preemptions, moves and checksum failures here.
    """

    allocators: Mapping[str, TierAllocator] = field(default_factory=dict)
    prefix: PrefixCache | None = None
    preemptions: int = 0
    moves: dict[tuple[str, str], int] = field(default_factory=dict)
    checksum_failures: int = 0

    def record_preemption(self, n: int = 1) -> None:
        """Count `n` preempted sequences."""
        self.preemptions += n

    def record_move(self, src: str, dst: str, n: int = 1) -> None:
        """Count `n` blocks moved from tier `src` to tier `dst`."""
        self.moves[(src, dst)] = self.moves.get((src, dst), 0) + n

    def record_checksum_failure(self, n: int = 1) -> None:
        """Count `n` blocks whose checksum did not match (detected, never served)."""
        self.checksum_failures += n

    def usage(self, tier: str) -> float:
        """Used fraction of `tier` (0.0 when the pool has no such tier)."""
        allocator = self.allocators.get(tier)
        return allocator.usage if allocator is not None else 0.0

    def snapshot(self) -> PoolCounters:
        """All counters now (`as_dict()` for JSON)."""
        p = self.prefix
        return PoolCounters(
            tiers={
                name: TierUsage(a.num_blocks, a.num_used, a.num_free, a.num_cached, a.usage)
                for name, a in self.allocators.items()
            },
            allocations=sum(a.num_allocations for a in self.allocators.values()),
            frees=sum(a.num_frees for a in self.allocators.values()),
            evictions=sum(a.num_evictions for a in self.allocators.values()),
            prefix_revived=sum(a.num_revived for a in self.allocators.values()),
            preemptions=self.preemptions,
            moves={f"{s}->{d}": n for (s, d), n in sorted(self.moves.items())},
            checksum_failures=self.checksum_failures,
            prefix=PrefixCounts(
                p.queries, p.hits, p.misses, p.hit_rate, len(p), dict(p.evicted_misses)
            )
            if p is not None
            else PrefixCounts(),
        )


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier's blocks: all, in use, free, free but holding a cached prefix; used share."""

    num_blocks: int
    num_used: int
    num_free: int
    num_cached: int
    usage: float


@dataclass(frozen=True, slots=True)
class PrefixCounts:
    """Prefix-cache block lookups: queries, hits, misses, hit rate; blocks it holds now; per
    tier, lookups that stopped at a block the tier had evicted for room."""

    queries: int = 0
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    cached_blocks: int = 0
    evicted_misses: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolCounters:
    """`PoolStats.snapshot()`: usage per tier and the pool's counters."""

    tiers: dict[str, TierUsage]
    allocations: int
    frees: int
    evictions: int
    prefix_revived: int
    preemptions: int
    moves: dict[str, int]  # "src->dst": blocks moved
    checksum_failures: int
    prefix: PrefixCounts

    def as_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PoolReport:
    """`UnifiedMemoryPool.snapshot()`: the counters, the health view and the readings it was
    coloured from (`readings`, which the server's view adds its own to), the store tiers'
    service statistics (`tier_services`: the remote tier's circuit breaker) and the layout."""

    counters: PoolCounters
    health: HealthView
    readings: HealthInputs
    tier_services: dict[str, dict[str, Any]]
    block_size: int
    page_bytes: int
    sequences: int
    oom_warnings: int = 0  # the OOM predictor's warnings since the pool opened

    @property
    def tiers(self) -> dict[str, TierUsage]:
        return self.counters.tiers

    @property
    def prefix(self) -> PrefixCounts:
        return self.counters.prefix

    def usage(self, tier: str) -> float:
        """Used share of `tier` (0.0 when the pool has none)."""
        t = self.counters.tiers.get(tier)
        return t.usage if t is not None else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-serializable form: the counters at the top level, then the rest."""
        r = self.readings
        return self.counters.as_dict() | {
            "health": self.health.as_dict() | {"signals": {
                "preemptions_recent": r.preemptions_recent,
                "oom_recent": r.oom_firing,
                "checksum_recent": r.checksum_failure,
                "tier_problems": list(r.tier_problems),
            }},
            "tier_services": self.tier_services,
            "block_size": self.block_size,
            "page_bytes": self.page_bytes,
            "sequences": self.sequences,
            "oom_warnings": self.oom_warnings,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class OomWarning:
    """A predicted out-of-memory: usage is high and rising fast."""

    time: float
    usage: float
    slope_pp_per_min: float
    seconds_to_full: float  # at the current slope

    def as_dict(self) -> dict[str, float]:
        """JSON-serializable form."""
        return asdict(self)


def _check_usage(usage: float) -> float:
    if isinstance(usage, bool) or not isinstance(usage, int | float) or not 0.0 <= usage <= 1.0:
        raise ValueError(f"usage must be a fraction in [0, 1], got {usage!r}")
    return float(usage)


class OomPredictor:
    """Warns when device usage is above 95% and rising faster than 5 points per minute.

    See the module docstring for the window and slope rule. `clock` is injectable for tests.
    """

    def __init__(
        self,
        *,
        clock: Clock = time.monotonic,
        usage_threshold: float = OOM_USAGE,
        slope_pp_per_min: float = OOM_SLOPE_PP_PER_MIN,
        window_s: float = OOM_WINDOW_S,
        min_span_s: float = OOM_MIN_SPAN_S,
        cooldown_s: float = OOM_COOLDOWN_S,
        on_warning: Callable[[OomWarning], None] | None = None,
    ) -> None:
        if window_s <= 0 or min_span_s <= 0 or min_span_s > window_s:
            raise ValueError(
                f"need 0 < min_span_s <= window_s, got min_span_s={min_span_s!r}, "
                f"window_s={window_s!r}"
            )
        self.clock = clock
        self.usage_threshold = _check_usage(usage_threshold)
        self.slope_pp_per_min = slope_pp_per_min
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.cooldown_s = cooldown_s
        self.on_warning = on_warning
        self.samples: deque[tuple[float, float]] = deque()
        self.events: deque[OomWarning] = deque(maxlen=MAX_EVENTS)
        self.warnings = 0  # all warnings so far (`events` keeps the newest)
        self.last_warning_time: float | None = None

    def slope(self) -> float | None:
        """Least-squares slope of usage over the window in points per minute, or None."""
        if len(self.samples) < 2:
            return None
        t0 = self.samples[0][0]
        if self.samples[-1][0] - t0 < self.min_span_s:
            return None
        n = len(self.samples)
        mean_t = sum(t - t0 for t, _ in self.samples) / n
        mean_u = sum(u for _, u in self.samples) / n
        var = sum((t - t0 - mean_t) ** 2 for t, _ in self.samples)
        cov = sum((t - t0 - mean_t) * (u - mean_u) for t, u in self.samples)
        # usage fraction per second -> percentage points per minute
        return cov / var * 100.0 * 60.0

    def record(self, usage: float, now: float | None = None) -> OomWarning | None:
        """Add a usage sample (at `now`, default the clock); return a warning if one fires."""
        usage = _check_usage(usage)
        t = self.clock() if now is None else now
        if self.samples and t < self.samples[-1][0]:
            raise ValueError(f"sample time {t!r} is before the previous {self.samples[-1][0]!r}")
        self.samples.append((t, usage))
        while self.samples and self.samples[0][0] < t - self.window_s:
            self.samples.popleft()
        if usage <= self.usage_threshold:
            return None
        slope = self.slope()
        if slope is None or slope <= self.slope_pp_per_min:
            return None
        if self.last_warning_time is not None and t - self.last_warning_time < self.cooldown_s:
            return None
        seconds_to_full = (1.0 - usage) * 100.0 / slope * 60.0
        warning = OomWarning(t, usage, slope, seconds_to_full)
        self.last_warning_time = t
        self.events.append(warning)
        self.warnings += 1
        logger.warning(
            "OOM predicted: device usage %.1f%% rising %.1f points/min, full in ~%.0f s",
            usage * 100,
            slope,
            seconds_to_full,
        )
        if self.on_warning is not None:
            self.on_warning(warning)
        return warning


class HealthMonitor:
    """The pool's recent events and its OOM predictor, read as the health rule's inputs."""

    def __init__(
        self,
        *,
        clock: Clock = time.monotonic,
        predictor: OomPredictor | None = None,
        recent_s: float = RECENT_S,
        stats: PoolStats | None = None,
    ) -> None:
        self.clock = clock
        self.predictor = predictor if predictor is not None else OomPredictor(clock=clock)
        self.recent_s = recent_s
        self.stats = stats  # the pool's counters, counted with the events (None: not kept)
        self.preemptions = RecentEvents(clock, recent_s)
        self.checksum_failures = RecentEvents(clock, recent_s)

    def record_preemption(self) -> None:
        """Note a preemption now (an indicator near its limit for `recent_s`)."""
        if self.stats is not None:
            self.stats.record_preemption()
        self.preemptions.add()

    def record_checksum_failure(self, n: int = 1) -> None:
        """Note `n` stored values that failed their checksum now (detected, deleted, never
        served: the integrity indicator abnormal for `recent_s`)."""
        if self.stats is not None:
            self.stats.record_checksum_failure(n)
        self.checksum_failures.add()

    def inputs(self, device_usage: float, tier_problems: tuple[str, ...] = ()) -> HealthInputs:
        """The pool's readings now, as the health rule takes them."""
        usage = _check_usage(device_usage)
        last = self.predictor.last_warning_time
        return HealthInputs(
            device_usage=usage,
            preemptions_recent=self.preemptions.count(),
            oom_firing=last is not None and self.clock() - last <= self.recent_s,
            checksum_failure=self.checksum_failures.count() > 0,
            tier_problems=tuple(tier_problems),
        )

    def evaluate(self, device_usage: float, tier_problems: tuple[str, ...] = ()) -> HealthView:
        """The pool's health: the one rule (`memory.health`) over the pool's readings."""
        return evaluate(self.inputs(device_usage, tier_problems))
