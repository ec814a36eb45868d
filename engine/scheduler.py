"""The scheduler: which requests run in the next step, and what each of them feeds the model.

Lives here: the waiting / running / swapped queues, admission under the memory watermark, the
step plan (one token for each decoding request first, then prompt chunks within a token budget),
KV reservation with preemption (swap out if the memory can, else drop to recompute), swap-in and
requeueing, and the admission window (requests arriving within `admission_window_s` of the
oldest waiting one are admitted together, so their prompts are prefilled in one step). The order
requests are served and preempted in, and the batch limit, are decided in one place: an order
(`FifoOrder`, or `PriorityOrder`: lower `priority` first, aged by waiting time).

Not here: the model, tensors, asyncio, tokenizers, sampling and streaming. The engine runs the
plan's forward pass and reports back (`computed`, `finish`, `recompute`). KV memory is reached
only through the scheduler-facing `kvstrategies.kv.KVMemory`; this module imports no torch.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # for annotations only: importing kvstrategies.kv would import torch
    from unikv.kvstrategies.kv import KVMemory


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """The scheduler's queues now, its preemptions so far, this step's token budget, its batch
    limit and admission window, and how the windows closed so far (by time, or by a full batch:
    what the advice on the window reads)."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    preemptions: int = 0
    step_tokens: int = 0
    max_batch: int = 0
    window_s: float = 0.0
    window_on_time: int = 0
    window_on_size: int = 0


class Schedulable(Protocol):
    """What the scheduler reads and writes on a request."""

    rid: int  # the sequence id in KV memory
    num_computed: int  # tokens fed through the model (their KV is stored)
    prefix_hit: int  # the most prompt tokens whose KV came from the prefix cache
    priority: int  # lower runs first (vLLM's convention); FifoOrder ignores it
    arrival: float  # when it was submitted, in the scheduler's clock (seconds)
    wants_prompt_logits: bool  # every prompt token computed (never from the prefix cache)
    shares_prefix: bool  # looks up the prefix cache and publishes its blocks to it

    @property
    def tokens(self) -> list[int]:
        """Everything to feed: the prompt, then the tokens generated so far."""
        ...


R = TypeVar("R", bound=Schedulable)
MIN_STEP_TOKENS = 32  # the smallest token budget a step target cuts to


@dataclass(slots=True)
class SchedulerConfig:
    """How much one step may hold, and whether new requests look for a cached prefix."""

    max_batch: int = 16  # requests running at once
    max_step_tokens: int = 512  # tokens fed through the model in one step
    # Off: every request computes its whole prompt (benchmarks that compare compute).
    prefix_sharing: bool = True
    # New requests wait until the oldest of them has waited this long (or the batch's free
    # slots are all asked for), then are admitted together: their prompts share one prefill.
    admission_window_s: float = 0.0
    # Prompt chunks are cut so a step takes about this long at the speed steps were measured
    # at (`Scheduler.timed`; 0: `max_step_tokens` alone), but never below MIN_STEP_TOKENS
    # prompt tokens while prompts wait. A request that arrives while a step runs waits for that
    # step: this bounds how long an urgent one waits on any machine.
    step_target_s: float = 0.0
    # With a step target, while prompts wait a step carries at least this many prompt tokens
    # per decoding request (up to `max_step_tokens` in all): under many streams the prompts'
    # share of a step grows with them, so the queue drains as fast as it fills.
    prompt_tokens_per_decode: int = 4

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_step_tokens < 1:
            raise ValueError(
                "max_batch and max_step_tokens must be >= 1, "
                f"got {self.max_batch}, {self.max_step_tokens}"
            )
        if not 0.0 <= self.step_target_s <= 60.0:
            raise ValueError(f"step_target_s = {self.step_target_s}; allowed: 0 to 60 seconds")
        if not 0 <= self.prompt_tokens_per_decode <= 64:
            raise ValueError(
                f"prompt_tokens_per_decode = {self.prompt_tokens_per_decode}; allowed: 0 to 64"
            )
        if not 0.0 <= self.admission_window_s <= 10.0:
            raise ValueError(
                f"admission_window_s = {self.admission_window_s}; allowed: 0 to 10 seconds"
            )


