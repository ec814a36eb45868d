"""The async engine: requests in, tokens out, many requests batched step by step.

`Engine.create()` loads a model; `stream()` yields text as it is generated, `generate()` returns a
whole `Completion`. Here live the public async API and each request's lifecycle (sampling, text,
stop strings, finishing, the queue to its consumer). A background task steps the `Scheduler`
(`engine.scheduler`): it plans which requests run and what each feeds (continuous batching), the
engine runs that plan's forward pass on the compute thread (`engine.compute`), keeping the event
loop free, and reports the results back.
KV memory belongs to the `KVCache` the engine is given; the model stores into it, the scheduler
reserves and frees it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from kvstrategies.kv import KVCache, StepBatch
from memory.config import PoolConfig
from memory.pool import BlockLostError

from . import compute
from .loading import load_model
from .model import LlamaModel
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, SchedulerConfig, Work
from .tokenizer import GGUFTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Completion:
    """The result of one request."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


@dataclass(eq=False)
class _Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder
    gen: torch.Generator | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_computed: int = 0  # tokens fed through the model (their KV is in the cache)
    output_ids: list[int] = field(default_factory=list)
    prefix_hit: int = 0  # prompt tokens whose KV came from the prefix cache
    emitted: int = 0  # characters of decoded text already streamed
    finish_reason: str | None = None
    cancelled: bool = False
    text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
    ) -> None:
        # Checked before any KV memory is built for the engine.
        plan_config = SchedulerConfig(max_batch, max_step_tokens, prefix_sharing)
        self.model, self.tokenizer = model, tokenizer
        self.kv = kv if kv is not None else default_kv(model)
        self.kv_choice = "full (default)" if kv is None else type(kv).__name__
        self.owns_kv = kv is None  # a cache the caller gives stays the caller's to close
        self.scheduler: Scheduler[_Request] = Scheduler(self.kv, plan_config)
        self.peak_kv_bytes = 0
        self._ids = itertools.count()
        self._stepping = False
        self._closed = False
        self._wakeup = asyncio.Event()
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
        max_batch: int = 16,
        max_step_tokens: int = 512,
    ) -> Engine:
        """Load `model` (off the event loop), build its KV strategy and pool, start the scheduler.

        `strategy` (a name or "auto"), `config` (a memory-tier TOML file or a `PoolConfig`),
        `chip` (a profile name) and `strategy_options` (over the file's) choose how KV is
        stored; see `kvstrategies.build`.
        """
        m, tok = await compute.run(load_model, model, dtype, device, progress)
        choice = "given by the caller"
        if kv is None:
            built = await compute.run(
                _build, m, strategy, config, chip, tok, strategy_options, progress
            )
            kv, choice = built.strategy, f"{built.name} ({built.reason}; chip {built.chip})"
            if built.moe:
                choice += f"; MoE {built.moe}"
        engine = cls(m, tok, kv=kv, max_batch=max_batch, max_step_tokens=max_step_tokens)
        engine.kv_choice = choice
        engine.owns_kv = choice != "given by the caller"
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
    ) -> RequestHandle:
        """Queue a request and return its handle (iterate it for text, or await `result()`)."""
        return RequestHandle(self, self._submit(prompt, params or SamplingParams(), chat))

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
        """KV bytes stored and held now, the peak stored, pool statistics, request counts."""
        counts = {"kv_bytes_peak": self.peak_kv_bytes, **self.scheduler.report()}
        return self.kv.stats() | self.model.memory_report() | counts

    @property
    def max_batch(self) -> int:
        """The most requests that run in one step."""
        return self.scheduler.config.max_batch

    async def close(self, cancel: bool = False) -> None:
        """Stop accepting requests; finish (or with `cancel`, cancel) the ones in flight."""
        self._closed = True
        if cancel:
            for req in [*self.scheduler.waiting, *self.scheduler.running]:
                self._cancel(req)
        self._wakeup.set()
        await self._loop_task
        if self.owns_kv:
            await compute.run(self.kv.close)

    # ---- submission and cancellation --------------------------------------------------------

    def _submit(self, prompt: str | Sequence[int], params: SamplingParams, chat: bool) -> _Request:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
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
        )
        self.scheduler.add(req)
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
        """Cancel a request; its KV is freed now, or right after the step in flight."""
        if req.finished:
            return
        req.cancelled = True
        if self.scheduler.is_queued(req) or not self._stepping:
            self._finish(req, "cancelled")
        # else: it is in the step in flight; the loop finishes it as soon as the step returns

    def _finish(self, req: _Request, reason: str, error: BaseException | None = None) -> None:
        req.finish_reason = reason
        self.scheduler.finish(req)
        if error is not None:
            req.queue.put_nowait(("error", error))
            return
        if reason != "cancelled" and req.emitted < len(req.text):
            req.queue.put_nowait(("text", req.text[req.emitted :]))
            req.emitted = len(req.text)
        done = Completion(req.text, list(req.output_ids), reason, len(req.prompt_ids))
        req.queue.put_nowait(("done", done))

    # ---- stepping the scheduler ---------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if self.scheduler.idle():
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self._step()
            except Exception as e:  # a scheduler bug must not hang every caller
                log.exception("scheduler step failed")
                for req in self.scheduler.drain():
                    if not req.finished:
                        self._finish(req, "error", RuntimeError(f"scheduler failure: {e}"))
            # Give consumers a chance to run (and cancel) between steps.
            await asyncio.sleep(0)

    async def _step(self) -> None:
        """Get the scheduler's plan, run its forward pass, and deliver what it computed."""
        plan = self.scheduler.schedule()
        for req in plan.outgrown:
            self._finish(req, "length")
        if not plan.work:
            return  # everything was preempted this round; admission brings it back
        self._stepping = True
        try:
            results = await compute.run(self._execute_isolated, plan.work)
        finally:
            self._stepping = False
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
                self.scheduler.computed(work)
                if outcome is not None:
                    self._emit(req, outcome)

    def _execute_isolated(self, plan: list[Work[_Request]]) -> list[tuple[Work[_Request], object]]:
        """Run the batch; if it fails, rerun each request alone so one failure stays its own."""
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

    def _execute(self, plan: list[Work[_Request]]) -> list[int | None]:
        """One forward pass over the plan; returns the sampled token per work item (or None)."""
        tokens, positions, rows = [], [], []
        for w in plan:
            start = w.req.num_computed
            tokens.extend(w.tokens)
            positions.extend(range(start, start + len(w.tokens)))
            if w.needs_logits:
                rows.append(len(tokens) - 1)
        batch = StepBatch([w.req.rid for w in plan], [len(w.tokens) for w in plan])
        dev = self.model.device
        logits = self.model.forward(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv,
            batch,
            torch.tensor(rows, dtype=torch.long, device=dev),
        )
        out: list[int | None] = []
        r = 0
        for w in plan:
            if w.needs_logits:
                out.append(sample(logits[r], w.req.params, w.req.gen))
                r += 1
            else:
                out.append(None)
        return out

    def _emit(self, req: _Request, token: int) -> None:
        """Record a sampled token, stream new text, and finish the request when it should stop."""
        p = req.params
        eos = self.tokenizer.eos_id
        if token in p.stop_token_ids or (token == eos and not p.ignore_eos):
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
            req.queue.put_nowait(("text", text[req.emitted : safe]))
            req.emitted = safe
        ctx = self.model.cfg.context_length
        if len(req.output_ids) >= p.max_new_tokens or req.num_computed + 1 >= ctx:
            self._finish(req, "length")


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


def default_kv(model: LlamaModel) -> KVCache:
    """The `full` strategy over the default pool (a 1 GiB device tier)."""
    return _build(model, "full").strategy


def _build(
    model: LlamaModel,
    strategy: str | None = None,
    config: str | PoolConfig | None = None,
    chip: str | None = None,
    tokenizer=None,
    options: dict | None = None,
    progress: bool = False,
):
    """The KV strategy (and its pool) for `model` under a strategy name, config and chip.

    With the `tokenizer`, a strategy that needs per-model preparation (a calibration) gets it.
    """
    import kvstrategies

    spec = model.kv_spec()
    prep = {"model": model, "tokenizer": tokenizer} if tokenizer is not None else {}
    return kvstrategies.build(
        spec, strategy, config, chip, device=model.device, options=options, progress=progress,
        **prep,
    )  # fmt: skip
