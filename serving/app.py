"""`unikv serve`: the OpenAI-compatible HTTP server around one engine.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`), `GET /v1/models`, `GET /tokenizer_info`,
`POST /tokenize`, `POST /detokenize`, `GET /version`, `GET /health` (liveness: the three-colour
view, always 200), `GET /ready` (readiness: the same, 503 when red), `GET /metrics`
(Prometheus), `GET /dashboard` (one HTML page) and `GET /dashboard/data` (what the page draws).

Admission: a request is refused with 429 and `Retry-After` when the waiting queue is full or
when the requests in flight reach the health colour's load share of capacity (green 100%,
yellow 80%, red 30%). A client that disconnects has its request cancelled, so its KV is freed
within one engine step. With an API key, `/v1/*` needs `Authorization: Bearer KEY` (compared
in constant time, never logged), as vLLM does. Errors are OpenAI's error object, never a trace.

What does not live here: the wire format (`serving.protocol`), metrics (`serving.metrics`),
health rules (`serving.health`), scheduling and generation (`engine`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from unikv import version as engine_version
from unikv.engine.engine import Engine, RequestHandle, ServedEngine
from unikv.engine.report import ServedReport
from unikv.engine.scheduler import RequestCounts
from unikv.engine.warmup import warm_up
from unikv.kernels import native

from . import protocol as p
from .advice import Advice, Advisor
from .health import Admission, HealthInputs, HealthView, RecentEvents, evaluate, service_fault
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("unikv.serve")
B = TypeVar("B", bound=p._Lenient)
DASHBOARD = Path(resources.files(__package__) / "dashboard.html")
SERIES_BUCKET_S = 5.0  # the dashboard's throughput and TTFT series: one point per 5 s
SERIES_POINTS = 60  # five minutes of them
TIMINGS_KEPT = 100_000  # finished requests' timings kept for the reports (a few MiB)


@dataclass(slots=True)
class ServeSettings:
    """Limits and identity of one server; validated on construction."""

    model_name: str = "smollm2"
    api_key: str | None = None
    max_waiting: int = 64  # requests queued for admission before 429
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    disconnect_poll_s: float = 0.05  # how often a non-streamed request checks its client
    # Host names (the Host header without its port) this server answers; empty: any. Against
    # DNS rebinding: a web page whose name resolves to 127.0.0.1 sends its own Host.
    allowed_hosts: tuple[str, ...] = ()
    public_metrics: bool = False  # /metrics and /dashboard open even when a key is set
    read_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    strict: bool = False  # unknown request fields are a 400 (else ignored, logged, listed)
    warm_up: bool = True  # run one request through the engine before answering at all

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_body_bytes", "max_tokens_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; leave it unset to serve without a key")
        self.allowed_hosts = tuple(h.strip().lower() for h in self.allowed_hosts if h.strip())
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")


class Server:
    """One engine behind the HTTP API: admission, accounting and the health view."""

    def __init__(self, make_engine: Callable[[], Awaitable[ServedEngine]], settings: ServeSettings):
        self.make_engine, self.settings = make_engine, settings
        self.engine: ServedEngine | None = None
        # Other APIs on the same engine, started once it is up and stopped before it closes:
        # objects with `async start()` and `async stop(grace)` (`serving.grpc_api.GrpcServer`).
        self.services: list = []
        self.metrics = ServerMetrics(self.memory_report, lambda: self.health().as_dict())
        self.in_flight = 0
        self.failures = RecentEvents()
        self.advisor = Advisor()
        # Requests by outcome ("ok", "failed", "invalid", "rejected", "cancelled") and the
        # finished ones' (time, TTFT, latency, output tokens): what the reports read.
        self.outcomes: Counter[str] = Counter()
        self.timings: deque[tuple[float, float | None, float, int]] = deque(maxlen=TIMINGS_KEPT)
        self.isa = _isa()  # what the kernel advice lowers
        # (bucket start, output tokens, [TTFTs]) for the dashboard's series
        self._series: deque[list] = deque(maxlen=SERIES_POINTS)

    # ---- readings ------------------------------------------------------------------------------

    def memory_report(self) -> ServedReport | None:
        """The engine's memory report (None before the engine is up)."""
        return self.engine.memory_report() if self.engine is not None else None

    def capacity(self) -> int:
        """Requests the server holds at full load: the running batch plus the waiting queue."""
        batch = self.engine.max_batch if self.engine is not None else 1
        return batch + self.settings.max_waiting

    def health(self) -> HealthView:
        """The three-colour view from the engine's and the server's readings now (replicas
        give their own view, over theirs: `serving.replicas.ReplicaClient.health_view`)."""
        own_view = getattr(self.engine, "health_view", None)
        if own_view is not None:
            return own_view()
        mem = self.memory_report()
        # The pool's readings as it coloured itself (memory.health), plus the server's own.
        pool = mem.pool if mem is not None else None
        readings = pool.readings if pool is not None else HealthInputs(device_usage=0.0)
        return evaluate(
            replace(
                readings,
                waiting=mem.requests.waiting if mem is not None else 0,
                max_waiting=self.settings.max_waiting,
                failures_recent=self.failures.count(),
                operator_fallbacks=mem.operator_fallbacks if mem is not None else (),
            )
        )

    def advice(self) -> list[Advice]:
        """What the operator should change, from the readings of the last minutes
        (`serving.advice`)."""
        mem = self.memory_report()
        return self.advisor.observe(mem, isa=self.isa) if mem is not None else []

    def finished(self, tokens: int, ttft: float | None, latency: float) -> None:
        """A request ended normally: its output tokens, TTFT and latency (the dashboard's
        series, the reports' percentiles)."""
        now = time.time()
        self.outcomes["ok"] += 1
        self.timings.append((now, ttft, latency, tokens))
        start = now // SERIES_BUCKET_S * SERIES_BUCKET_S
        if not self._series or self._series[-1][0] != start:
            self._series.append([start, 0, []])
        self._series[-1][1] += tokens
        if ttft is not None:
            self._series[-1][2].append(ttft)

    def fault(self, e: BaseException) -> None:
        """A request failed with `e` once started: counted against health if the fault is the
        service's (`serving.health.service_fault`), else as the client's (or its leaving)."""
        if service_fault(e):
            self.failures.add()
            self.outcomes["failed"] += 1
        else:
            self.outcomes["cancelled" if isinstance(e, asyncio.CancelledError) else "invalid"] += 1

    def refused(self, status: int) -> None:
        """A request was answered `status` before it started (429: shed; 4xx: invalid; a 5xx
        here is counted where it failed)."""
        if status == 429:
            self.outcomes["rejected"] += 1
        elif status < 500:
            self.outcomes["invalid"] += 1

    def series(self) -> list[dict]:
        """Output tokens/s and median TTFT per bucket of the last minutes."""
        out = []
        for start, tokens, ttfts in self._series:
            ttft = sorted(ttfts)[len(ttfts) // 2] if ttfts else None
            out.append({"t": start, "tokens_per_s": tokens / SERIES_BUCKET_S, "ttft_s": ttft})
        return out

    # ---- admission -----------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse (429) when the queue is full or the load share is reached."""
        mem = self.memory_report()
        if mem is not None and mem.requests.waiting >= self.settings.max_waiting:
            self.metrics.rejected.labels("queue_full").inc()
            raise p.APIError(
                429,
                f"the request queue is full ({self.settings.max_waiting} waiting); retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        view = self.health()
        limit = Admission(self.capacity()).limit(view.load_share)
        if self.in_flight >= limit:
            self.metrics.rejected.labels(f"load_share_{view.status}").inc()
            raise p.APIError(
                429,
                f"the server is {view.status} and admits {view.load_share:.0%} of its load "
                f"({limit} requests in flight): {'; '.join(view.reasons) or 'at capacity'}",
                type="rate_limit_error",
                code="load_shed",
                headers={"Retry-After": "1"},
            )


def _isa() -> str | None:
    """The instruction set the C kernels are built for (None where no build is possible)."""
    try:
        return native.isa()
    except RuntimeError:
        return None


def create_app(server: Server) -> FastAPI:
    """The ASGI app of `server`: routes, authentication, limits and error handling."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await server.make_engine()
        if server.settings.warm_up and isinstance(engine, Engine):  # replicas warm themselves
            await warm_up(engine)  # uvicorn answers nothing (so /ready neither) until it ends
        server.engine = engine
        for service in server.services:  # other APIs on the same engine (the gRPC server)
            await service.start()
        try:
            yield
        finally:
            for service in server.services:
                await service.stop(grace=1.0)
            # Running requests were given the grace period by uvicorn; cancel what is left.
            await server.engine.close(cancel=True)

    app = FastAPI(title="unikv", lifespan=lifespan, docs_url=None, redoc_url=None)
    settings = server.settings

    # A plain ASGI middleware (not BaseHTTPMiddleware, which wraps `receive` and can cut
    # streamed responses short): the API key on /v1/*, and the body size by Content-Length.
    app.add_middleware(_Guard, settings=settings)

    _add_error_handlers(app, server)
    _add_api_routes(app, server)
    _add_operator_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI, server: Server) -> None:
    """Every error answers in OpenAI's error shape (and is counted by outcome)."""

    def answer(exc: p.APIError) -> JSONResponse:
        server.refused(exc.status)
        return _error(exc)

    @app.exception_handler(p.APIError)
    async def api_error(request: Request, exc: p.APIError):
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return answer(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return answer(p.APIError(exc.status_code, str(exc.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("request failed")
        server.outcomes["failed"] += 1
        return _error(p.APIError(500, "internal server error", type="server_error"))


def _add_api_routes(app: FastAPI, server: Server) -> None:
    """The OpenAI-compatible API and vLLM's token routes."""
    settings = server.settings

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": p.now(),
                    "owned_by": "unikv",
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read(request, p.CompletionRequest, settings)
        return await _serve(server, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _read(request, p.ChatCompletionRequest, settings)
        return await _serve(server, request, body, chat=True)

    @app.get("/version")
    async def version():
        return {"version": engine_version()}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness
        probes it before it would fetch a tokenizer from a model hub)."""
        tok = server.engine.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": None,
            "add_bos_token": tok.add_bos,
            "add_eos_token": tok.add_eos,
            "chat_template": tok.chat_template,
            "model_max_length": server.engine.model.cfg.context_length,
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read(request, p.TokenizeRequest, settings)
        tok = server.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise p.APIError(400, "send either 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            chat = p.ChatCompletionRequest(messages=body.messages)
            ids = prompt_ids(server, chat, chat=True)
        else:
            special = None if body.add_special_tokens else False  # None: as the model file says
            ids = tok.encode(body.prompt, add_bos=special, add_eos=special)
        ctx = server.engine.model.cfg.context_length
        return _with(body, {"count": len(ids), "max_model_len": ctx, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read(request, p.DetokenizeRequest, settings)
        vocab = server.engine.model.cfg.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise p.APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}",
                             param="tokens")  # fmt: skip
        return _with(body, {"prompt": server.engine.tokenizer.decode(body.tokens)})


def _add_operator_routes(app: FastAPI, server: Server) -> None:
    """What operators and probes read: health, readiness, metrics, the dashboard."""

    def view() -> tuple[dict, bool]:
        v = server.health()
        body = v.as_dict()
        body["advice"] = [a.as_dict() for a in server.advice()]
        mem = server.memory_report()
        if mem is not None and mem.replicas is not None:
            body["replicas"] = mem.replicas
        return body, v.status == "red"

    @app.get("/health")
    async def health():
        # Liveness: 200 while the process serves, whatever the colour (a probe that restarts
        # a red instance would restart the busiest one).
        return JSONResponse(view()[0])

    @app.get("/ready")
    async def ready():
        # Readiness: the same view, 503 when red (a balancer sends its traffic elsewhere).
        body, red = view()
        return JSONResponse(body, status_code=503 if red else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard():
        return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"))

    @app.get("/dashboard/data")
    async def dashboard_data():
        mem = server.memory_report()
        pool = mem.pool if mem is not None else None
        tiers = {
            name: {"usage": t.usage, "used": t.num_used, "blocks": t.num_blocks}
            for name, t in (pool.tiers if pool is not None else {}).items()
        }
        counts = mem.requests if mem is not None else RequestCounts()
        return {
            "health": server.health().as_dict(),
            "advice": [a.text for a in server.advice()],
            "tiers": tiers,
            "running": counts.running,
            "waiting": counts.waiting,
            "in_flight": server.in_flight,
            "series": server.series(),
        }


# Paths behind the API key when one is set: the API, and (unless `public_metrics`) what shows
# the server's load and its requests. /health stays open for probes.
_KEYED = ("/v1/", "/tokenize", "/detokenize")
_KEYED_UNLESS_PUBLIC = ("/metrics", "/dashboard")


def _host_name(host: bytes) -> str:
    """The Host header's name, without the port ("[::1]:8000" -> "[::1]")."""
    h = host.decode("latin-1").strip().lower()
    if h.startswith("["):
        return h[: h.find("]") + 1] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class _Guard:
    """Refuses a request before any handler runs: 400 for a Host not allowed, 401 without the
    API key, 413 when the declared body is too large (a body without Content-Length is counted
    as it is read)."""

    def __init__(self, app, settings: ServeSettings) -> None:
        self.app, self.settings = app, settings
        self._want = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            err = None
            allowed = self.settings.allowed_hosts
            if allowed and _host_name(headers.get(b"host", b"")) not in allowed:
                err = p.APIError(400, "this server does not answer that Host name",
                                 code="host_not_allowed")  # fmt: skip
            path = scope["path"]
            keyed = path.startswith(_KEYED) or (
                not self.settings.public_metrics and path.startswith(_KEYED_UNLESS_PUBLIC)
            )
            if err is None and self._want is not None and keyed:
                got = headers.get(b"authorization", b"")
                if not hmac.compare_digest(got, self._want):
                    err = p.APIError(401, "missing or wrong API key (send 'Authorization: "
                                     "Bearer KEY')", type="authentication_error",
                                     code="invalid_api_key")  # fmt: skip
            size = headers.get(b"content-length", b"")
            if err is None and size.isdigit() and int(size) > self.settings.max_body_bytes:
                err = _too_large(self.settings.max_body_bytes)
            if err is not None:
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- requests ------------------------------------------------------------------------------------


MAX_JSON_DEPTH = 32  # a request body's nesting (messages -> content parts -> ...) is ~5 deep


def _check_json(data: object) -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH or holding a lone surrogate (text no
    tokenizer can encode); walked without recursion."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise p.APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels",
                             code="invalid_json")  # fmt: skip
        if isinstance(node, dict):
            stack.extend((k, depth) for k in node)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in node):
            raise p.APIError(400, "the body holds a lone surrogate (\\ud800-\\udfff): not "
                             "text", code="invalid_json")  # fmt: skip


def _json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON: a browser's form or text/plain POST (which needs
    no CORS preflight) must not drive the server from a web page the operator visits."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise p.APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                         code="unsupported_media_type")  # fmt: skip


async def _read(request: Request, model: type[B], settings: ServeSettings) -> B:
    """The request body parsed into `model`; 415 unless declared JSON, 413 past the body limit,
    408 past the read timeout, 400 for bad JSON (too deep, lone surrogates) or naming a bad
    field, 404 for another model's name. Unknown fields are logged and kept in
    `body.ignored` (a 400 when `settings.strict`)."""
    limit, timeout = settings.max_body_bytes, settings.read_timeout_s
    _json_content_type(request)
    raw = bytearray()

    async def body() -> None:
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > limit:
                raise _too_large(limit)

    try:  # a client that trickles its body (slowloris) holds a connection for nothing
        await asyncio.wait_for(body(), timeout)
    except TimeoutError:
        raise p.APIError(408, f"the body did not arrive within {timeout:g} s",
                         code="request_timeout") from None  # fmt: skip
    raw = bytes(raw)
    try:
        data = json.loads(raw)
    except ValueError:
        raise p.APIError(400, "the body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise p.APIError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels",
                         code="invalid_json") from None  # fmt: skip
    if not isinstance(data, dict):
        raise p.APIError(400, "the body must be a JSON object", code="invalid_json")
    _check_json(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    if body.model is not None and body.model != settings.model_name:
        raise p.APIError(404, f"the model '{body.model}' does not exist; this server serves "
                         f"'{settings.model_name}'", param="model",
                         code="model_not_found")  # fmt: skip
    if isinstance(body, p._Sampling):
        unknown = body.refuse_unsupported(settings.strict)
    else:
        unknown = body.unknown_fields()
        if settings.strict and unknown:
            raise p.APIError(400, f"unknown field '{unknown[0]}'", param=unknown[0],
                             code="extra_forbidden")  # fmt: skip
    if unknown:
        log.info("ignored unknown request fields: %s", ", ".join(unknown))
    body._ignored = unknown
    return body


def _with(body: p._Lenient, content: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON answer that names the request's ignored fields in `x-unikv-ignored-fields`."""
    return JSONResponse(content, headers={**_ignored(body), **(headers or {})})


def _ignored(body: p._Lenient) -> dict[str, str]:
    return {"x-unikv-ignored-fields": ",".join(body.ignored)} if body.ignored else {}


def prompt_ids(server: Server, body: p._Sampling, chat: bool) -> list[int]:
    """The request's prompt as token ids (a conversation through the chat template)."""
    tok = server.engine.tokenizer
    if chat:
        try:
            text = tok.apply_chat_template(body.conversation())
        except ValueError as e:
            raise p.APIError(400, str(e), param="messages") from None
        return tok.encode(text)
    if isinstance(body.prompt, str):
        if not body.prompt.strip():
            raise p.APIError(400, "prompt is empty", param="prompt")
        return tok.encode(body.prompt)
    if not body.prompt:
        raise p.APIError(400, "prompt is empty", param="prompt")
    return list(body.prompt)


def max_tokens_for(server: Server, body: p._Sampling, chat: bool, prompt_len: int) -> int:
    """max_tokens resolved: the request's, else (chat) what the context leaves; bounded."""
    ctx = server.engine.model.cfg.context_length
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    limit = server.settings.max_tokens_limit
    if asked is None:
        return max(1, min(limit, ctx - prompt_len))
    param = (
        "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    )
    if asked > limit:
        raise p.APIError(
            400, f"{param} = {asked} exceeds this server's limit of {limit}", param=param
        )
    if prompt_len + asked > ctx:
        raise p.APIError(
            400,
            f"this model's context is {ctx} tokens; the prompt has {prompt_len} and "
            f"{param} asks for {asked} more",
            param=param,
            code="context_length_exceeded",
        )
    return asked


async def _serve(server: Server, request: Request, body: p._Sampling, chat: bool):
    """Admit, submit to the engine (`n` requests for `n` choices), and answer (streamed or
    whole)."""
    t0 = time.perf_counter()
    server.admit()
    ids = prompt_ids(server, body, chat)
    max_tokens = max_tokens_for(server, body, chat, len(ids))
    try:
        handles = [server.engine.submit(ids, body.sampling(max_tokens, i), priority=body.priority)
                   for i in range(body.n)]  # fmt: skip
    except ValueError as e:
        raise p.APIError(400, str(e), param="messages" if chat else "prompt") from None
    server.in_flight += 1
    kind = "chat.completion" if chat else "text_completion"
    rid = p.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        gen = _stream(server, handles, body, kind, rid, chat, t0, ids)
        return StreamingResponse(
            gen, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **_ignored(body)},
        )  # fmt: skip
    try:
        dones = await asyncio.gather(*(_whole(server, request, h, t0) for h in handles))
    except Exception as e:  # as a stream says it: the engine's (or lost replica's) reason
        for h in handles:
            h.cancel()
        log.warning("request %s failed: %s", rid, e)
        raise p.APIError(500, f"generation failed: {e}", type="server_error") from None
    finally:
        server.in_flight -= 1
    if any(done is None for done in dones):
        for h in handles:
            h.cancel()
        server.outcomes["cancelled"] += 1
        return Response(status_code=499)  # the client left; nobody reads this
    # Which replica answered, with replicas (`serving.replicas`); absent for one engine.
    where = getattr(handles[0], "replica", None)
    headers = {"x-unikv-replica": where} if where else None
    choices = [_choice(server, body, chat, i, done, ids) for i, done in enumerate(dones)]
    first = dones[0]
    answer = {
        "id": rid,
        "object": kind,
        "created": p.now(),
        "model": server.settings.model_name,
        "choices": choices,
        "usage": p.usage(
            first.prompt_tokens, sum(d.completion_tokens for d in dones), first.cached_tokens
        ),  # fmt: skip
    }
    return _with(body, answer, headers)


def _choice(server: Server, body: p._Sampling, chat: bool, i: int, done, ids: list[int]) -> dict:
    """One choice of a whole answer: text (after the prompt with `echo`), finish reason, and
    the log-probabilities asked for."""
    tok = server.engine.tokenizer

    def decode(token_id: int) -> str:
        return tok.decode([token_id], skip_special=False)

    choice: dict = {"index": i, "finish_reason": p.finish_reason(done.finish_reason)}
    wanted = body.token_logprobs() is not None
    if chat:
        choice["message"] = {"role": "assistant", "content": done.text}
        choice["logprobs"] = p.chat_logprobs(done.logprobs, decode) if wanted else None
        return choice
    echo = getattr(body, "echo", False)
    prompt_text = tok.decode(ids, skip_special=False) if echo else ""
    choice["text"] = prompt_text + done.text
    if not wanted:
        choice["logprobs"] = None
        return choice
    tokens = [decode(x.token_id) for x in done.logprobs]  # as the streamed chunks spell them
    lps: list = list(done.logprobs)
    if echo:
        tokens = [decode(t) for t in ids] + tokens
        lps = list(done.prompt_logprobs or [None] * len(ids)) + lps
    choice["logprobs"] = p.completion_logprobs(tokens, lps, 0, decode)
    return choice


async def _whole(server: Server, request: Request, handle: RequestHandle, t0: float):
    """The whole completion, or None (request cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(_consume(server, handle, t0))
    try:
        while not task.done():
            if await request.is_disconnected():
                handle.cancel()
                task.cancel()
                return None
            await asyncio.wait({task}, timeout=server.settings.disconnect_poll_s)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            handle.cancel()


class Latency:
    """One request's timings: TTFT at its first piece, inter-token gaps after, and the
    finished request's counters and dashboard point."""

    def __init__(self, server: Server, t0: float) -> None:
        self.server, self.t0 = server, t0
        self.first: float | None = None
        self.last = t0

    def piece(self) -> None:
        """A piece of text arrived now."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.server.metrics.ttft.observe(now - self.t0)
        else:
            self.server.metrics.itl.observe(now - self.last)
        self.last = now

    def finished(self, handle: RequestHandle) -> None:
        """The request ended normally: count its tokens and latency."""
        done, m = handle.completion, self.server.metrics
        m.e2e.observe(time.perf_counter() - self.t0)
        m.prompt_tokens.inc(done.prompt_tokens)
        m.generation_tokens.inc(done.completion_tokens)
        m.requests.labels(p.finish_reason(done.finish_reason)).inc()
        ttft = None if self.first is None else self.first - self.t0
        self.server.finished(done.completion_tokens, ttft, time.perf_counter() - self.t0)


async def _consume(server: Server, handle: RequestHandle, t0: float):
    """Read a request to its end, recording its latencies."""
    lat = Latency(server, t0)
    try:
        async for _piece in handle:
            lat.piece()
    except Exception as e:
        server.fault(e)
        raise
    lat.finished(handle)
    return handle.completion


async def _stream(
    server: Server,
    handles: list[RequestHandle],
    body: p._Sampling,
    kind: str,
    rid: str,
    chat: bool,
    t0: float,
    ids: list[int],
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, the `n` choices interleaved as their pieces
    come (each chunk names its `index`), with the log-probabilities of the tokens each piece
    completes and, with `echo`, the prompt first. The requests are cancelled if the client
    leaves (Starlette cancels this generator, and `finally` cancels them)."""
    out = _Chunks(server, body, rid, chat, ids)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for piece in handle.pieces():
                queue.put_nowait((i, piece))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    lats = [Latency(server, t0) for _ in handles]
    unechoed = set(range(len(handles))) if getattr(body, "echo", False) and not chat else set()
    ended = False  # every choice finished, or the stream carried the error
    try:
        if chat:
            for i in range(len(handles)):
                yield out.chunk(i, "", role=True)
        running = len(handles)
        while running:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if i in unechoed:
                unechoed.discard(i)
                yield out.echoed(i, item.prompt_logprobs if item is not None else None)
            if item is None:
                done = handles[i].completion
                yield out.chunk(i, None if chat else "", p.finish_reason(done.finish_reason))
                lats[i].finished(handles[i])
                running -= 1
                continue
            if item.text or item.logprobs:
                if item.text:
                    lats[i].piece()
                yield out.chunk(i, item.text, lps=item.logprobs)
        ended = True
        if body.include_usage:
            yield out.usage(handles)
        yield "data: [DONE]\n\n"
    except Exception as e:  # the stream has started: the error goes in the stream, then DONE
        server.fault(e)
        ended = True
        log.warning("stream %s failed: %s", rid, e)
        err = p.APIError(500, f"generation failed: {e}", type="server_error")
        yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client left mid-stream
            server.outcomes["cancelled"] += 1
        for t in tasks:
            t.cancel()
        for h in handles:
            h.cancel()  # no-op once finished; frees the KV of a request whose client left
        server.in_flight -= 1


class _Chunks:
    """One stream's server-sent events in OpenAI's chunk format: a choice's text and the
    log-probabilities of the tokens it completes (completions keep each choice's text offset),
    the echoed prompt, the usage chunk."""

    def __init__(self, server: Server, body: p._Sampling, rid: str, chat: bool,
                 ids: list[int]) -> None:  # fmt: skip
        self.body, self.rid, self.chat, self.ids = body, rid, chat, ids
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.created, self.model = p.now(), server.settings.model_name
        self.tok = server.engine.tokenizer
        self.wanted = body.token_logprobs() is not None
        self.offsets: dict[int, int] = {}  # completions' text_offset, per choice

    def decode(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special=False)

    def _event(self, data: dict) -> str:
        head = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model}
        return f"data: {json.dumps(head | data)}\n\n"

    def chunk(self, i: int, text: str | None, finish: str | None = None, role: bool = False,
              lps: list | None = None, tokens: list[str] | None = None) -> str:  # fmt: skip
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            lp = p.chat_logprobs(lps, self.decode) if self.wanted and lps else None
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            lp = None
            if self.wanted and lps:
                tokens = tokens or [self.decode(x.token_id) for x in lps]
                at = self.offsets.get(i, 0)
                lp = p.completion_logprobs(tokens, lps, at, self.decode)
                self.offsets[i] = at + sum(map(len, tokens))
            choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
        data: dict = {"choices": [choice]}
        if self.body.include_usage:
            data["usage"] = None
        return self._event(data)

    def echoed(self, i: int, prompt_lps: list | None) -> str:
        """The prompt as choice `i`'s first text, with its log-probabilities."""
        prompt_tokens = [self.decode(t) for t in self.ids]
        text = self.tok.decode(self.ids, skip_special=False)
        return self.chunk(i, text, lps=prompt_lps, tokens=prompt_tokens)

    def usage(self, handles: list[RequestHandle]) -> str:
        """The last chunk of a stream with `include_usage`: no choices, the usage."""
        first = handles[0].completion
        completion = sum(h.completion.completion_tokens for h in handles)
        usage = p.usage(first.prompt_tokens, completion, first.cached_tokens)
        return self._event({"choices": [], "usage": usage})


def _too_large(limit: int) -> p.APIError:
    return p.APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")


def validation_error(errors: list[dict]) -> p.APIError:
    """A 400 naming the first offending field, as OpenAI's error object."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
    field = ".".join(loc) or None
    if e.get("type") == "extra_forbidden":
        msg = f"unknown field '{field}': this server does not support it"
    else:
        msg = f"{field}: {e.get('msg', 'invalid value')}" if field else e.get("msg", "invalid")
    return p.APIError(400, msg, param=field, code=e.get("type"))


def _error(exc: p.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