@dataclass(slots=True)
class Work(Generic[R]):
    """One request's share of a step: the tokens it feeds, starting at `req.num_computed`."""

    req: R
    tokens: list[int]
    needs_logits: bool  # True when this chunk ends the known tokens (a new token follows)


@dataclass(slots=True)
class StepPlan(Generic[R]):
    """The next forward pass, and the requests that can never be given room."""

    work: list[Work[R]]  # in serving order
    # Alone on the device and still no room to grow: the engine finishes them with "length".
    outgrown: list[R]


class FifoOrder(Generic[R]):
    """Arrival order, and the batch limit: every ordering decision the scheduler makes.

    The queues and the running list are kept in serving order by the insertions below; the
    scheduler always takes a queue's head, serves (plans, reserves) the running list front to
    back and preempts its last request. A priority order (lower `priority` first; the highest
    value, newest among equals, preempted first) is a drop-in replacement for this class.
    """

    __slots__ = ("max_batch",)

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch

    def has_room(self, running: Sequence[R]) -> bool:
        """Whether one more request may join the running batch."""
        return len(running) < self.max_batch

    def admit(self, running: list[R], req: R) -> None:
        """Add `req` to the running batch: behind those admitted before it."""
        running.append(req)

    def victim(self, running: Sequence[R]) -> R:
        """The running request to preempt first when memory is short: the newest."""
        return running[-1]

    def enqueue(self, queue: deque[R], req: R) -> None:
        """Queue a new or swapped-out request behind the ones already queued."""
        queue.append(req)

    def requeue(self, queue: deque[R], req: R) -> None:
        """Queue a request that lost its KV: it was running already, so it goes first."""
        queue.appendleft(req)

    def arrange(self, queue: deque[R], now: float) -> None:
        """Bring the queue into serving order as of `now` (arrival order never changes)."""

    def jumps(self, waiting: R, swapped: R, now: float) -> bool:
        """Whether a waiting request goes before a swapped-out one: never, in arrival order."""
        return False

    def displaces(self, waiting: R, running: Sequence[R]) -> R | None:
        """The running request a waiting one takes the place of when the batch is full: none,
        in arrival order."""
        return None

    def urgent(self, waiting: R, running: Sequence[R]) -> bool:
        """Whether a waiting request skips the admission window: never, in arrival order."""
        return False

    def focus(self, running: list[R]) -> list[R]:
        """The running requests the next step plans work for: all of them."""
        return running


