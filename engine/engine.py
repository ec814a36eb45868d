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
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from unikv.kvstrategies.kv import KVCache, StepBatch
from unikv.kvstrategies.registry import Built
from unikv.memory.pool import BlockLostError
from unikv.settings.config import PoolConfig

from . import compute
from .assembly import Assembly, assemble, assemble_for
from .loading import load_model
from .model import LlamaModel
from .sampling import SamplingParams, TokenLogprob, check_priority, logprobs_of, sample
from .scheduler import PriorityOrder, Scheduler, SchedulerConfig, Work
from .tokenizer import GGUFTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)
PUBLISH_S = 0.05  # the memory report readers on other threads see is at most this old
# The C heap's free pages go back to the OS (`compute.trim_heap`, 10-40 ms) once the engine has
# been idle IDLE_TRIM_S after running steps (a request that follows at once never waits for
# it), and under load every TRIM_S.
IDLE_TRIM_S = 1.0
TRIM_S = 30.0


@dataclass(slots=True)
class Completion:
    """The result of one request."""

    text: str
    token_ids: list[int]  # generated, with the EOS or stop token that ended it (as vLLM counts)
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # With `SamplingParams.logprobs`: one per generated token; with `prompt_logprobs`: one per
    # prompt token (None for the first, which nothing predicts).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


