"""The async engine: requests in, tokens out, many requests batched step by step.

`Engine.create()` loads a model; `stream()` yields text as it is generated, `generate()` returns a
whole `Completion`. Here live the public async API and each request's lifecycle (sampling, text,
stop strings, finishing, the queue to its consumer). A background task steps the `Scheduler`
(`engine.scheduler`): it plans which requests run and what each feeds (continuous batching), the
engine runs that plan's forward pass on the compute thread (`engine.compute`), keeping the event
loop free, and reports the results back.
KV memory belongs to the `KVCache` the engine is given; the model stores into it, the scheduler
reserves and frees it.

NOTE: one owner. The scheduler, the KV store and its pool are touched by the compute thread
alone: each turn of the loop (`_turn`) admits the submissions and cancellations the event loop
queued (`_inbox`, `_cancels`: deques, whose append and popleft are atomic), plans, runs the
forward pass, books its results and publishes a memory report; the event loop then delivers
the text and completions the turn collected (`_outbox`) to each request's asyncio queue, and
readers on other threads get the published report. No lock guards the pool, so nothing else
may touch it: `memory.pool.CHECK_OWNER` (on in the tests) makes a mutation from another thread
raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from unikv.kvstrategies.kv import KVCache
from unikv.kvstrategies.registry import Built
from unikv.memory.pool import BlockLostError
from unikv.settings.config import PoolConfig

from . import compute, requests
from .assembly import Assembly, assemble, assemble_for
from .loading import load_model
from .model import LlamaModel
from .report import MemoryReport, ServedReport
from .requests import Completion, Piece, Request, advance, prompt_ids
from .sampling import SamplingParams, check_priority
from .scheduler import PriorityOrder, Scheduler, SchedulerConfig, Work
from .stepping import StepRunner
from .tokenizer import GGUFTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)
PUBLISH_S = 0.05  # the memory report readers on other threads see is at most this old
# The C heap's free pages go back to the OS (`compute.trim_heap`, 10-40 ms) once the engine has
# been idle IDLE_TRIM_S after running steps (a request that follows at once never waits for
# it), and under load every TRIM_S.
IDLE_TRIM_S = 1.0
TRIM_S = 30.0
# While requests run, the compute thread takes turns back to back for up to BURST_S before it
# hands back to the event loop (`Engine._turns`); each turn's tokens go out as it ends, or, with
# a stream interval, at most every so often (`Engine._due`).
BURST_S = 0.05


MAX_DECODE_STEPS = 64  # the most `decode_steps` (a packed format's block: runs end at its end)


def check_decode_steps(steps: int) -> None:
    """ValueError unless `steps` (an Engine's `decode_steps`) is an int in 1 .. MAX_DECODE_STEPS."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_DECODE_STEPS:
        raise ValueError(
            f"decode_steps must be an integer in [1, {MAX_DECODE_STEPS}], got {steps!r}"
        )


class Engine:
    """Async text generation over a `LlamaModel` with continuous batching."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: GGUFTokenizer,
        kv: KVCache | None = None,
        max_batch: int = 16,
        max_step_tokens: int = 512,
        prefix_sharing: bool = True,
        admission_window_ms: float = 0.0,
        priority_aging_s: float = 1.0,
        step_target_ms: float = 0.0,
        prompt_tokens_per_decode: int = 4,
        stream_interval_ms: float = 0.0,
        decode_steps: int = 1,
    ) -> None:
        # Checked before any KV memory is built for the engine.
        if not 0.0 <= stream_interval_ms <= 1000.0:  # (a NaN fails too)
            raise ValueError(f"stream_interval_ms must be in [0, 1000], got {stream_interval_ms}")
        check_decode_steps(decode_steps)
        plan_config = SchedulerConfig(
            max_batch, max_step_tokens, prefix_sharing, admission_window_ms / 1000.0,
            step_target_ms / 1000.0, prompt_tokens_per_decode,
        )  # fmt: skip
        order: PriorityOrder[Request] = PriorityOrder(max_batch, priority_aging_s)
        self.model, self.tokenizer = model, tokenizer
        # A cache the caller gives stays the caller's to close; one built here is the engine's.
        self._assembly: Assembly | None = None
        if kv is None:
            self._assembly = assemble_for(model, strategy="full")
            kv = self._assembly.kv.strategy
        self.kv = kv
        self._runner = StepRunner(model, kv, tokenizer)
        given = getattr(kv, "name", type(kv).__name__)
        self.kv_choice = "full (default)" if self._assembly else given
        # How the KV store was chosen and built (config, chip profile), when the engine built
        # it; None for a store the caller gave.
        self.built: Built | None = self._assembly.kv if self._assembly is not None else None
        self.scheduler: Scheduler[Request] = Scheduler(self.kv, plan_config, order)
        self.peak_kv_bytes = 0
        self._ids = itertools.count()
        self._inbox: deque[Request] = deque()  # submitted, not yet given to the scheduler
        self._cancels: deque[Request] = deque()  # cancelled, not yet finished
        self._outbox: list[tuple[Request, tuple]] = []  # what a turn delivers to the queues
        # Pieces go to the queues at most every stream_interval seconds while requests run
        # (0: as each turn ends); a request's first piece and its end go at once (`_due`)
        self.stream_interval = stream_interval_ms / 1000.0
        # Greedy decode steps a turn may run in one native call (`_sequential`; 1: one a turn)
        self.decode_steps = decode_steps
        self._delivered_at = 0.0  # time.perf_counter() of the compute thread's last delivery
        self._closed = self._cancel_all = False
        self._wakeup = asyncio.Event()
        self._published = self._report_now()  # nothing runs yet: read here, once
        self._published_at = self._trimmed_at = time.monotonic()
        self._ran_since_trim = False
        # Awaited after each step that ran, with its seconds: a hook for whoever serves the
        # engine (the replicas' simulated hot chip slows its steps with it).
        self.after_step: Callable[[float], Awaitable[None]] | None = None
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    @classmethod
    async def create(
        cls,
        model: str = "smollm2",
        *,
        dtype: str = "float32",
        device: str = "cpu",
        progress: bool = False,
        strategy: str | None = None,
        config: str | PoolConfig | None = None,
        chip: str | None = None,
        strategy_options: dict | None = None,
        kv: KVCache | None = None,
        max_batch: int | None = None,
        max_step_tokens: int = 512,
        admission_window_ms: float | None = None,
        weights: str = "native",
        stream_interval_ms: float = 0.0,
        decode_steps: int = 1,
    ) -> Engine:
        """Load `model` (off the event loop), build its KV strategy and pool, start the scheduler.

        `strategy` (a name or "auto"), `config` (a memory-tier TOML file or a `PoolConfig`),
        `chip` (a profile name) and `strategy_options` (over the file's) choose how KV is
        stored; see `engine.assembly.build_kv`. `max_batch` and `admission_window_ms` default
        to the config's `[scheduler]` table, else the chip profile's `batch_size` and
        `batching_window_ms`. `weights` (native, the default: packed where the device has a
        kernel for the format; float32; bfloat16): how the weights are kept and multiplied
        (see `engine.loading.load_model`, whose own default is the float32 reference).
        `stream_interval_ms` (0: every token as it is sampled): while requests run, their
        pieces go to the streams at most this often (a request's first piece and its end at
        once; `Engine._due` says why). `decode_steps` (1: one step a turn): while every running
        request is a plain greedy decode and nothing waits, a turn runs up to this many decode
        steps in one native call (multi-step decoding; `Engine._sequential` says when and why).
        """
        check_decode_steps(decode_steps)
        if kv is not None:
            m, tok = await compute.run(load_model, model, dtype, device, progress, weights)
            engine = cls(m, tok, kv=kv, max_batch=max_batch or 16,
                         max_step_tokens=max_step_tokens,
                         admission_window_ms=admission_window_ms or 0.0,
                         stream_interval_ms=stream_interval_ms,
                         decode_steps=decode_steps)  # fmt: skip
            engine.kv_choice = "given by the caller"
            return engine
        parts = await compute.run(assemble, model, dtype, device, strategy, config, chip,
                                  strategy_options, progress, weights)  # fmt: skip
        sched = parts.scheduling
        try:
            engine = cls(
                parts.model, parts.tokenizer, kv=parts.kv.strategy,
                max_batch=sched.max_batch if max_batch is None else max_batch,
                max_step_tokens=max_step_tokens,
                admission_window_ms=(
                    sched.admission_window_ms if admission_window_ms is None
                    else admission_window_ms
                ),
                priority_aging_s=sched.priority_aging_s,
                step_target_ms=sched.step_target_ms,
                prompt_tokens_per_decode=sched.prompt_tokens_per_decode,
                stream_interval_ms=stream_interval_ms,
                decode_steps=decode_steps,
            )  # fmt: skip
        except BaseException:
            parts.close()
            raise
        engine._assembly, engine.built = parts, parts.kv
        engine.kv_choice = f"{parts.choice}; {sched.why}"
        return engine

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- public API -------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        priority: int = 0,
        share_prefix: bool = True,
    ) -> RequestHandle:
        """Queue a request and return its handle (iterate it for text, or await `result()`).

        `priority`: lower runs first (vLLM's convention); an urgent request jumps the queue,
        and when memory is short the running request with the highest value is preempted.
        `share_prefix=False`: the request neither reads the prefix cache nor feeds it (nor
        the SSD and remote tiers behind it): a private prompt, or the start-up warm-up.
        """
        req = self._submit(prompt, params or SamplingParams(), chat, priority)
        req.shares_prefix = share_prefix
        return RequestHandle(self, req)

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
    ) -> AsyncIterator[str]:
        """Yield the answer's text piece by piece. Closing the iterator cancels the request."""
        async for piece in self.submit(prompt, params, chat=chat):
            yield piece

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
    ) -> Completion:
        """Generate a whole answer. Cancelling the awaiting task cancels the request."""
        return await self.submit(prompt, params, chat=chat).result()

    def memory_report(self) -> MemoryReport:
        """KV bytes stored and held, the peak stored, pool statistics, request counts: as of the
        last turn of the loop (published by the compute thread, which alone reads the pool)."""
        if threading.get_ident() == compute.thread_id():
            return self._report_now()
        return self._published

    def _report_now(self) -> MemoryReport:
        kv = self.kv.stats()
        # The kernel registry's choices: the strategy's attention (and a sparse selection's
        # choice) and the model's ops, with the fallbacks in force (a sentence each, which the
        # server's health view shows).
        kernels = {**kv.format.get("kernels", {}), **kv.selection.get("kernels", {}),
                   **self.model.operators.report()}  # fmt: skip
        return MemoryReport(
            kv=kv,
            model=self.model.memory_report(),
            requests=self.scheduler.report(),
            kv_bytes_peak=self.peak_kv_bytes,
            kernels=kernels,
            operator_fallbacks=tuple(r["problem"] for r in kernels.values() if "problem" in r),
        )

    @property
    def max_batch(self) -> int:
        """The most requests that run in one step."""
        return self.scheduler.config.max_batch

    def limit_batch(self, limit: int | None) -> None:
        """Admit at most `limit` requests into the running batch from now on (None: back to
        `max_batch`). Requests running beyond it finish; none is preempted for it. A replica in
        a cooling window halves its batch this way."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        self.scheduler.order.max_batch = self.max_batch if limit is None else limit
        self._wakeup.set()

    @property
    def batch_limit(self) -> int:
        """The running batch's limit now (`max_batch` unless `limit_batch` lowered it)."""
        return self.scheduler.order.max_batch

    def prefix_digest(self, limit: int = 2048) -> tuple[int, str, list[bytes]] | None:
        """The KV store's (block size, content identity, newest cached block hashes), for a
        request router's prefix affinity; None when the store shares no prefixes."""
        digest = getattr(self.kv, "prefix_digest", None)
        return digest(limit) if digest is not None else None

    async def close(self, cancel: bool = False) -> None:
        """Stop accepting requests; finish (or with `cancel`, cancel) the ones in flight."""
        self._closed = True
        if cancel:
            self._cancel_all = True  # the next turn cancels everything (on the compute thread)
        self._wakeup.set()
        await self._loop_task
        if self._assembly is not None:
            await compute.run(self._assembly.close)

    # ---- submission and cancellation --------------------------------------------------------

    def _submit(
        self, prompt: str | Sequence[int], params: SamplingParams, chat: bool, priority: int
    ) -> Request:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        ids = prompt_ids(self.tokenizer, self.model.cfg.vocab_size, prompt, chat)
        ctx = self.model.cfg.context_length
        if len(ids) >= ctx:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {ctx} tokens "
                f"(at most {ctx - 1} for the prompt)"
            )
        self.scheduler.check_fits(len(ids))
        req = Request(
            rid=next(self._ids),
            prompt_ids=ids,
            params=params,
            decoder=IncrementalDecoder(self.tokenizer),
            gen=params.make_generator(),
            priority=priority,
            arrival=time.monotonic(),
        )
        self._inbox.append(req)  # the compute thread gives it to the scheduler
        self._wakeup.set()
        return req

    def _cancel(self, req: Request) -> None:
        """Cancel a request: the next turn of the loop (at once, or right after the step in
        flight) finishes it and frees its KV on the compute thread."""
        if req.finished or req.cancelled:
            return
        req.cancelled = True
        self._cancels.append(req)
        self._wakeup.set()

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        """Finish `req` (on the compute thread: frees its KV); its last text and completion go
        out through `_outbox`."""
        req.finish_reason = reason
        if req in self._inbox:  # never reached the scheduler (closed with cancel)
            self._inbox.remove(req)
        else:
            self.scheduler.finish(req)
        if error is not None:
            self._outbox.append((req, ("error", error)))
            return
        if reason != "cancelled":
            last = requests.piece(req, req.text[req.emitted :])
            if last.text or last.logprobs or last.prompt_logprobs is not None:
                self._outbox.append((req, ("text", last)))
            req.emitted = len(req.text)
        p = req.params
        ids = req.generated
        done = Completion(
            req.text, ids, reason, len(req.prompt_ids),
            min(req.prefix_hit, len(req.prompt_ids)),
            req.logprobs[: len(ids)] if p.logprobs is not None else None,
            [None, *req.prompt_logprobs] if p.prompt_logprobs is not None else None,
        )  # fmt: skip
        self._outbox.append((req, ("done", done)))

    def _flush(self) -> None:
        """Deliver what the last turns collected (on the event loop: asyncio queues)."""
        out, self._outbox = self._outbox, []
        self._delivering(out, time.perf_counter())
        self._deliver(out)

    def _delivering(self, out: list, now: float) -> None:
        """`out` goes to the queues at `now`: its requests have streamed (`_due`)."""
        self._delivered_at = now
        for req, _ in out:
            req.streamed = True

    @staticmethod
    def _deliver(out: list) -> None:
        for req, item in out:
            req.queue.put_nowait(item)

    # ---- stepping the scheduler ---------------------------------------------------------------

    def _idle(self) -> bool:
        return (self.scheduler.idle() and not self._inbox and not self._cancels
                and not self._cancel_all)  # fmt: skip

    async def _loop(self) -> None:
        while True:
            if self._idle():
                if self._closed:
                    # The loop ends: the pool has no owner thread any more (a caller may use it).
                    await compute.run(_own_pool, self.kv, None)
                    return
                self._wakeup.clear()
                if self._ran_since_trim:
                    # Steps ran, then nothing for IDLE_TRIM_S: give the heap's free pages back.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), IDLE_TRIM_S)
                    if not self._wakeup.is_set():
                        await compute.run(self._trim)
                    continue
                await self._wakeup.wait()
                continue
            try:
                t0 = time.perf_counter()
                ran = await self._step()
                if ran and self.after_step is not None:
                    await self.after_step(time.perf_counter() - t0)
                if not ran and (closes := self.scheduler.window_closes_at()) is not None:
                    # Only the admission window holds requests back: sleep until it closes
                    # (a new arrival wakes the loop early; the window may then be full).
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._wakeup.wait(), max(0.0, closes - time.monotonic())
                        )
                    continue
            except Exception as e:  # a scheduler bug must not hang every caller
                log.exception("scheduler step failed")

                def fail_all(e: Exception = e) -> None:
                    for req in [*self.scheduler.drain(), *self._inbox]:
                        if not req.finished:
                            self._finish(req, "error", RuntimeError(f"scheduler failure: {e}"))
                    self._published = self._report_now()

                await compute.run(fail_all)
                self._flush()
            # Give consumers a chance to run (and cancel) between steps.
            await asyncio.sleep(0)

    def check_running(self) -> None:
        """Raise RuntimeError, with the loop's own exception, if the engine's loop has stopped
        (a health check restarts such an engine)."""
        task = self._loop_task
        if task.done():
            why = "cancelled" if task.cancelled() else task.exception() or "the engine was closed"
            raise RuntimeError(f"the engine loop stopped: {why}")

    async def _step(self) -> bool:
        """Turns on the compute thread (`_turns`; one `_turn` where a hook awaits each step),
        their deliveries on the event loop; False when nothing ran."""
        if self.after_step is not None:
            turns, args = self._turn, (time.monotonic(),)
        else:
            loop = asyncio.get_running_loop()
            turns, args = self._turns, (lambda out: loop.call_soon_threadsafe(self._deliver, out),)
        try:
            return await compute.run(turns, *args)
        finally:
            self._flush()

    def _turns(self, deliver: Callable[[list], object]) -> bool:
        """Turns back to back while requests run, for up to BURST_S, each turn's deliveries
        handed to `deliver` (the event loop's queue) as it ends; whether any turn ran.

        Why: handing every turn to the event loop and back cost about 0.2 ms a decode step (two
        thread wake-ups, with cold caches after the step's weights went through them): through
        the engine a SmolLM2 step took 0.49-0.56 ms between its C calls where the benchmarks'
        loop took 0.22. New requests and cancellations are read at each turn's start, as
        before; a cancellation that arrives while a turn runs takes effect at the next one."""
        end = time.perf_counter() + BURST_S
        ran_any = False
        while True:
            ran = self._turn(time.monotonic())
            ran_any = ran_any or ran
            if not ran or self._closed or self._idle() or time.perf_counter() >= end:
                return ran_any  # what the outbox holds goes out as the burst ends (`_step`)
            if self._outbox and self._due():
                out, self._outbox = self._outbox, []
                deliver(out)

    def _due(self) -> bool:
        """Whether the outbox goes to the queues at the end of this turn: always without a
        stream interval; with one, where a request's first piece is in it (its time to first
        token), a request ended (its caller waits for that), or the interval has passed since
        the last delivery.

        Why an interval: each delivery wakes the event loop's thread, which then runs beside
        the step's threads (on a 2-core machine it takes one of their cores during the next
        step) and costs the compute thread a cross-thread call. SmolLM2 through the engine on
        a 2-core AMD EPYC (`full`, 256 tokens, 20 ms against none, same process): 399 against
        504 us between two steps' C calls (the benchmarks' loop: 244); the requests' tokens/s
        1.02x (`full`) and 0.99x (`auto`), medians of 10 rounds each, within the VM's noise."""
        now = time.perf_counter()
        waited = now - self._delivered_at >= self.stream_interval  # (0: always)
        due = waited or any(item[0] != "text" or not req.streamed for req, item in self._outbox)
        if due:
            self._delivering(self._outbox, now)
        return due

    def _turn(self, now: float) -> bool:
        """Admit, reap cancellations, plan, run the forward pass and book its results; publish
        the memory report. On the compute thread (the pool's owner)."""
        _own_pool(self.kv, threading.get_ident())
        try:
            return self._turn_body(now)
        finally:
            # The report costs about 0.5 ms (2% of a decode step): published when a request
            # ended or the engine goes idle (what callers wait for), else at most every
            # PUBLISH_S (what /health and /metrics read).
            t = time.monotonic()
            ended = any(item[0] != "text" for _, item in self._outbox)
            idle = self._idle()
            if ended or idle or t - self._published_at >= PUBLISH_S:
                self._published, self._published_at = self._report_now(), t
            if t - self._trimmed_at >= TRIM_S:
                self._trim()

    def _trim(self) -> None:
        compute.trim_heap()
        self._trimmed_at, self._ran_since_trim = time.monotonic(), False

    def _turn_body(self, now: float) -> bool:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        if self._cancel_all:
            self._cancel_all = False
            sched = self.scheduler
            for req in [*sched.waiting, *sched.running, *sched.swapped]:
                self._cancel(req)
        while self._cancels:
            req = self._cancels.popleft()
            if not req.finished:
                self._finish(req, "cancelled")
        plan = self.scheduler.schedule(now)
        for req in plan.outgrown:
            self._finish(req, "length")
        if not plan.work:
            return False  # preempted this round, or held by the window; admission brings it
        t0 = time.perf_counter()
        self._ran_since_trim = True
        steps = self._sequential(plan.work)
        results = self._runner.run(plan.work, steps) if steps > 1 else None
        if results is None:  # (one step, or a sequential run the model could not take)
            results = self._runner.run(plan.work)
        tokens = sum(len(o) if isinstance(o, list) else len(w.tokens) for w, o in results)
        self.scheduler.timed(tokens, time.perf_counter() - t0)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv.bytes_used())
        for work, outcome in results:
            req = work.req
            if req.finished:
                continue
            if req.cancelled:
                self._finish(req, "cancelled")
            elif isinstance(outcome, BlockLostError):
                # A lost or corrupt block on disk: its output so far is kept.
                log.warning("request %d: %s; recomputing its KV", req.rid, outcome)
                self.scheduler.recompute(req)
            elif isinstance(outcome, BaseException):
                self._finish(req, "error", outcome)
            elif isinstance(outcome, list):  # a sequential run's tokens (`_sequential`)
                self._book_run(work, outcome)
            else:
                lps = self._runner.logprobs.get(id(work), {})
                req.prompt_logprobs.extend(lps.get("prompt", ()))
                if "token" in lps:
                    req.logprobs.append(lps["token"])
                self.scheduler.computed(work)
                if outcome is not None:
                    eos, ctx = self.tokenizer.eos_id, self.model.cfg.context_length
                    text, reason = advance(req, outcome, eos, ctx)
                    if text:
                        self._outbox.append((req, ("text", requests.piece(req, text))))
                    if reason is not None:
                        self._finish(req, reason)
                elif work.needs_logits and req.params.max_new_tokens == 0:
                    self._finish(req, "length")  # the prompt alone was asked for
        self._runner.logprobs.clear()
        return True

    def _sequential(self, work: list) -> int:
        """How many decode steps this turn runs in one native call (`LlamaModel.decode`): up
        to `decode_steps` while every request in the batch is a decode whose next tokens are
        plain argmaxes or draws (greedy or sampled, `sampling.draw`; no repetition penalty,
        min_tokens reached, no log-probabilities) and nothing waits to be admitted or swapped
        in, and no request's length or context limit, nor what the cache can run so
        (`KVCache.sequential`), comes sooner; else 1.

        Why: between two steps' native calls the engine's Python (the scheduler, the step's
        tensors, sampling, the strategy's bookkeeping, the report) runs with caches the step's
        weights have just emptied: 0.5-0.8 ms of a SmolLM2 step of 4-5 ms on a 2-core AMD EPYC.
        Steps run back to back share one such gap; their tokens come out together (a stream's
        pieces in bursts, as with vLLM's multi-step scheduling). A request that stops inside a
        run (EOS, a stop string) drops the tokens after its stop; its KV is freed with it."""
        steps = self.decode_steps
        sched = self.scheduler
        if steps < 2 or self._inbox or self._cancels or sched.waiting or sched.swapped:
            return 1
        if not self.model.decodes(len(work)):  # (float32 weights: a step a turn)
            return 1
        ctx = self.model.cfg.context_length
        for w in work:
            req, p = w.req, w.req.params
            if (len(w.tokens) != 1 or not w.needs_logits or req.num_computed + 1 != len(req.tokens)
                    or p.repetition_penalty != 1.0 or p.logprobs is not None
                    or req.wants_prompt_logits or len(req.output_ids) < p.min_tokens):  # fmt: skip
                return 1
            steps = min(steps, p.max_new_tokens - len(req.output_ids), ctx - 1 - req.num_computed)
            if steps < 2:
                return 1
            steps = self.kv.sequential(req.rid, steps)
        return steps

    def _book_run(self, work, tokens: list[int]) -> None:
        """A sequential run's tokens for `work`'s request, as its steps one by one would have
        booked them (`advance`), up to the one that finishes it; its KV is offered for sharing
        once, after them."""
        req, sched = work.req, self.scheduler
        fed = [work.tokens[0], *tokens[:-1]]  # the token each step fed
        eos, ctx = self.tokenizer.eos_id, self.model.cfg.context_length
        for i, token in enumerate(tokens):
            sched.computed(Work(req, [fed[i]], True), publish=False)
            text, reason = advance(req, token, eos, ctx)
            if text:
                self._outbox.append((req, ("text", requests.piece(req, text))))
            if reason is not None or i == len(tokens) - 1:
                sched.publish(req)
            if reason is not None:
                self._finish(req, reason)  # (its KV, with the later steps', is freed)
                return