class PriorityOrder(FifoOrder[R]):
    """Lower `priority` first (vLLM's convention), then arrival; the batch limit as FifoOrder.

    The running batch is kept in (priority, arrival) order, so the request preempted first when
    memory is short is the one with the highest value, the newest among equals; a waiting
    request more urgent than that one takes its place when the batch is full (it is preempted:
    swapped out, or dropped to recompute). Starvation guard: a queued request of a value above
    0 (background work) improves by one for every `aging_s` seconds it has waited, down to 0 at
    most. Ageing never lifts a request past an explicit priority: an urgent (negative) request
    goes before every normal one however long they waited (issue 31: ageing of one per second
    let every request that waited 10 s tie with -10, so on a slow machine, where everyone
    waits, urgency dissolved exactly when it mattered).
    """

    __slots__ = ("aging_s",)

    def __init__(self, max_batch: int, aging_s: float = 1.0) -> None:
        super().__init__(max_batch)
        if not aging_s > 0:
            raise ValueError(f"aging_s = {aging_s}; expected seconds > 0")
        self.aging_s = aging_s

    def effective(self, req: R, now: float) -> tuple[float, float]:
        """The sort key of a queued request at `now`: aged priority, then arrival."""
        if req.priority <= 0:
            return (float(req.priority), req.arrival)
        aged = req.priority - max(0.0, now - req.arrival) / self.aging_s
        return (max(0.0, aged), req.arrival)

    def admit(self, running: list[R], req: R) -> None:
        """Insert `req` into the running batch by (priority, arrival)."""
        keys = [(r.priority, r.arrival) for r in running]
        running.insert(bisect.bisect_right(keys, (req.priority, req.arrival)), req)

    def enqueue(self, queue: deque[R], req: R) -> None:
        queue.append(req)  # `arrange` sorts the queue when it is read

    def requeue(self, queue: deque[R], req: R) -> None:
        queue.appendleft(req)  # likewise; it arrived before the others, so ties go its way

    def arrange(self, queue: deque[R], now: float) -> None:
        ordered = sorted(queue, key=lambda r: self.effective(r, now))
        queue.clear()
        queue.extend(ordered)

    def jumps(self, waiting: R, swapped: R, now: float) -> bool:
        # Only a more urgent request overtakes one whose KV already waits on the host.
        return waiting.priority < swapped.priority

    def displaces(self, waiting: R, running: Sequence[R]) -> R | None:
        # The least urgent running request (the last, newest among equals), if `waiting` is
        # more urgent by its explicit priority.
        return running[-1] if running and waiting.priority < running[-1].priority else None

    def urgent(self, waiting: R, running: Sequence[R]) -> bool:
        # More urgent than everything running: batching it with later arrivals only delays it.
        return bool(running) and waiting.priority < min(r.priority for r in running)

    def focus(self, running: list[R]) -> list[R]:
        """While a request more urgent than others is prefilling, the step is its own (and
        its peers'): the others' decode tokens wait one step, so the urgent prompt's first
        token comes after a prefill, not after a prefill plus everyone's decode."""
        if not running:
            return running
        top = running[0].priority  # the batch is in (priority, arrival) order
        if running[-1].priority == top:
            return running
        if any(len(r.tokens) - r.num_computed > 1 for r in running if r.priority == top):
            return [r for r in running if r.priority == top]
        return running


