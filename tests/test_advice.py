"""Advice an operator can act on (serving.advice): each rule's threshold on scripted readings,
then each rule provoked through an engine's real counters (a small device tier, a batching
window that closes by time, a kernel that raises); the cooling rule runs on the replicas'
scripted sensors (tests/test_replicas.py). Then the advice on /health, the dashboard's data,
gRPC's Advise and `unikv advise --url`."""

from __future__ import annotations

import asyncio

import pytest

from unikv import kvstrategies
from unikv.engine.engine import Engine
from unikv.engine.sampling import SamplingParams
from unikv.serving import advice as adv
from unikv.serving.advice import Advisor, Readings, change
from unikv.serving.app import Server, ServeSettings
from unikv.settings.config import PoolConfig, TierConfig

from .conftest import make_english

MiB = 2**20


def readings(**kw) -> Readings:
    base = {"t": 100.0, "max_batch": 16, "tier_bytes": {"device": 256 * MiB}, "isa": "avx2"}
    return Readings(**(base | kw))


def rules(now: Readings, old: Readings | None = None) -> list[adv.Advice]:
    d = change(old or Readings(t=0.0), now)
    return [a for rule in adv.RULES for a in rule(now, d, "5 minutes")]


# ---- each rule's threshold, on scripted readings -------------------------------------------------


def test_nothing_to_change_on_quiet_readings():
    assert rules(readings(preemptions=4, window_on_time=9, prefix_queries=100,
                          prefix_hits=10, evicted_misses={"device": 2})) == []  # fmt: skip


def test_preemptions_halve_the_batch_and_at_one_double_the_device_tier():
    (a,) = rules(readings(preemptions=5))
    assert (a.rule, a.key, a.current, a.suggested) == ("preemptions", "[scheduler] batch_size",
                                                       "16", "8")  # fmt: skip
    assert a.text.startswith("lower [scheduler] batch_size from 16 to 8: requests paused")
    assert "(threshold 5)" in a.text and a.value == 5 and a.threshold == 5
    (b,) = rules(readings(preemptions=9, max_batch=1))
    assert (b.key, b.current, b.suggested) == ("[tiers.device] capacity", "256MiB", "512MiB")


def test_the_window_counts_only_what_changed_in_it():
    old = readings(t=0.0, preemptions=100)
    assert rules(readings(preemptions=104), old) == []
    assert [a.rule for a in rules(readings(preemptions=105), old)] == ["preemptions"]


def test_an_oom_warning_doubles_the_device_tier():
    (a,) = rules(readings(oom_warnings=1, tier_bytes={"device": 1024 * MiB}))
    assert (a.rule, a.key, a.current, a.suggested) == ("oom", "[tiers.device] capacity",
                                                       "1GiB", "2GiB")  # fmt: skip


def test_evicted_prefixes_with_a_low_hit_rate_double_that_tier():
    now = readings(prefix_queries=100, prefix_hits=20, evicted_misses={"host": 3},
                   tier_bytes={"device": 64 * MiB, "host": 512 * MiB})  # fmt: skip
    (a,) = rules(now)
    assert (a.key, a.current, a.suggested) == ("[tiers.host] capacity", "512MiB", "1GiB")
    assert "hit rate was 20%" in a.text
    # A good hit rate, or evictions nobody asked for again, give no advice.
    assert rules(readings(prefix_queries=100, prefix_hits=60, evicted_misses={"host": 9},
                          tier_bytes={"host": MiB})) == []  # fmt: skip


def test_a_window_that_closes_by_time_is_halved_then_turned_off():
    (a,) = rules(readings(window_on_time=8, window_on_size=2, window_ms=50.0))
    assert (a.key, a.current, a.suggested) == ("[scheduler] batching_window_ms", "50", "25")
    assert a.text.startswith("lower [scheduler] batching_window_ms from 50 to 25: share")
    assert rules(readings(window_on_time=7, window_on_size=3, window_ms=50.0)) == []  # 70%
    (b,) = rules(readings(window_on_time=10, window_ms=3.0))
    assert b.suggested == "0"


def test_repeated_cooling_halves_the_batch_or_adds_a_replica():
    (a,) = rules(readings(replicas=2, cooling_entered={"0-ab": 2, "1-cd": 1}))
    assert (a.key, a.suggested) == ("[scheduler] batch_size", "8") and "0-ab" in a.measurement
    (b,) = rules(readings(replicas=2, max_batch=1, cooling_entered={"0-ab": 3}))
    assert (b.key, b.current, b.suggested) == ("--replicas", "2", "3")
    assert b.text.startswith("raise --replicas from 2 to 3")
    assert rules(readings(replicas=2, cooling_entered={"0-ab": 1})) == []


def test_a_raising_kernel_names_itself_and_the_setting_that_avoids_it():
    off = {"matmul.Q8_0": {"gemv_i8": "raised RuntimeError: boom"},
           "matmul.float": {"split_bmm": "raised ValueError: bad"},
           "attention.hybrid": {"c": "1.30x its calibrated latency over 16 calls"}}  # fmt: skip
    a, b = rules(readings(switched_off=off))
    assert (a.key, a.current, a.suggested) == ("UNIKV_ISA", "avx2", "portable")
    assert "gemv_i8 switched off (raised RuntimeError: boom)" in a.text
    assert (b.key, b.current, b.suggested) == ("--weights", "native", "float32")
    # Switched off for slowness is the registry adapting: no advice (the attention entry).
    assert all(x.rule == "kernel_fallback" for x in (a, b))