@runtime_checkable
class ServedEngine(Protocol):
    """What a server needs of an engine, and all it may use: one process's `Engine`, or the
    client of engine replicas (`serving.replicas.ReplicaClient`) behind the same calls."""

    tokenizer: GGUFTokenizer  # encode, decode, the chat template
    model: Any  # `.cfg.context_length`

    @property
    def max_batch(self) -> int: ...

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
        priority: int = 0,
    ) -> RequestHandle: ...  # fmt: skip

    def memory_report(self) -> ServedReport: ...

    async def close(self, cancel: bool = False) -> None: ...


class RequestHandle:
    """One submitted request: iterate it for text pieces, or await `result()`."""

    def __init__(self, engine: Engine, req: Request) -> None:
        self._engine, self._req = engine, req
        self.completion: Completion | None = None

    @property
    def prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self._req.prompt_ids)

    async def __aiter__(self) -> AsyncIterator[str]:
        async for piece in self.pieces():
            if piece.text:
                yield piece.text

    async def pieces(self) -> AsyncIterator[Piece]:
        """The stream as `Piece`s: text with the log-probabilities asked for."""
        try:
            while True:
                kind, payload = await self._req.queue.get()
                if kind == "text":
                    yield payload
                elif kind == "done":
                    self.completion = payload
                    return
                else:
                    raise payload
        finally:
            self.cancel()

    async def result(self) -> Completion:
        """Wait for the whole completion (consumes the stream)."""
        async for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def cancel(self) -> None:
        """Cancel the request (no-op once it has finished); its KV memory is released."""
        self._engine._cancel(self._req)


def _own_pool(kv: KVCache, ident: int | None) -> None:
    """Make thread `ident` the only one that may mutate `kv`'s pool (None: any thread)."""
    pool = getattr(kv, "pool", None)
    if pool is not None:
        pool.owner = ident