class Scheduler(Generic[R]):
    """Continuous batching over a `KVMemory`: admission, step plans, reservation, preemption."""

    def __init__(
        self, kv: KVMemory, config: SchedulerConfig | None = None, order: FifoOrder[R] | None = None
    ) -> None:
        self.kv = kv
        self.config = config if config is not None else SchedulerConfig()
        self.order: FifoOrder[R] = order if order is not None else FifoOrder(self.config.max_batch)
        self.waiting: deque[R] = deque()  # new requests, and dropped ones to recompute
        self.running: list[R] = []  # in serving order (see `order`)
        self.swapped: deque[R] = deque()  # KV moved off the device, to be swapped back in
        self.preemptions = 0  # swapped out or dropped, including lost KV recomputed
        self.step_tokens = self.config.max_step_tokens  # this step's token budget
        self._token_s: float | None = None  # measured seconds per token of prompt-sized steps
        # How admission windows closed: "time" (the oldest waited the window out), "size" (the
        # waiting filled the batch's free slots); counted once per oldest waiting request.
        self.window_closes = {"time": 0, "size": 0}
        self._window_counted: object = None

    # ---- what the engine calls --------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ValueError if a prompt this long (plus one new token) can never be held."""
        cap = self.kv.capacity_tokens()
        if cap is not None and num_prompt_tokens + 1 > cap:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens; the device tier holds KV for {cap} "
                "tokens (give it more capacity in the config file)"
            )

    def add(self, req: R) -> None:
        """Queue a new request; it is admitted at a coming step."""
        self.order.enqueue(self.waiting, req)

    def idle(self) -> bool:
        """Whether no request is queued or running."""
        return not self.waiting and not self.running and not self.swapped

    def is_queued(self, req: R) -> bool:
        """Whether `req` waits (new, dropped or swapped out) rather than runs."""
        return req in self.waiting or req in self.swapped

    def schedule(self, now: float = 0.0) -> StepPlan[R]:
        """Admit what memory (and the admission window, as of `now`) allows, plan the next
        step and reserve KV room for it."""
        self._admit(now)
        return self._reserve(self._plan())

    def window_closes_at(self) -> float | None:
        """When the admission window lets the waiting requests in (None: nothing waits for
        it). The engine sleeps until then when nothing else can run."""
        if not self.waiting or not self.config.admission_window_s:
            return None
        return min(r.arrival for r in self.waiting) + self.config.admission_window_s

    def computed(self, work: Work[R], publish: bool = True) -> None:
        """`work` ran: its tokens' KV is stored now; offer it for prefix sharing (unless not
        `publish`: a sequential run offers it once, after its last step)."""
        work.req.num_computed += len(work.tokens)
        if publish:
            self.publish(work.req)

    def publish(self, req: R) -> None:
        """Offer the KV of `req`'s computed tokens for prefix sharing (where it shares)."""
        if req.shares_prefix:
            self.kv.publish(req.rid, req.tokens[: req.num_computed])

    def forget_timing(self) -> None:
        """Drop the measured speed (after a warm-up, whose cold steps are no measure of it)."""
        self._token_s = None
        self.step_tokens = self.config.max_step_tokens

    def timed(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds`: with a step target, size the next steps'
        token budget to it (a power of two, at least MIN_STEP_TOKENS, at most
        `max_step_tokens`; steps under MIN_STEP_TOKENS, mostly fixed costs, are not counted)."""
        target = self.config.step_target_s
        if not target or tokens < MIN_STEP_TOKENS or not seconds > 0:
            return
        per = seconds / tokens
        self._token_s = per if self._token_s is None else 0.7 * self._token_s + 0.3 * per
        fit = max(MIN_STEP_TOKENS, int(target / self._token_s))
        self.step_tokens = min(self.config.max_step_tokens, 1 << (fit.bit_length() - 1))

    def recompute(self, req: R) -> None:
        """Part of `req`'s KV cannot be read back (a lost block): compute all of it again."""
        self.running.remove(req)
        self._requeue(req, count=True)

    def finish(self, req: R) -> None:
        """Forget `req` wherever it is and free its KV (idempotent)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.swapped:
            self.swapped.remove(req)
        self.kv.free(req.rid)

    def drain(self) -> list[R]:
        """Empty every queue; return what they held (running first, then waiting, swapped)."""
        reqs = [*self.running, *self.waiting, *self.swapped]
        self.running.clear()
        self.waiting.clear()
        self.swapped.clear()
        return reqs

    def report(self) -> RequestCounts:
        """Request counts for memory reports."""
        c = self.config
        return RequestCounts(len(self.running), len(self.waiting), len(self.swapped),
                             self.preemptions, self.step_tokens, c.max_batch,
                             c.admission_window_s, self.window_closes["time"],
                             self.window_closes["size"])  # fmt: skip

    # ---- one step -----------------------------------------------------------------------------

    def _admit(self, now: float) -> None:
        """Swapped-out requests come back first (unless the order lets a waiting one jump
        them), then waiting ones, while memory and the admission window allow."""
        self.order.arrange(self.swapped, now)
        self.order.arrange(self.waiting, now)
        while self.swapped and self.order.has_room(self.running):
            req = self.swapped[0]
            if self.waiting and self.order.jumps(self.waiting[0], req, now):
                break
            if not self.kv.swap_in(req.rid):
                if self.running:
                    return  # keep the order: nobody overtakes a swapped request
                # Even an empty device cannot take it back: recompute it instead. It was
                # counted as a preemption when it was swapped out.
                self.swapped.popleft()
                self._requeue(req, count=False)
                self.order.arrange(self.waiting, now)
                break
            self.order.admit(self.running, self.swapped.popleft())
        if self._window_holds(now):
            return
        # A full batch: a more urgent waiting request preempts the least urgent running one.
        while self.waiting and not self.order.has_room(self.running):
            victim = self.order.displaces(self.waiting[0], self.running)
            if victim is None:
                break
            self._preempt(victim)
        while self.waiting and self.order.has_room(self.running):
            req = self.waiting[0]
            tokens = req.tokens
            # The watermark keeps room for running requests to grow; with none running, the
            # head of the queue always gets its chance (it fits: `check_fits` said so).
            if self.running and not self.kv.can_admit(len(tokens) + 1):
                return
            self.order.admit(self.running, self.waiting.popleft())
            if (req.num_computed == 0 and self.config.prefix_sharing and req.shares_prefix
                    and not req.wants_prompt_logits):  # fmt: skip
                req.num_computed = self.kv.match_prefix(req.rid, tokens)
                req.prefix_hit = max(req.prefix_hit, req.num_computed)

    def _window_holds(self, now: float) -> bool:
        """Whether the admission window still holds the waiting requests back: the oldest has
        waited less than the window, and they do not yet fill the batch's free slots."""
        closes = self.window_closes_at()
        if closes is None:
            return False
        if now >= closes:
            self._window_closed("time")
            return False
        free = self.config.max_batch - len(self.running)
        if self.order.urgent(self.waiting[0], self.running):
            return False  # an urgent request does not wait for company
        if len(self.waiting) < free:
            return True
        self._window_closed("size")
        return False

    def _window_closed(self, how: str) -> None:
        """Count a window's close once (the same oldest request may be planned again)."""
        oldest = min(self.waiting, key=lambda r: r.arrival)
        if oldest is not self._window_counted:
            self._window_counted = oldest
            self.window_closes[how] += 1

    def _plan(self) -> list[Work[R]]:
        """Decode tokens first (one per request), then prompt chunks within the token budget."""
        budget = self.step_tokens
        plan: list[Work[R]] = []
        known = [(req, req.tokens) for req in self.order.focus(self.running)]
        for req, tokens in known:
            if req.num_computed == len(tokens) - 1:
                plan.append(Work(req, [tokens[-1]], True))
                budget -= 1
        if self.config.step_target_s:
            # Prompts still get MIN_STEP_TOKENS a step when decodes fill the budget, and
            # `prompt_tokens_per_decode` for each decode row (under 32 streams the decodes
            # alone filled it, and a prompt that gets no chunk waits for decodes to finish).
            # Measured at 32 cold prompts (BENCHMARKS.md): a floor of 32 tokens took TTFT p50
            # from 11.5 to 8.5 s, 4 per decode row (128) to 0.8 s, at an inter-token p99 of
            # 288 against 186 ms.
            decodes = len(plan)
            per = min(self.config.prompt_tokens_per_decode * decodes, self.config.max_step_tokens)
            budget = max(budget, MIN_STEP_TOKENS, per)
        for req, tokens in known:
            remaining = len(tokens) - req.num_computed
            if remaining > 1 or (remaining == 1 and req.num_computed == 0):
                if budget <= 0:
                    break
                n = min(remaining, budget)
                chunk = tokens[req.num_computed : req.num_computed + n]
                plan.append(Work(req, chunk, n == remaining))
                budget -= n
        return plan

    def _reserve(self, plan: list[Work[R]]) -> StepPlan[R]:
        """Reserve KV room for every item, preempting the last-served requests when short."""
        ready: list[Work[R]] = []
        outgrown: list[R] = []
        # In serving order: a victim (the last running request) is never one already served.
        for work in sorted(plan, key=lambda w: self.running.index(w.req)):
            if work.req not in self.running:
                continue  # preempted while making room for a request served before it
            while not self.kv.reserve(work.req.rid, len(work.tokens)):
                victim = self.order.victim(self.running)
                if victim is not work.req:
                    self._preempt(victim)
                elif len(self.running) == 1:
                    # Alone and still no room: this request has outgrown the device tier.
                    self.finish(work.req)
                    outgrown.append(work.req)
                    break
                else:
                    self._preempt(work.req)
                    break
            else:
                ready.append(work)
        return StepPlan(ready, outgrown)

    def _preempt(self, req: R) -> None:
        """Take `req` off the device: swap its KV out if possible, else drop it to recompute."""
        self.running.remove(req)
        if self.kv.swap_out(req.rid):
            self.preemptions += 1
            self.order.enqueue(self.swapped, req)
        else:
            self._requeue(req, count=True)

    def _requeue(self, req: R, *, count: bool) -> None:
        """Free `req`'s KV and queue it to be computed again (its output so far is kept);
        `count` it as a preemption unless it was counted already."""
        self.kv.free(req.rid)
        if count:
            self.kv.record_preemption()
            self.preemptions += 1
        req.num_computed = 0
        self.order.requeue(self.waiting, req)
