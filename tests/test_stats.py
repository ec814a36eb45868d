"""Tests of memory.stats and memory.health: counters, the OOM predictor (injected clock), the
pool's health readings and the one health rule."""

import json
import logging

import pytest

from unikv.memory.allocator import TierAllocator
from unikv.memory.health import KV_ABNORMAL, KV_NEAR, HealthInputs, evaluate
from unikv.memory.prefix import PrefixCache
from unikv.memory.stats import HealthMonitor, OomPredictor, OomWarning, PoolStats, TierUsage


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_snapshot_is_json_and_counts() -> None:
    cache = PrefixCache()
    dev = TierAllocator("device", 4, 2, prefix_cache=cache)
    host = TierAllocator("host", 8, 2)
    stats = PoolStats({"device": dev, "host": host}, cache)
    ids = dev.allocate(2, "s")
    dev.cache_block(ids[0], None, [1, 2], "m")
    dev.free(ids)
    dev.allocate(4, "t")  # reuses the cached block: one eviction
    cache.match_prefix([1, 2], 2, "m")
    stats.record_preemption()
    stats.record_move("device", "host", 3)
    stats.record_checksum_failure()
    snap = stats.snapshot()
    as_json = snap.as_dict()
    assert json.loads(json.dumps(as_json)) == as_json
    assert as_json["tiers"]["device"] == {
        "num_blocks": 4,
        "num_used": 4,
        "num_free": 0,
        "num_cached": 0,
        "usage": 1.0,
    }
    assert snap.tiers["device"] == TierUsage(4, 4, 0, 0, 1.0)
    assert (snap.allocations, snap.frees, snap.evictions) == (6, 2, 1)
    assert snap.moves == {"device->host": 3}
    assert snap.preemptions == 1 and snap.checksum_failures == 1
    assert snap.prefix.queries == 1 and snap.prefix.hit_rate == 0.0
    assert stats.usage("device") == 1.0 and stats.usage("ssd") == 0.0


def test_oom_predictor_fires_on_high_and_rising(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    seen: list[OomWarning] = []
    p = OomPredictor(clock=clock, on_warning=seen.append)
    # 89.5% -> 95.5% over 60 s: 6 points per minute, above 95% only at the end.
    with caplog.at_level(logging.WARNING, logger="unikv.memory.stats"):
        for i in range(7):
            clock.t = 1000.0 + 10 * i
            w = p.record(0.895 + 0.01 * i)
    assert w is not None and seen == [w] and list(p.events) == [w]
    assert w.slope_pp_per_min == pytest.approx(6.0)
    assert w.seconds_to_full == pytest.approx(45.0)
    assert "OOM predicted" in caplog.text
    assert json.loads(json.dumps(w.as_dict()))["usage"] == pytest.approx(0.955)


def test_oom_predictor_quiet_when_high_but_flat_or_slow() -> None:
    clock = FakeClock()
    p = OomPredictor(clock=clock)
    for i in range(10):
        clock.t = 1000.0 + 10 * i
        assert p.record(0.97) is None  # flat at 97%
    p = OomPredictor(clock=clock)
    for i in range(7):
        clock.t = 2000.0 + 10 * i
        assert p.record(0.93 + 0.004 * i) is None  # 2.4 points/min, ends at 95.4%


def test_oom_predictor_quiet_when_rising_but_below_threshold() -> None:
    clock = FakeClock()
    p = OomPredictor(clock=clock)
    for i in range(7):
        clock.t = 1000.0 + 10 * i
        assert p.record(0.50 + 0.05 * i) is None  # 30 points/min, but only 80%


def test_oom_predictor_window_and_min_span() -> None:
    p = OomPredictor(clock=lambda: 0.0)
    assert p.record(0.90, now=0.0) is None
    assert p.record(0.99, now=0.5) is None  # span < 1 s: no slope yet
    assert p.slope() is None
    # An old slow climb drops out of the 60 s window; the fresh steep part counts.
    p = OomPredictor(clock=lambda: 0.0)
    p.record(0.10, now=0.0)
    p.record(0.96, now=100.0)
    assert len(p.samples) == 1
    assert p.record(0.97, now=106.0) is not None  # 10 points/min within the window


def test_oom_predictor_cooldown_and_bad_input() -> None:
    clock = FakeClock()
    p = OomPredictor(clock=clock)
    fired = []
    for i in range(25):
        clock.t = 1000.0 + 5 * i
        fired.append(p.record(min(1.0, 0.795 + 0.01 * i)) is not None)
    assert sum(fired) == 1 and p.last_warning_time == 1080.0  # one per 60 s cooldown
    assert p.record(0.90, now=1200.0) is None  # the climb above left the window
    assert p.record(0.99, now=1210.0) is not None  # cooldown over: a new steep rise warns
    with pytest.raises(ValueError, match="usage must be a fraction"):
        p.record(1.5)
    with pytest.raises(ValueError, match="before the previous"):
        p.record(0.5, now=0.0)


def test_health_transitions() -> None:
    """The pool's readings through the one rule: usage near or at its limit, a preemption or
    a checksum failure in the last minute are each one indicator off (yellow); three at once,
    red."""
    clock = FakeClock()
    h = HealthMonitor(clock=clock)
    assert h.evaluate(0.50).status == "green"
    assert h.evaluate(KV_NEAR).status == "yellow"
    v = h.evaluate(0.96)
    assert v.status == "yellow" and "KV memory full: 96% of the device tier" in v.reasons[0]
    assert v.load_share == 0.8

    h.record_preemption()
    assert h.evaluate(0.10).status == "yellow"
    clock.t += 61
    assert h.evaluate(0.10).status == "green"

    h.record_checksum_failure()
    v = h.evaluate(0.10)
    assert v.status == "yellow" and "failed its checksum" in v.reasons[0]
    assert v.as_dict()["indicators"]["integrity"] == "abnormal"
    h.record_preemption()  # three indicators off: red
    v = h.evaluate(KV_ABNORMAL)
    assert v.status == "red" and len(v.reasons) == 3 and v.load_share == 0.3
    clock.t += 61
    assert h.evaluate(0.10).status == "green"


def test_the_pool_and_the_server_colour_the_same_readings_alike() -> None:
    """One rule: the server's view is the pool's inputs plus its own; with nothing of its own
    to add, it is the pool's view exactly."""
    clock = FakeClock()
    h = HealthMonitor(clock=clock)
    h.record_checksum_failure()
    h.record_preemption()
    pool_view = h.evaluate(0.90, ("remote tier unavailable",))
    inputs = h.inputs(0.90, ("remote tier unavailable",))
    assert evaluate(inputs) == pool_view and pool_view.status == "red"  # 4 indicators off
    server = HealthInputs(inputs.device_usage, waiting=0, max_waiting=64,
                          preemptions_recent=inputs.preemptions_recent, failures_recent=0,
                          oom_firing=inputs.oom_firing, checksum_failure=inputs.checksum_failure,
                          tier_problems=inputs.tier_problems)  # fmt: skip
    assert evaluate(server) == pool_view


def test_health_red_after_oom_warning_then_recovers() -> None:
    clock = FakeClock()
    h = HealthMonitor(clock=clock)
    for i in range(7):
        clock.t = 1000.0 + 10 * i
        h.predictor.record(0.90 + 0.01 * i, clock.t)
    assert h.predictor.events
    clock.t += 5
    r = h.evaluate(0.80)  # usage dropped, but the warning was within the last minute
    assert r.status == "red" and "OOM predictor expects" in r.reasons[0]  # red on its own
    clock.t += 60
    assert h.evaluate(0.80).status == "green"