def test_the_advisor_keeps_a_window_of_readings():
    clock = [0.0]
    advisor = Advisor(window_s=60.0, every_s=1.0, clock=lambda: clock[0])

    class Report:  # the attributes a served report has
        def __init__(self, preemptions):
            from unikv.engine.scheduler import RequestCounts
            from unikv.memory.stats import PrefixCounts

            self.requests = RequestCounts(preemptions=preemptions, max_batch=4)
            self.prefix, self.pool, self.replicas, self.kernels = PrefixCounts(), None, None, {}

    clock[0] = 10.0
    assert [a.rule for a in advisor.observe(Report(6))] == ["preemptions"]  # 6 since start
    assert "in the last 10 s" in advisor.observe(Report(6))[0].measurement
    clock[0] = 100.0  # a minute later, nothing new: the baseline moved past the preemptions
    advisor.observe(Report(6))
    clock[0] = 170.0
    assert advisor.observe(Report(6)) == []
    clock[0] = 180.0
    assert [a.rule for a in advisor.observe(Report(11))] == ["preemptions"]


# ---- each rule through an engine's real counters -------------------------------------------------


def pool_kv(model, device_blocks: int):
    spec = model.kv_spec()
    page = kvstrategies.get("full").layout(spec, 16, {"dtype": None}).page_bytes
    tiers = (TierConfig("device", device_blocks * page),)
    return kvstrategies.create("full", spec, PoolConfig(tiers=tiers)), device_blocks * page


def served(engine) -> Server:
    server = Server(None, ServeSettings())
    server.engine = engine
    return server


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer.encode(make_english(80, seed=21))
    return [ids[i * 100 : i * 100 + 128] for i in range(6)]


@pytest.mark.slow
async def test_a_small_device_tier_gets_a_smaller_batch_and_a_larger_tier(model, tokenizer,
                                                                          prompts):  # fmt: skip
    kv, cap = pool_kv(model, device_blocks=24)  # 384 tokens for 6 requests of 128 + 64
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    async with Engine(model, tokenizer, kv=kv, max_batch=6) as e:
        await asyncio.gather(*(e.generate(p, params) for p in prompts))
        got = {a.rule: a for a in served(e).advice()}
    assert got["preemptions"].key == "[scheduler] batch_size"
    assert (got["preemptions"].current, got["preemptions"].suggested) == ("6", "3")
    assert got["preemptions"].value >= adv.PREEMPTIONS_MIN
    assert got["oom"].key == "[tiers.device] capacity"
    assert got["oom"].suggested == adv.size_text(2 * cap)
    kv.close()


@pytest.mark.slow
async def test_prefixes_evicted_before_they_return_ask_for_a_larger_tier(model, tokenizer,
                                                                         prompts):  # fmt: skip
    kv, cap = pool_kv(model, device_blocks=26)  # the cached blocks of three prompts, not four
    one = SamplingParams(max_new_tokens=1)
    async with Engine(model, tokenizer, kv=kv, max_batch=1) as e:
        for _ in range(2):  # four prompts in turn over a cache that keeps three: LRU misses all
            for p in prompts[:4]:
                await e.generate(p, one)
        (a,) = [a for a in served(e).advice() if a.rule == "prefix_evictions"]
        pool = e.memory_report().pool
    assert pool.prefix.evicted_misses["device"] >= adv.EVICTED_MISSES_MIN
    assert (a.key, a.current, a.suggested) == ("[tiers.device] capacity", adv.size_text(cap),
                                               adv.size_text(2 * cap))  # fmt: skip
    kv.close()


@pytest.mark.slow
async def test_a_window_that_closes_by_time_is_shortened(model, tokenizer, prompts):
    one = SamplingParams(max_new_tokens=1)
    async with Engine(model, tokenizer, max_batch=8, admission_window_ms=20.0) as e:
        for i in range(adv.WINDOW_CLOSES_MIN):  # one at a time: no window ever fills the batch
            await e.generate(prompts[0][: 8 + i], one)
        counts = e.memory_report().requests
        (a,) = [a for a in served(e).advice() if a.rule == "batching_window"]
    assert counts.window_on_time == adv.WINDOW_CLOSES_MIN and counts.window_on_size == 0
    assert (a.key, a.current, a.suggested) == ("[scheduler] batching_window_ms", "20", "10")


@pytest.mark.slow
async def test_a_kernel_that_raises_is_named_with_its_setting(loaded, tokenizer, monkeypatch):
    from unikv.engine.model import LlamaModel
    from unikv.kernels import operators

    first = operators.choose("matmul.float", "cpu")[0][0]
    if first.name == operators.reference("matmul.float").name:
        pytest.skip("only the reference matmul runs here")

    def boom(*args):
        raise RuntimeError("broken by this test")

    monkeypatch.setattr(first, "__call__", boom)
    cfg, tensors, _ = loaded
    model = LlamaModel(cfg, tensors)  # its own breakers, built with the broken kernel first
    async with Engine(model, tokenizer) as e:
        # a prompt longer than a decode step's rows: its prefill runs the output layer through
        # the broken entry (a decode step multiplies it inside gemv.c's one call)
        await e.generate("Hello there, " * 4, SamplingParams(max_new_tokens=2))
        server = served(e)
        (a,) = [a for a in server.advice() if a.rule == "kernel_fallback"]
        assert server.health().status == "yellow"  # the fallback is a health reason too
    assert f"implementation {first.name} switched off (raised RuntimeError" in a.measurement
    if first.name in adv.NATIVE_KERNELS and server.isa in adv.ISA_BELOW:
        assert (a.key, a.current, a.suggested) == ("UNIKV_ISA", server.isa,
                                                   adv.ISA_BELOW[server.isa])  # fmt: skip
    else:
        assert (a.key, a.suggested) == ("--weights", "float32")
