"""The async engine: requests in, tokens out, many requests batched step by step.

`Engine.create()` loads a model; `stream()` yields text as it is generated, `generate()` returns a
whole `Completion`. A background task runs the scheduler: each step it packs the running requests
(one token for each decoding request, a chunk of prompt for each prefilling one, within a token
budget) into one forward pass, so a request joins at the next step and leaves when it is done
(continuous batching). The forward pass runs on the compute thread (`engine.compute`), keeping the
event loop free.
KV memory belongs to the `KVCache` the engine is given; the engine only asks it to store and free.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from . import compute
from .kv import ContiguousKVCache, KVCache, StepBatch
from .model import LlamaModel, load_model
from .sampling import SamplingParams, sample
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
    emitted: int = 0  # characters of decoded text already streamed
    finish_reason: str | None = None
    cancelled: bool = False
    text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Work:
    req: _Request
    tokens: list[int]
    needs_logits: bool  # True when this chunk ends the known tokens (a new token follows)


class Engine:
    """Async text generation over a `LlamaModel` with continuous batching."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: GGUFTokenizer,
        kv: KVCache | None = None,
        max_batch: int = 16,
        max_step_tokens: int = 512,
    ) -> None:
        if max_batch < 1 or max_step_tokens < 1:
            raise ValueError(
                f"max_batch and max_step_tokens must be >= 1, got {max_batch}, {max_step_tokens}"
            )
        cfg = model.cfg
        self.model, self.tokenizer = model, tokenizer
        self.kv = kv or ContiguousKVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device
        )
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        self.peak_kv_bytes = 0
        self._ids = itertools.count()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
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
        kv: KVCache | None = None,
        max_batch: int = 16,
        max_step_tokens: int = 512,
    ) -> Engine:
        """Load `model` (off the event loop) and start the scheduler."""
        m, tok = await compute.run(load_model, model, dtype, device, progress)
        return cls(m, tok, kv=kv, max_batch=max_batch, max_step_tokens=max_step_tokens)

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

    def memory_report(self) -> dict[str, int]:
        """KV bytes stored now, held now, and the peak stored since the engine started."""
        return {
            "kv_bytes_used": self.kv.bytes_used(),
            "kv_bytes_reserved": self.kv.bytes_reserved(),
            "kv_bytes_peak": self.peak_kv_bytes,
            "requests_running": len(self._running),
            "requests_waiting": len(self._waiting),
        }

    async def close(self, cancel: bool = False) -> None:
        """Stop accepting requests; finish (or with `cancel`, cancel) the ones in flight."""
        self._closed = True
        if cancel:
            for req in [*self._waiting, *self._running]:
                self._cancel(req)
        self._wakeup.set()
        await self._loop_task

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
        req = _Request(
            rid=next(self._ids),
            prompt_ids=ids,
            params=params,
            decoder=IncrementalDecoder(self.tokenizer),
            gen=params.make_generator(),
        )
        self._waiting.append(req)
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
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish(req, "cancelled")
        elif not self._stepping:
            self._finish(req, "cancelled")
        # else: the loop finishes it as soon as the current step returns

    def _finish(self, req: _Request, reason: str, error: BaseException | None = None) -> None:
        req.finish_reason = reason
        if req in self._running:
            self._running.remove(req)
        self.kv.free(req.rid)
        if error is not None:
            req.queue.put_nowait(("error", error))
            return
        if reason != "cancelled" and req.emitted < len(req.text):
            req.queue.put_nowait(("text", req.text[req.emitted :]))
            req.emitted = len(req.text)
        done = Completion(req.text, list(req.output_ids), reason, len(req.prompt_ids))
        req.queue.put_nowait(("done", done))

    # ---- the scheduler ----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            while self._waiting and len(self._running) < self.max_batch:
                self._running.append(self._waiting.popleft())
            plan = self._plan()
            self._stepping = True
            try:
                results = await compute.run(self._execute_isolated, plan)
            finally:
                self._stepping = False
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv.bytes_used())
            for work, outcome in results:
                req = work.req
                if req.finished:
                    continue
                if req.cancelled:
                    self._finish(req, "cancelled")
                elif isinstance(outcome, BaseException):
                    self._finish(req, "error", outcome)
                else:
                    req.num_computed += len(work.tokens)
                    if outcome is not None:
                        self._emit(req, outcome)
            # Give consumers a chance to run (and cancel) between steps.
            await asyncio.sleep(0)

    def _plan(self) -> list[_Work]:
        """Decode tokens first (one per request), then prompt chunks within the token budget."""
        budget = self.max_step_tokens
        plan: list[_Work] = []
        for req in self._running:
            if req.num_computed >= len(req.prompt_ids) and req.output_ids:
                plan.append(_Work(req, [req.output_ids[-1]], True))
                budget -= 1
        for req in self._running:
            remaining = len(req.prompt_ids) - req.num_computed
            if remaining > 0 and budget > 0:
                n = min(remaining, budget)
                chunk = req.prompt_ids[req.num_computed : req.num_computed + n]
                plan.append(_Work(req, chunk, n == remaining))
                budget -= n
        return plan

    def _execute_isolated(self, plan: list[_Work]) -> list[tuple[_Work, object]]:
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

    def _execute(self, plan: list[_Work]) -> list[int | None]:
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
            torch.tensor(tokens, device=dev),
            torch.tensor(positions, device=dev),
            self.kv,
            batch,
            torch.tensor(rows, device=dev),
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


async def generate_many(
    engine: Engine, prompts: Sequence[str], params: SamplingParams | None = None
) -> list[Completion]:
    """Run several prompts concurrently and return their completions in order."""
    return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))