@dataclass(slots=True)
class Piece:
    """A piece of a request's stream: new text, the log-probabilities of the tokens generated
    since the last piece (with `SamplingParams.logprobs`; the pieces' lists add up to the
    completion's) and, on the first piece only, the prompt's (with `prompt_logprobs`)."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class _Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder
    gen: torch.Generator | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival: float = 0.0  # time.monotonic() at submission
    num_computed: int = 0  # tokens fed through the model (their KV is in the cache)
    output_ids: list[int] = field(default_factory=list)
    prefix_hit: int = 0  # prompt tokens whose KV came from the prefix cache
    emitted: int = 0  # characters of decoded text already streamed
    finish_reason: str | None = None
    cancelled: bool = False
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    stop_token: int | None = None  # the EOS or stop token that ended it (never fed)
    logprobs_sent: int = 0  # of `logprobs`, how many went out with pieces
    prompt_sent: bool = False  # whether the prompt's log-probabilities went out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether every prompt token's logits are wanted (so none comes from the cache)."""
        return self.params.prompt_logprobs is not None

    @property
    def generated(self) -> list[int]:
        """The generated token ids as a client counts them: the outputs, then the EOS or stop
        token that ended the request (vLLM's convention; its text is never in the answer)."""
        return self.output_ids + ([] if self.stop_token is None else [self.stop_token])

    @property
    def tokens(self) -> list[int]:
        """Everything to feed: the prompt, then the outputs (a stop token is never one)."""
        return self.prompt_ids + self.output_ids


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
    ) -> None:
        # Checked before any KV memory is built for the engine.
        plan_config = SchedulerConfig(
            max_batch, max_step_tokens, prefix_sharing, admission_window_ms / 1000.0,
            step_target_ms / 1000.0,
        )  # fmt: skip
        order: PriorityOrder[_Request] = PriorityOrder(max_batch, priority_aging_s)
        self.model, self.tokenizer = model, tokenizer
        # A cache the caller gives stays the caller's to close; one built here is the engine's.
        self._assembly: Assembly | None = None
        if kv is None:
            self._assembly = assemble_for(model, strategy="full")
            kv = self._assembly.kv.strategy
        self.kv = kv
        self.kv_choice = "full (default)" if self._assembly else type(kv).__name__
        self.scheduler: Scheduler[_Request] = Scheduler(self.kv, plan_config, order)
        self.peak_kv_bytes = 0
        self._ids = itertools.count()
        self._inbox: deque[_Request] = deque()  # submitted, not yet given to the scheduler
        self._cancels: deque[_Request] = deque()  # cancelled, not yet finished
        self._outbox: list[tuple[_Request, tuple]] = []  # what a turn delivers to the queues
        self._step_lps: dict[int, dict] = {}  # id(work) -> the log-probabilities it computed
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
    ) -> Engine:
        """Load `model` (off the event loop), build its KV strategy and pool, start the scheduler.

        `strategy` (a name or "auto"), `config` (a memory-tier TOML file or a `PoolConfig`),
        `chip` (a profile name) and `strategy_options` (over the file's) choose how KV is
        stored; see `engine.assembly.build_kv`. `max_batch` and `admission_window_ms` default
        to the config's `[scheduler]` table, else the chip profile's `batch_size` and
        `batching_window_ms`. `weights` (native, the default: packed where the device has a
        kernel for the format; float32; bfloat16): how the weights are kept and multiplied
        (see `engine.loading.load_model`, whose own default is the float32 reference).
        """
        if kv is not None:
            m, tok = await compute.run(load_model, model, dtype, device, progress, weights)
            engine = cls(m, tok, kv=kv, max_batch=max_batch or 16,
                         max_step_tokens=max_step_tokens,
                         admission_window_ms=admission_window_ms or 0.0)  # fmt: skip
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
            )  # fmt: skip
        except BaseException:
            parts.close()
            raise
        engine._assembly = parts
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
    ) -> RequestHandle:
        """Queue a request and return its handle (iterate it for text, or await `result()`).

        `priority`: lower runs first (vLLM's convention); an urgent request jumps the queue,
        and when memory is short the running request with the highest value is preempted.
        """
        req = self._submit(prompt, params or SamplingParams(), chat, priority)
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

    def memory_report(self) -> dict:
        """KV bytes stored and held, the peak stored, pool statistics, request counts: as of the
        last turn of the loop (published by the compute thread, which alone reads the pool)."""
        if threading.get_ident() == compute.thread_id():
            return self._report_now()
        return self._published

    def _report_now(self) -> dict:
        counts = {"kv_bytes_peak": self.peak_kv_bytes, **self.scheduler.report()}
        kv = self.kv.stats()
        # The kernel registry's choices: the strategy's attention and the model's ops, with the
        # fallbacks in force (a sentence each, which the server's health view shows).
        kernels = {**kv.pop("kernels", {}), **self.model.operators.report()}
        ops = {
            "kernels": kernels,
            "operator_fallbacks": [r["problem"] for r in kernels.values() if "problem" in r],
        }
        return kv | self.model.memory_report() | ops | counts

    @property
    def max_batch(self) -> int:
        """The most requests that run in one step."""
        return self.scheduler.config.max_batch

    @property
    def built(self) -> Built | None:
        """How the KV store was chosen and built (config, chip profile), when the engine built
        it; None for a store the caller gave."""
        return self._assembly.kv if self._assembly is not None else None

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
    ) -> _Request:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        ids = self._prompt_ids(prompt, chat)
        ctx = self.model.cfg.context_length
        if len(ids) >= ctx:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {ctx} tokens "
                f"(at most {ctx - 1} for the prompt)"
            )
        self.scheduler.check_fits(len(ids))
        req = _Request(
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

    def _prompt_ids(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        if chat:
            raise ValueError("chat=True needs a text prompt, not token ids")
        return ids

    def _cancel(self, req: _Request) -> None:
        """Cancel a request: the next turn of the loop (at once, or right after the step in
        flight) finishes it and frees its KV on the compute thread."""
        if req.finished or req.cancelled:
            return
        req.cancelled = True
        self._cancels.append(req)
        self._wakeup.set()

    def _finish(self, req: _Request, reason: str, error: BaseException | None = None) -> None:
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
            piece = self._piece(req, req.text[req.emitted :])
            if piece.text or piece.logprobs or piece.prompt_logprobs is not None:
                self._outbox.append((req, ("text", piece)))
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

    @staticmethod
    def _piece(req: _Request, text: str) -> Piece:
        """The next piece of `req`'s stream: `text` and the log-probabilities not yet sent."""
        p, piece = req.params, Piece(text)
        if p.logprobs is not None:
            n = len(req.generated)
            piece.logprobs, req.logprobs_sent = req.logprobs[req.logprobs_sent : n], n
        if p.prompt_logprobs is not None and not req.prompt_sent:
            piece.prompt_logprobs, req.prompt_sent = [None, *req.prompt_logprobs], True
        return piece

    def _flush(self) -> None:
        """Deliver what the last turn collected (on the event loop: asyncio queues)."""
        out, self._outbox = self._outbox, []
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
                    await compute.run(self._release)
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
                await compute.run(self._fail_all, e)
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

    def _fail_all(self, e: Exception) -> None:
        for req in [*self.scheduler.drain(), *self._inbox]:
            if not req.finished:
                self._finish(req, "error", RuntimeError(f"scheduler failure: {e}"))
        self._published = self._report_now()

    def _release(self) -> None:
        """The loop ends: the pool has no owner thread any more (a caller may use it)."""
        pool = getattr(self.kv, "pool", None)
        if pool is not None:
            pool.owner = None

    async def _step(self) -> bool:
        """One turn on the compute thread (`_turn`), then its deliveries on the event loop;
        False when nothing ran."""
        try:
            return await compute.run(self._turn, time.monotonic())
        finally:
            self._flush()

    def _turn(self, now: float) -> bool:
        """Admit, reap cancellations, plan, run the forward pass and book its results; publish
        the memory report. On the compute thread (the pool's owner)."""
        pool = getattr(self.kv, "pool", None)
        if pool is not None:
            pool.owner = threading.get_ident()
        try:
            return self._turn_inner(now)
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

    def _turn_inner(self, now: float) -> bool:
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
        results = self._execute_isolated(plan.work)
        self.scheduler.timed(sum(len(w.tokens) for w in plan.work), time.perf_counter() - t0)
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
            else:
                lps = self._step_lps.get(id(work), {})
                req.prompt_logprobs.extend(lps.get("prompt", ()))
                if "token" in lps:
                    req.logprobs.append(lps["token"])
                self.scheduler.computed(work)
                if outcome is not None:
                    self._emit(req, outcome)
                elif work.needs_logits and req.params.max_new_tokens == 0:
                    self._finish(req, "length")  # the prompt alone was asked for
        self._step_lps.clear()
        return True

    def _execute_isolated(self, plan: list[Work[_Request]]) -> list[tuple[Work[_Request], object]]:
        """Run the batch; if it fails, rerun each request alone so one failure stays its own.

        NOTE: a forward pass that raises has rolled its KV back (`kv.abort_step`, before the
        commit), so running the requests again appends nothing twice; what follows the commit
        (sampling) fails per request inside `_execute` and never reaches this retry."""
        try:
            return list(zip(plan, self._execute(plan), strict=True))
        except Exception as batch_error:
            if len(plan) == 1:
                return [(plan[0], batch_error)]
            log.warning("batched step failed (%s); retrying requests one by one", batch_error)
            out = []
            for work in plan:
                try:
                    out.append((work, self._execute([work])[0]))
                except Exception as e:
                    out.append((work, e))
            return out

    def _execute(self, plan: list[Work[_Request]]) -> list[int | BaseException | None]:
        """One forward pass over the plan; returns per work item the sampled token, None (a
        prompt chunk), or the exception its own sampling raised: after the step's KV is
        committed nothing fails for the batch."""
        tokens, positions, rows = [], [], []
        spans = []  # per item: its rows in the logits (prompt logprobs: all, else the last)
        for w in plan:
            start = w.req.num_computed
            first = len(tokens)
            tokens.extend(w.tokens)
            positions.extend(range(start, start + len(w.tokens)))
            if w.req.wants_prompt_logits and start < len(w.req.prompt_ids):
                span = range(len(rows), len(rows) + len(w.tokens))
                rows.extend(range(first, len(tokens)))
            elif w.needs_logits:
                span = range(len(rows), len(rows) + 1)
                rows.append(len(tokens) - 1)
            else:
                span = range(0)
            spans.append(span)
        batch = StepBatch(
            [w.req.rid for w in plan],
            [len(w.tokens) for w in plan],
            [not w.needs_logits for w in plan],  # a prompt chunk that more of the prompt follows
        )
        dev = self.model.device
        logits = self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv,
            batch,
            torch.tensor(rows, dtype=torch.long, device=dev),
        )
        out: list[int | BaseException | None] = []
        for w, span in zip(plan, spans, strict=True):
            try:  # this request's values: a failure here is its own
                out.append(self._book(w, logits[span.start : span.stop]))
            except Exception as e:
                out.append(e)
        return out

    def _book(self, w: Work[_Request], logits: torch.Tensor) -> int | None:
        """The token sampled for `w` from its rows of logits (None: a prompt chunk, or a
        prompt-only request); the log-probabilities it asked for go to `self._step_lps`."""
        req, p = w.req, w.req.params
        lps: dict[str, object] = {}
        if req.wants_prompt_logits and req.num_computed < len(req.prompt_ids) - 1:
            # row i (position start + i) predicts the prompt token at start + i + 1
            start, n = req.num_computed, len(req.prompt_ids)
            nxt = req.prompt_ids[start + 1 : min(start + len(w.tokens), n - 1) + 1]
            lps["prompt"] = logprobs_of(logits[: len(nxt)], nxt, p.prompt_logprobs)
        token = None
        if w.needs_logits and p.max_new_tokens > 0:
            row = logits[-1]
            banned = ()
            if len(req.output_ids) < p.min_tokens:
                eos = self.tokenizer.eos_id
                banned = (*p.stop_token_ids, *(() if eos is None or p.ignore_eos else (eos,)))
            seen = req.tokens if p.repetition_penalty != 1.0 else ()
            token = sample(row, p, req.gen, seen, banned)
            if p.logprobs is not None:
                lps["token"] = logprobs_of(row.unsqueeze(0), [token], p.logprobs)[0]
        self._step_lps[id(w)] = lps
        return token

    def _emit(self, req: _Request, token: int) -> None:
        """Record a sampled token, stream new text, and finish the request when it should stop."""
        p = req.params
        eos = self.tokenizer.eos_id
        if token in p.stop_token_ids or (token == eos and not p.ignore_eos):
            req.stop_token = token
            self._finish(req, "stop")
            return
        req.output_ids.append(token)
        req.decoder.push(token)
        text = req.decoder.text
        hold = 0
        if p.stop:
            # Search only where a stop string could newly end.
            longest = max(map(len, p.stop))
            tail_from = max(0, len(req.text) - longest)
            hits = [i for s in p.stop if (i := text.find(s, tail_from)) >= 0]
            if hits:
                req.text = text[: min(hits)]
                self._finish(req, "stop")
                return
            hold = longest - 1  # a stop string may be starting at the end of the text
        req.text = text
        safe = max(req.emitted, len(text) - hold)
        if safe > req.emitted:
            self._outbox.append((req, ("text", self._piece(req, text[req.emitted : safe]))))
            req.emitted = safe
        ctx = self.model.cfg.context_length
        if len(req.output_ids) >= p.max_new_tokens or req.num_computed + 1 >= ctx:
            self._finish(req, "length")


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

    def memory_report(self) -> dict: ...

    async def close(self, cancel: bool = False) -> None: ...


class RequestHandle:
    """One submitted request: iterate it for text pieces, or await `result()`."""

    def __init__(self, engine: Engine, req: _Request) -> None:
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
