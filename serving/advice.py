"""Advice an operator can act on: a small rule set over what the server already measures.

What lives here: `Readings` (the counters one advice round reads: the engine's memory report,
the replicas' reports, the kernels), `Advice` (one piece: the measurement, its value, the
threshold, the config key and the value to set it to, and a sentence), the rules, and
`Advisor` (keeps the readings of the last `window_s` and applies the rules to what changed in
that window). What does not: measuring (the pool, the scheduler, the sensors, the kernel
registry count), showing it (`/health`, `/dashboard`, gRPC's `Advise`, `unikv advise`).

The rules, each over the last `window_s` (default 5 minutes; counters since the server started
when it is younger):

- preemptions: >= 5 requests paused for memory -> `[scheduler] batch_size` halved (at 1: the
  device tier's capacity doubled);
- oom: the OOM predictor warned -> `[tiers.device] capacity` doubled;
- prefix_evictions: a prefix hit rate below 50% while >= 3 prompt lookups stopped at a block a
  tier had evicted for room -> that tier's `[tiers.T] capacity` doubled;
- batching_window: >= 10 admission windows closed, >= 80% of them by time rather than by a
  full batch -> `[scheduler] batching_window_ms` halved (0 below 2 ms);
- cooling: a replica entered cooling >= 2 times -> `[scheduler] batch_size` halved (at 1:
  `--replicas`, one more);
- kernel_fallback: an operator's implementation raised and was switched off -> `UNIKV_ISA` one
  instruction set lower (a C kernel), `--weights float32` (a packed matmul), else a fresh
  `UNIKV_KERNEL_DIR`.

Each threshold is a constant below. An operator reads them on `/health` (`advice`), the
dashboard, gRPC (`unikv.v1.Generation/Advise`) and `unikv advise --url URL`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

WINDOW_S = 300.0
PREEMPTIONS_MIN = 5
PREFIX_HIT_RATE_MAX = 0.5
EVICTED_MISSES_MIN = 3
WINDOW_CLOSES_MIN = 10
WINDOW_ON_TIME_MIN = 0.8
COOLING_ENTRIES_MIN = 2
NATIVE_KERNELS = ("gemv", "gemv_i8", "c")  # implementations built from the C sources
ISA_BELOW = {"avx512": "avx2", "avx2": "portable"}


@dataclass(frozen=True, slots=True)
class Readings:
    """What the rules read at one time: counters since start (compared over the window) and
    the settings in force now."""

    t: float
    preemptions: int = 0
    oom_warnings: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    evicted_misses: dict[str, int] = field(default_factory=dict)  # per tier
    tier_bytes: dict[str, int] = field(default_factory=dict)  # capacity per tier
    window_on_time: int = 0
    window_on_size: int = 0
    window_ms: float = 0.0
    max_batch: int = 0
    replicas: int = 0
    cooling_entered: dict[str, int] = field(default_factory=dict)  # per replica
    switched_off: dict[str, dict[str, str]] = field(default_factory=dict)  # op -> impl: why
    isa: str | None = None

    @classmethod
    def of(cls, report: Any, t: float, isa: str | None = None) -> Readings:
        """The readings of a served report (`engine.report.ServedReport`: one engine's, or
        the replicas' totals with each replica's last report)."""
        req, prefix = report.requests, report.prefix
        pool = report.pool
        reps = report.replicas or {}
        kernels = getattr(report, "kernels", {}) or {}
        return cls(
            t=t,
            preemptions=req.preemptions,
            oom_warnings=pool.oom_warnings if pool is not None else 0,
            prefix_queries=prefix.queries,
            prefix_hits=prefix.hits,
            evicted_misses=dict(prefix.evicted_misses),
            tier_bytes={n: u.num_blocks * pool.page_bytes for n, u in pool.tiers.items()}
            if pool is not None
            else {},
            window_on_time=req.window_on_time,
            window_on_size=req.window_on_size,
            window_ms=req.window_s * 1000.0,
            max_batch=max((int(r.get("max_batch", 0)) for r in reps.values()), default=0)
            or req.max_batch,
            replicas=len(reps),
            cooling_entered={n: int(r.get("cooling_entered", 0)) for n, r in reps.items()},
            switched_off={
                op: dict(k["switched_off"]) for op, k in kernels.items() if k.get("switched_off")
            },  # fmt: skip
            isa=isa,
        )


@dataclass(frozen=True, slots=True)
class Advice:
    """One piece of advice: which rule, what was measured, its value against the threshold,
    and the config key with its value now and the value to set."""

    rule: str
    measurement: str
    value: float
    threshold: float
    key: str
    current: str
    suggested: str
    text: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def size_text(n: int) -> str:
    """A size as the config file writes it ("512MiB", "2GiB")."""
    mib = max(1, round(n / 2**20))
    return f"{mib // 1024}GiB" if mib % 1024 == 0 else f"{mib}MiB"


def _advice(
    rule: str, measurement: str, value: float, threshold: float, key: str,
    current: object, suggested: object, why: str, share: bool = False,
) -> Advice:  # fmt: skip
    """One piece of advice; `share`: the value and threshold are fractions (said in %)."""
    verb = "lower" if _lower(current, suggested) else "raise"
    current, suggested = _value(current), _value(suggested)
    num = (lambda x: f"{x:.0%}") if share else (lambda x: f"{x:g}")
    text = (f"{verb} {key} from {current} to {suggested}: {measurement} was {num(value)} "
            f"(threshold {num(threshold)}); {why}")  # fmt: skip
    return Advice(rule, measurement, float(value), float(threshold), key, str(current),
                  str(suggested), text)  # fmt: skip


def _lower(current: object, suggested: object) -> bool:
    if isinstance(current, int | float) and isinstance(suggested, int | float):
        return suggested < current
    return False


def _value(v: object) -> str:
    """A setting's value as the config file writes it (50.0 -> "50")."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _batch_or(now: Readings, fallback: Callable[[], tuple[str, object, object]]):
    """Halve `[scheduler] batch_size`; at 1, the `fallback` key."""
    if now.max_batch > 1:
        return "[scheduler] batch_size", now.max_batch, max(1, now.max_batch // 2)
    return fallback()


def _device_doubled(now: Readings) -> tuple[str, object, object]:
    cap = now.tier_bytes.get("device", 0)
    return "[tiers.device] capacity", size_text(cap), size_text(2 * cap)


# ---- the rules: (readings now, their change over the window) -> advice ---------------------------


def preemptions(now: Readings, d: Readings, window: str) -> list[Advice]:
    if d.preemptions < PREEMPTIONS_MIN:
        return []
    key, cur, new = _batch_or(now, lambda: _device_doubled(now))
    return [_advice("preemptions", f"requests paused for memory in the last {window}",
                    d.preemptions, PREEMPTIONS_MIN, key, cur, new,
                    "the running batch needs more KV memory than the device tier has")]  # fmt: skip


def oom(now: Readings, d: Readings, window: str) -> list[Advice]:
    if d.oom_warnings < 1 or "device" not in now.tier_bytes:
        return []
    key, cur, new = _device_doubled(now)
    return [_advice("oom", f"OOM predictor warnings in the last {window}", d.oom_warnings, 1,
                    key, cur, new, "the device tier is too small for this load")]  # fmt: skip


def prefix_evictions(now: Readings, d: Readings, window: str) -> list[Advice]:
    if not d.prefix_queries:
        return []
    rate = d.prefix_hits / d.prefix_queries
    out = []
    for tier, misses in sorted(d.evicted_misses.items()):
        if rate >= PREFIX_HIT_RATE_MAX or misses < EVICTED_MISSES_MIN or tier not in now.tier_bytes:
            continue
        cap = now.tier_bytes[tier]
        out.append(_advice(
            "prefix_evictions",
            f"prompt lookups that stopped at a block the {tier} tier had evicted for room, in "
            f"the last {window}",
            misses, EVICTED_MISSES_MIN, f"[tiers.{tier}] capacity", size_text(cap),
            size_text(2 * cap),
            f"the prefix hit rate was {rate:.0%} (below {PREFIX_HIT_RATE_MAX:.0%}): cached "
            "prefixes are evicted before they are asked for again",
        ))  # fmt: skip
    return out


def batching_window(now: Readings, d: Readings, window: str) -> list[Advice]:
    closes = d.window_on_time + d.window_on_size
    if closes < WINDOW_CLOSES_MIN or now.window_ms <= 0:
        return []
    share = d.window_on_time / closes
    if share < WINDOW_ON_TIME_MIN:
        return []
    half = now.window_ms / 2
    new: float = 0.0 if half < 2 else round(half, 1)
    return [
        _advice(
            "batching_window",
            f"share of admission windows that closed by time, not by a full batch, in "
            f"the last {window} ({closes} windows)",
            share,
            WINDOW_ON_TIME_MIN,
            "[scheduler] batching_window_ms",
            now.window_ms,
            new,
            "requests wait out the window without filling the batch: a shorter window "
            "cuts their TTFT",
            share=True,
        )
    ]


def cooling(now: Readings, d: Readings, window: str) -> list[Advice]:
    hot = {n: k for n, k in d.cooling_entered.items() if k >= COOLING_ENTRIES_MIN}
    if not hot:
        return []
    name, entries = max(hot.items(), key=lambda kv: kv[1])
    key, cur, new = _batch_or(now, lambda: ("--replicas", now.replicas, now.replicas + 1))
    return [_advice("cooling", f"times replica {name} entered cooling in the last {window}",
                    entries, COOLING_ENTRIES_MIN, key, cur, new,
                    "the chip keeps reaching its temperature limit under this load")]  # fmt: skip


def kernel_fallback(now: Readings, d: Readings, window: str) -> list[Advice]:
    out = []
    for op, off in sorted(now.switched_off.items()):
        for impl, why in sorted(off.items()):
            if not why.startswith("raised"):
                continue  # switched for slowness: the registry adapting, not a fault
            measurement = f"operator {op}: implementation {impl} switched off ({why})"
            if impl in NATIVE_KERNELS and now.isa in ISA_BELOW:
                key, cur, new = "UNIKV_ISA", now.isa, ISA_BELOW[now.isa]
                fix = "the C kernels built for a narrower instruction set"
            elif op.startswith("matmul."):
                key, cur, new = "--weights", "native", "float32"
                fix = "float32 weights need no packed kernel"
            else:
                key, cur, new = "UNIKV_KERNEL_DIR", "the kernel cache", "an empty directory"
                fix = "the kernels rebuilt from their sources"
            out.append(
                _advice(
                    "kernel_fallback",
                    measurement,
                    1,
                    1,
                    key,
                    cur,
                    new,
                    f"the breaker serves it with a slower implementation; {fix}",
                )
            )
    return out


RULES: tuple[Callable[[Readings, Readings, str], list[Advice]], ...] = (
    preemptions, oom, prefix_evictions, batching_window, cooling, kernel_fallback,
)  # fmt: skip


def change(old: Readings, new: Readings) -> Readings:
    """The counters' growth from `old` to `new` (settings and kernels as `new` has them)."""

    def grown(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: v - a.get(k, 0) for k, v in b.items()}

    return replace(
        new,
        preemptions=new.preemptions - old.preemptions,
        oom_warnings=new.oom_warnings - old.oom_warnings,
        prefix_queries=new.prefix_queries - old.prefix_queries,
        prefix_hits=new.prefix_hits - old.prefix_hits,
        evicted_misses=grown(old.evicted_misses, new.evicted_misses),
        window_on_time=new.window_on_time - old.window_on_time,
        window_on_size=new.window_on_size - old.window_on_size,
        cooling_entered=grown(old.cooling_entered, new.cooling_entered),
    )


def _window_words(seconds: float) -> str:
    return f"{seconds / 60:.0f} minutes" if seconds >= 120 else f"{seconds:.0f} s"


class Advisor:
    """The rules over the readings of the last `window_s`: `observe` a report, read `advice`.

    A reading is kept at most every `every_s` (so `/health` polled often keeps a short list);
    the oldest kept reading within the window is the baseline, the one before the first
    reading a zero (the counters since start)."""

    def __init__(self, window_s: float = WINDOW_S, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s, self.every_s, self.clock = window_s, every_s, clock
        self._kept: deque[Readings] = deque()
        self._start = clock()

    def observe(self, report: Any, isa: str | None = None) -> list[Advice]:
        """Note the readings of `report` now and return the advice they give."""
        now = Readings.of(report, self.clock(), isa)
        if not self._kept or now.t - self._kept[-1].t >= self.every_s:
            self._kept.append(now)
        while len(self._kept) > 1 and self._kept[1].t <= now.t - self.window_s:
            self._kept.popleft()
        old = self._kept[0]
        if old.t > now.t - self.window_s and self._start > now.t - self.window_s:
            old = Readings(t=self._start)  # younger than the window: everything since start
        window = _window_words(min(self.window_s, now.t - old.t) or self.window_s)
        d = change(old, now)
        return [a for rule in RULES for a in rule(now, d, window)]
