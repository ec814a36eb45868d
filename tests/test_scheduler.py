"""The scheduler alone: plans, admission, preemption, swap-in, recompute, against a fake KVMemory.

No model and no tensors: each step is computed by `step()` below the way the engine would, so
every test runs in milliseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from unikv.engine.scheduler import (
    PriorityOrder,
    RequestCounts,
    Scheduler,
    SchedulerConfig,
    Work,
)
from unikv.kvstrategies.kv import KVMemory

NEW_TOKEN = 7  # what the fake model samples


class FakeKV(KVMemory):
    """A device tier of `capacity` tokens, an unbounded host tier when `swap`, cached prefixes."""

    def __init__(
        self,
        capacity: int = 1000,
        *,
        swap: bool = False,
        watermark: int = 0,
        prefixes: tuple[list[int], ...] = (),
    ) -> None:
        self.capacity, self.swap, self.watermark = capacity, swap, watermark
        self.prefixes = [list(p) for p in prefixes]
        self.device: dict[int, int] = {}  # seq -> tokens of room held on the device
        self.host: dict[int, int] = {}  # seq -> tokens swapped out
        self.published: dict[int, list[int]] = {}
        self.dropped = 0  # record_preemption() calls: sequences dropped to be recomputed
        self.refuse_swap_in = False

    def used(self) -> int:
        return sum(self.device.values())

    def free(self, seq_id: int) -> None:
        self.device.pop(seq_id, None)
        self.host.pop(seq_id, None)

    def stored_tokens(self, seq_id: int) -> int:
        return self.device.get(seq_id, 0) + self.host.get(seq_id, 0)

    def bytes_used(self) -> int:
        return 2 * self.used()

    def bytes_reserved(self) -> int:
        return self.bytes_used()

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        if self.used() + num_tokens > self.capacity:
            return False
        self.device[seq_id] = self.device.get(seq_id, 0) + num_tokens
        return True

    def can_admit(self, num_tokens: int) -> bool:
        return self.used() + num_tokens + self.watermark <= self.capacity

    def capacity_tokens(self) -> int | None:
        return self.capacity

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        # Like the pool, never the whole sequence: its last token must be fed to get logits.
        hits = [len(p) for p in self.prefixes if p == token_ids[: len(p)] != token_ids]
        n = max(hits, default=0)
        if n:
            self.device[seq_id] = n
        return n

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        self.published[seq_id] = list(token_ids)

    def swap_out(self, seq_id: int) -> bool:
        if not self.swap:
            return False
        self.host[seq_id] = self.device.pop(seq_id, 0)
        return True

    def swap_in(self, seq_id: int) -> bool:
        n = self.host.get(seq_id, 0)
        if self.refuse_swap_in or self.used() + n > self.capacity:
            return False
        self.device[seq_id] = self.host.pop(seq_id, 0)
        return True

    def record_preemption(self) -> None:
        self.dropped += 1


@dataclass(eq=False)
class Req:
    """A request as the scheduler sees it (the engine's has sampling and text besides)."""

    rid: int
    prompt_ids: list[int]
    max_new: int = 100
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefix_hit: int = 0
    finish_reason: str | None = None
    priority: int = 0
    arrival: float = 0.0
    wants_prompt_logits: bool = False
    shares_prefix: bool = True

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def req(rid: int, n: int, max_new: int = 100, priority: int = 0, arrival: float = 0.0) -> Req:
    """A request with an `n`-token prompt of its own tokens."""
    return Req(rid, [rid * 1000 + i for i in range(n)], max_new, priority=priority,
               arrival=arrival)  # fmt: skip


def sched(kv: KVMemory, max_batch: int = 16, max_step_tokens: int = 512, **kw) -> Scheduler[Req]:
    return Scheduler(kv, SchedulerConfig(max_batch, max_step_tokens, **kw))


def step(s: Scheduler[Req], now: float = 0.0) -> list[Work[Req]]:
    """One step as the engine runs it, without a model: every item is computed, and an item that
    ends the known tokens samples a new one; returns the plan's work."""
    plan = s.schedule(now)
    for r in plan.outgrown:
        r.finish_reason = "length"
    for w in plan.work:
        s.computed(w)
        if w.needs_logits:
            w.req.output_ids.append(NEW_TOKEN)
            if len(w.req.output_ids) >= w.req.max_new:
                w.req.finish_reason = "length"
                s.finish(w.req)
    return plan.work


def shape(work: list[Work[Req]]) -> list[tuple[int, int, bool]]:
    return [(w.req.rid, len(w.tokens), w.needs_logits) for w in work]


def run_all(s: Scheduler[Req], limit: int = 1000) -> int:
    """Step until idle; return the steps taken."""
    for n in range(limit):
        if s.idle():
            return n
        step(s)
    raise AssertionError("the scheduler did not drain")


# ---- planning ---------------------------------------------------------------------------------


def test_prompts_are_chunked_within_the_token_budget_and_decodes_take_one_token():
    kv = FakeKV()
    s = sched(kv, max_step_tokens=8)
    a, b, c = req(0, 3), req(1, 20), req(2, 5)
    for r in (a, b, c):
        s.add(r)
    assert shape(step(s)) == [(0, 3, True), (1, 5, False)]  # the budget is spent: c waits
    assert shape(step(s)) == [(0, 1, True), (1, 7, False)]
    assert shape(step(s)) == [(0, 1, True), (1, 7, False)]
    # b's last prompt token is fed like a decode token; c's whole prompt fits after it.
    assert shape(step(s)) == [(0, 1, True), (1, 1, True), (2, 5, True)]
    assert shape(step(s)) == [(0, 1, True), (1, 1, True), (2, 1, True)]
    assert b.num_computed == 21 and kv.published[1] == b.tokens[:21]
    assert kv.device == {0: 7, 1: 21, 2: 6}


def test_chunks_are_the_next_tokens_and_decode_feeds_the_newest():
    s = sched(FakeKV(), max_step_tokens=4)
    r = req(0, 10)
    s.add(r)
    fed = [w.tokens for _ in range(3) for w in step(s)]
    assert fed == [r.prompt_ids[:4], r.prompt_ids[4:8], r.prompt_ids[8:]]
    assert step(s)[0].tokens == [NEW_TOKEN] and r.output_ids == [NEW_TOKEN, NEW_TOKEN]


def test_decode_tokens_are_planned_before_prompt_chunks():
    # b's prompt is cached but for its last token, so b decodes at once though admitted after a.
    cached = [1000 + i for i in range(16)]
    s = sched(FakeKV(prefixes=(cached,)), max_step_tokens=8)
    a, b = req(0, 30), req(1, 17)
    s.add(a)
    s.add(b)
    work = step(s)
    assert b.prefix_hit == 16
    # Served in running order, but b's token was counted first: a gets 7, not 8.
    assert shape(work) == [(0, 7, False), (1, 1, True)]


def test_prefix_sharing_off_computes_the_whole_prompt():
    cached = [0, 1, 2, 3]
    s = sched(FakeKV(prefixes=(cached,)), prefix_sharing=False)
    r = req(0, 6)
    s.add(r)
    assert shape(step(s)) == [(0, 6, True)] and r.prefix_hit == 0


def test_max_batch_bounds_the_running_requests():
    s = sched(FakeKV(), max_batch=2)
    reqs = [req(0, 3, max_new=2), req(1, 3, max_new=5), req(2, 3)]
    for r in reqs:
        s.add(r)
    assert shape(step(s)) == [(0, 3, True), (1, 3, True)]
    assert s.running == reqs[:2] and list(s.waiting) == reqs[2:]
    step(s)  # request 0 finishes here
    assert s.running == [reqs[1]]
    assert shape(step(s)) == [(1, 1, True), (2, 3, True)]


# ---- admission --------------------------------------------------------------------------------


def test_with_none_running_the_head_is_admitted_whatever_the_watermark():
    s = sched(FakeKV(100, watermark=1000))
    r = req(0, 20)
    s.add(r)
    assert shape(step(s)) == [(0, 20, True)]


def test_the_watermark_holds_back_the_queue_in_order():
    kv = FakeKV(100)
    s = sched(kv)
    first, big, small = req(0, 60), req(1, 50), req(2, 3)
    s.add(first)
    step(s)
    s.add(big)
    s.add(small)
    step(s)
    assert s.running == [first]
    assert list(s.waiting) == [big, small]  # the small one does not overtake the head
    s.finish(first)
    step(s)
    assert s.running == [big, small]


def test_check_fits_refuses_a_prompt_the_device_can_never_hold():
    s = sched(FakeKV(64))
    s.check_fits(63)
    with pytest.raises(ValueError, match="device tier holds KV for 64 tokens"):
        s.check_fits(64)
    unbounded = FakeKV()
    unbounded.capacity_tokens = lambda: None
    sched(unbounded).check_fits(10**6)


def test_config_rejects_an_empty_batch_or_budget():
    with pytest.raises(ValueError, match="max_batch and max_step_tokens must be >= 1, got 0, 8"):
        SchedulerConfig(0, 8)
    with pytest.raises(ValueError, match="got 4, 0"):
        SchedulerConfig(4, 0)


# ---- preemption -------------------------------------------------------------------------------


def three_running(swap: bool) -> tuple[FakeKV, Scheduler[Req], list[Req]]:
    """Three requests of 3 prompt tokens, prefilled, on a device of 10 tokens."""
    kv = FakeKV(10, swap=swap)
    s = sched(kv)
    reqs = [req(i, 3) for i in range(3)]
    for r in reqs:
        s.add(r)
    step(s)
    assert kv.used() == 9
    return kv, s, reqs


def test_short_memory_swaps_out_the_newest_request():
    kv, s, (a, b, c) = three_running(swap=True)
    assert shape(step(s)) == [(0, 1, True), (1, 1, True)]
    assert s.running == [a, b] and list(s.swapped) == [c]
    assert kv.host == {2: 3} and c.num_computed == 3  # its KV is kept, on the host
    assert s.preemptions == 1 and kv.dropped == 0


def test_short_memory_without_swap_drops_the_newest_to_recompute():
    kv, s, (a, b, c) = three_running(swap=False)
    assert shape(step(s)) == [(0, 1, True), (1, 1, True)]
    assert s.running == [a, b] and list(s.waiting) == [c]
    assert 2 not in kv.device and c.num_computed == 0
    assert c.output_ids == [NEW_TOKEN]  # its output is kept: it resumes where it stopped
    assert s.preemptions == 1 and kv.dropped == 1


def test_the_newest_preempts_itself_rather_than_an_older_request():
    kv = FakeKV(7)
    s = sched(kv)
    a, b = req(0, 3), req(1, 3)
    s.add(a)
    s.add(b)
    step(s)
    assert shape(step(s)) == [(0, 1, True)]
    assert s.running == [a] and list(s.waiting) == [b] and kv.dropped == 1


def test_a_dropped_request_goes_before_newer_waiting_ones():
    kv, s, (a, b, c) = three_running(swap=False)
    late = req(3, 2)
    s.add(late)
    step(s)
    assert list(s.waiting) == [c, late]


def test_swapped_requests_come_back_first_in_fifo_order():
    kv = FakeKV(12, swap=True)
    s = sched(kv)
    reqs = [req(i, 3) for i in range(4)]
    for r in reqs:
        s.add(r)
    step(s)  # 12 of 12 tokens used
    step(s)  # no room to grow: the newest, 3, goes to the host
    assert list(s.swapped) == [reqs[3]]
    step(s)  # 3 cannot come back yet; 2 goes too
    assert list(s.swapped) == [reqs[3], reqs[2]]
    late = req(4, 2)
    s.add(late)
    step(s)
    assert list(s.waiting) == [late]  # nobody overtakes a swapped request
    s.finish(reqs[0])
    s.finish(reqs[1])
    work = step(s)
    assert s.running == [reqs[3], reqs[2], late]
    # The swapped ones decode on where they stopped: nothing was recomputed.
    assert shape(work) == [(3, 1, True), (2, 1, True), (4, 2, True)]
    assert s.preemptions == 2 and kv.dropped == 0
    run_all(s)
    assert kv.used() == 0 and not kv.host


def test_a_swapped_request_that_cannot_come_back_is_recomputed_without_a_second_count():
    kv, s, (a, b, c) = three_running(swap=True)
    step(s)
    s.finish(a)
    s.finish(b)
    kv.refuse_swap_in = True
    work = step(s)
    assert not kv.host and s.running == [c]
    assert shape(work) == [(2, 4, True)]  # its prompt and output, computed again
    assert s.preemptions == 1 and kv.dropped == 0


def test_a_request_alone_that_outgrows_the_device_ends_with_length():
    kv = FakeKV(6)
    s = sched(kv)
    r = req(0, 4)
    s.add(r)
    for _ in range(3):
        step(s)
    assert r.finish_reason is None and kv.used() == 6
    plan = s.schedule()
    assert plan.work == [] and plan.outgrown == [r]
    assert s.idle() and kv.used() == 0
    assert s.preemptions == 0 and len(r.output_ids) == 3


def test_every_preempted_request_finishes_with_its_whole_output():
    for swap in (False, True):
        kv = FakeKV(40, swap=swap)
        s = sched(kv, max_step_tokens=16)
        reqs = [req(i, 10 + i, max_new=12) for i in range(5)]
        for r in reqs:
            s.add(r)
        run_all(s)
        assert s.preemptions > 0
        assert all(r.output_ids == [NEW_TOKEN] * 12 for r in reqs)
        assert kv.used() == 0 and not kv.host


# ---- reports from the engine ------------------------------------------------------------------


def test_a_lost_block_recomputes_the_request_and_keeps_its_output():
    kv = FakeKV()
    s = sched(kv)
    r, late = req(0, 5), req(1, 2)
    s.add(r)
    step(s)
    step(s)
    s.add(late)
    s.recompute(r)
    assert list(s.waiting) == [r, late] and not s.running
    assert r.num_computed == 0 and r.output_ids == [NEW_TOKEN, NEW_TOKEN]
    assert 0 not in kv.device and s.preemptions == 1 and kv.dropped == 1
    assert shape(step(s)) == [(0, 7, True), (1, 2, True)]
    assert r.output_ids == [NEW_TOKEN] * 3


def test_cancel_of_waiting_and_swapped_requests():
    kv, s, (a, b, c) = three_running(swap=True)
    step(s)
    waiting = req(3, 2)
    s.add(waiting)
    assert s.is_queued(c) and s.is_queued(waiting) and not s.is_queued(a)
    s.finish(c)
    s.finish(waiting)
    assert not s.swapped and not s.waiting and 2 not in kv.host
    s.finish(a)  # a running one (between steps)
    assert s.running == [b] and 0 not in kv.device
    s.finish(a)  # finishing twice changes nothing
    assert s.report() == RequestCounts(running=1, waiting=0, swapped=0, preemptions=1,
                                       step_tokens=512, max_batch=s.config.max_batch)  # fmt: skip


def test_drain_returns_every_request_and_empties_the_queues():
    kv, s, (a, b, c) = three_running(swap=True)
    step(s)
    late = req(3, 2)
    s.add(late)
    assert s.drain() == [a, b, late, c]
    assert s.idle()
    assert deque() == s.waiting == s.swapped


# ---- priorities and the admission window ---------------------------------------------------------


def prio(kv: KVMemory, max_batch: int = 16, aging_s: float = 1000.0, **kw) -> Scheduler[Req]:
    order: PriorityOrder[Req] = PriorityOrder(max_batch, aging_s)
    return Scheduler(kv, SchedulerConfig(max_batch, 512, **kw), order)


def test_an_urgent_request_jumps_the_waiting_queue():
    s = prio(FakeKV(), max_batch=1)
    running = req(0, 4)
    s.add(running)
    step(s)
    normal = [req(i, 4, arrival=float(i)) for i in (1, 2, 3)]
    for r in normal:
        s.add(r)
    urgent = req(9, 4, priority=-10, arrival=9.0)
    s.add(urgent)
    s.finish(running)
    assert [w.req for w in step(s, now=10.0)] == [urgent]
    s.finish(urgent)
    assert [w.req for w in step(s, now=10.0)] == [normal[0]]  # then arrival order


def test_short_memory_preempts_the_highest_value_newest_among_equals():
    kv = FakeKV(capacity=24)
    s = prio(kv)
    a, b = req(0, 7, priority=5, arrival=0.0), req(1, 7, priority=5, arrival=1.0)
    c = req(2, 7, priority=-1, arrival=2.0)
    for r in (a, b, c):
        s.add(r)
    step(s, now=3.0)  # 21 of 24 tokens held; the urgent one is served first
    assert s.running == [c, a, b]
    step(s, now=3.0)  # each needs one more: 24 fit; the next step cannot grow all three
    step(s, now=3.0)
    assert b not in s.running and a in s.running and c in s.running
    assert s.preemptions == 1


def test_ageing_never_lifts_a_request_past_an_explicit_priority():
    """Issue 31: at one level per second, a normal request that waited 10 s tied with an
    urgent -10 one (on a slow machine everyone waits that long). Background work (a value
    above 0) still ages, but only down to normal (0); an urgent request goes first however
    long the others waited."""
    s = prio(FakeKV(), max_batch=1, aging_s=1.0)
    blocker = req(0, 4)
    s.add(blocker)
    step(s)
    old = req(1, 4, priority=0, arrival=0.0)
    background = req(3, 4, priority=5, arrival=0.0)
    late_normal = req(4, 4, priority=0, arrival=9.0)
    late_urgent = req(2, 4, priority=-1, arrival=1000.0)
    for r in (old, background, late_normal, late_urgent):
        s.add(r)
    s.finish(blocker)
    assert [w.req for w in step(s, now=1000.0)] == [late_urgent]
    s.finish(late_urgent)
    # background waited 1000 s: aged to 0, where arrival breaks the tie with `old` (both 0.0,
    # then id order) and it goes before the later normal request
    order = []
    for _ in range(3):
        (w,) = step(s, now=1000.0)
        order.append(w.req)
        s.finish(w.req)
    assert order.index(background) < order.index(late_normal) and order[0] in (old, background)
    s2 = prio(FakeKV(), max_batch=1, aging_s=1.0)
    s2.add(req(0, 4))
    step(s2)
    young = req(1, 4, priority=5, arrival=999.0)
    s2.add(young)
    s2.add(req(2, 4, priority=0, arrival=1000.0))
    s2.finish(s2.running[0])
    # waited 1 s only: 5 - 1 = 4, still behind the normal request
    assert step(s2, now=1000.0)[0].req.priority == 0


def test_an_urgent_request_preempts_the_least_urgent_when_the_batch_is_full():
    """A full batch no longer makes an urgent request wait for a slot: the running request of
    the highest value (the newest among equals) is preempted, and comes back after."""
    kv = FakeKV(capacity=1000, swap=True)
    s = prio(kv, max_batch=2)
    a, b = req(0, 4, arrival=0.0), req(1, 4, priority=3, arrival=1.0)
    s.add(a)
    s.add(b)
    step(s, now=2.0)
    assert s.running == [a, b]
    urgent = req(2, 4, priority=-5, arrival=3.0)
    s.add(urgent)
    served = [w.req for w in step(s, now=3.0)]
    assert urgent in served and b not in served and s.preemptions == 1
    assert s.running == [urgent, a] and b in s.swapped
    s.add(req(3, 4, priority=0, arrival=4.0))  # equal to a: no preemption for it
    step(s, now=4.0)
    assert s.preemptions == 1


def test_an_urgent_waiting_request_goes_before_a_swapped_normal_one():
    kv = FakeKV(capacity=1000, swap=True)
    s = prio(kv, max_batch=1)
    normal = req(0, 4)
    s.add(normal)
    step(s)
    s._preempt(normal)  # swapped out, as memory pressure would
    assert s.swapped[0] is normal
    urgent = req(1, 4, priority=-5, arrival=1.0)
    s.add(urgent)
    assert [w.req for w in step(s, now=1.0)] == [urgent]
    s.finish(urgent)
    assert [w.req for w in step(s, now=1.0)] == [normal]  # then it comes back, not recomputed


def test_the_admission_window_batches_arrivals_into_one_prefill():
    s = sched(FakeKV(), admission_window_s=0.040)
    s.add(req(0, 8, arrival=0.0))
    assert step(s, now=0.010) == []  # held: the window is open and the batch is not full
    assert s.window_closes_at() == pytest.approx(0.040)
    s.add(req(1, 8, arrival=0.020))
    s.add(req(2, 8, arrival=0.030))
    work = step(s, now=0.041)  # closed: all three are prefilled together
    assert sorted(w.req.rid for w in work) == [0, 1, 2]
    assert s.window_closes_at() is None
    counts = s.report()
    assert (counts.window_on_time, counts.window_on_size) == (1, 0)  # the advice reads these
    assert counts.window_s == pytest.approx(0.040) and counts.max_batch == s.config.max_batch


def test_a_full_batch_does_not_wait_for_the_window():
    s = sched(FakeKV(), max_batch=2, admission_window_s=5.0)
    s.add(req(0, 4))
    s.add(req(1, 4))
    assert len(step(s, now=0.0)) == 2
    step(s, now=0.1)  # planned again: the same window is not counted twice
    assert (s.report().window_on_time, s.report().window_on_size) == (0, 1)


def test_window_zero_admits_at_once_and_bad_windows_are_refused():
    s = sched(FakeKV())
    s.add(req(0, 4))
    assert len(step(s, now=0.0)) == 1
    with pytest.raises(ValueError, match="admission_window_s = -1"):
        SchedulerConfig(admission_window_s=-1)
    with pytest.raises(ValueError, match="aging_s"):
        PriorityOrder(4, aging_s=0)


def test_an_urgent_prefill_gets_a_step_of_its_own_then_everyone_decodes():
    s = prio(FakeKV())
    normal = [req(i, 4, arrival=float(i)) for i in range(3)]
    for r in normal:
        s.add(r)
    step(s)  # the three prefill together
    urgent = req(9, 40, priority=-10, arrival=5.0)
    s.add(urgent)
    assert shape(step(s, now=5.0)) == [(9, 40, True)]  # alone: the others wait one step
    assert sorted(shape(step(s, now=5.0))) == [(0, 1, True), (1, 1, True), (2, 1, True),
                                               (9, 1, True)]  # fmt: skip


def test_an_urgent_request_skips_the_admission_window():
    s = prio(FakeKV(), admission_window_s=5.0)
    s.add(req(0, 4, arrival=0.0))
    step(s, now=6.0)  # admitted once its window closed
    s.add(req(1, 4, arrival=10.0))
    assert shape(step(s, now=10.0)) == [(0, 1, True)]  # the normal arrival is held
    s.add(req(2, 4, priority=-1, arrival=10.0))
    # The urgent one opens the window for the queue, and its prefill is the step.
    assert shape(step(s, now=10.001)) == [(2, 4, True)]


def test_a_step_target_cuts_prompt_chunks_to_the_measured_speed():
    """Issue 31: a request that arrives while a step runs waits for that step; a 512-token
    prefill step took 0.57 s on the 2-core CPU, so an urgent request's first token waited up
    to that long under load. With a step target the budget follows the measured seconds per
    token (a power of two between MIN_STEP_TOKENS and max_step_tokens), on any machine."""
    from unikv.engine.scheduler import MIN_STEP_TOKENS

    kv = FakeKV(capacity=10_000)
    s = sched(kv, max_step_tokens=512, step_target_s=0.1)
    assert s.step_tokens == 512  # nothing measured yet
    long = req(0, 1000)
    s.add(long)
    assert sum(len(w.tokens) for w in step(s)) == 512
    s.timed(512, 0.57)  # 1.1 ms a token: 0.1 s holds 89 tokens -> 64
    assert s.step_tokens == 64
    assert sum(len(w.tokens) for w in step(s)) == 64
    s.timed(8, 100.0)  # a few decode tokens (mostly fixed costs) say nothing about the rate
    assert s.step_tokens == 64
    for _ in range(20):  # a faster machine (or a lighter load): the budget grows back
        s.timed(64, 0.0064)
    assert s.step_tokens == 512
    for _ in range(20):  # a very slow one: never below the floor
        s.timed(64, 64.0)
    assert s.step_tokens == MIN_STEP_TOKENS
    # Decodes filling the budget do not starve a waiting prompt: it still gets the floor, and
    # `prompt_tokens_per_decode` tokens per decode row (at most max_step_tokens).
    for per, streams, want in ((0, 40, MIN_STEP_TOKENS), (4, 40, 160), (2, 10, MIN_STEP_TOKENS),
                               (4, 200, 512)):  # fmt: skip
        busy = sched(FakeKV(capacity=100_000), max_batch=256, max_step_tokens=512,
                     step_target_s=0.1, prompt_tokens_per_decode=per)  # fmt: skip
        for i in range(streams):
            busy.add(req(i, 4))
        while any(len(w.tokens) > 1 for w in step(busy)):
            pass  # the short prompts prefill
        busy.add(req(999, 2000))
        busy.timed(64, 64.0)  # the floor: 32 tokens, fewer than the decodes
        assert busy.step_tokens == MIN_STEP_TOKENS
        got = shape(step(busy))
        assert sum(1 for rid, n, _ in got if n == 1) == streams  # every stream decodes
        assert (999, want, False) in got, (per, streams)  # and the prompt moves on
    off = sched(FakeKV(capacity=10_000), max_step_tokens=512)
    off.timed(512, 5.0)  # no target: the budget alone
    assert off.step_tokens == 512
    with pytest.raises(ValueError, match="step_target_s"):
        SchedulerConfig(step_target_s=-1.0)
    with pytest.raises(ValueError, match="prompt_tokens_per_decode"):
        SchedulerConfig(prompt_tokens_per_decode=65)
