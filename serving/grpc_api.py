"""unikv's gRPC API beside the HTTP one (`unikv serve --grpc-port P`): one engine behind both.

What lives here: `GenerationService` (`Generate`, server-streaming text; `Tokenize`; `Models`;
`Advise`, the health colour and the advice of `/health`)
over the same `serving.app.Server` the HTTP app uses, so admission, the urgent-request queue
(`priority`), the limits, the metrics and the health view are the HTTP API's; every request is
validated by the HTTP API's own models (`serving.protocol`), and its errors are mapped to gRPC
status codes (400 -> INVALID_ARGUMENT, 401 -> UNAUTHENTICATED, 429 -> RESOURCE_EXHAUSTED, 500
-> INTERNAL, 503 -> UNAVAILABLE). The API key, when the server has one, is the call metadata
`authorization: Bearer KEY`. A call that is cancelled or runs past its deadline cancels its
request, which frees its KV, as a disconnect does over HTTP. Beside it: the standard
`grpc.health.v1.Health` service (SERVING / NOT_SERVING from the same view as `/ready`, for the
empty service name and `unikv.v1.Generation`; open without the key, like `/health`) and server
reflection, so `grpcurl` needs no copy of the `.proto`.

The service is defined in `serving/unikv.proto`; its Python code (`serving/unikv_pb2.py`,
`unikv_pb2_grpc.py`) is generated from it and committed (`make grpc` regenerates it; a test
checks the two agree).

What does not live here: the engine, the HTTP routes (`serving.app`), the request models
(`serving.protocol`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from . import protocol as p
from . import unikv_pb2 as pb
from . import unikv_pb2_grpc as pb_grpc
from .app import Latency, Server, max_tokens_for, prompt_ids, validation_error

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "unikv.v1.Generation"
HEALTH_EVERY_S = 1.0  # how often the health service's status follows the health view

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
# GenerateRequest fields passed to the HTTP API's request model when set (the rest by name).
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "seed", "min_tokens")  # fmt: skip


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status of an HTTP status the API answers."""
    return _CODES.get(http_status, grpc.StatusCode.INTERNAL)


class GenerationService(pb_grpc.GenerationServicer):
    """`unikv.v1.Generation` over a `Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        server = self.server
        await self._check(context)
        t0 = time.perf_counter()
        try:
            body = _body(request)
            chat = request.chat
            server.admit()
            ids = prompt_ids(server, body, chat)
            max_tokens = max_tokens_for(server, body, chat, len(ids))
            try:
                handle = server.engine.submit(ids, body.sampling(max_tokens),
                                              priority=body.priority)  # fmt: skip
            except ValueError as e:
                raise p.APIError(400, str(e), param="prompt") from None
        except p.APIError as e:
            server.refused(e.status)
            await context.abort(status_code(e.status), e.message)
        server.in_flight += 1
        lat = Latency(server, t0)
        try:
            async for piece in handle:
                lat.piece()
                yield pb.GenerateResponse(text=piece)
            lat.finished(handle)
            done = handle.completion
            yield pb.GenerateResponse(
                finish_reason=p.finish_reason(done.finish_reason),
                prompt_tokens=done.prompt_tokens,
                completion_tokens=done.completion_tokens,
                cached_tokens=done.cached_tokens,
            )
        except asyncio.CancelledError as e:
            server.fault(e)
            raise  # the client cancelled, or its deadline passed: `finally` frees the KV
        except Exception as e:
            server.fault(e)
            log.warning("gRPC Generate failed: %s", e)
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {e}")
        finally:
            handle.cancel()  # a no-op for a finished request; frees a cancelled one's KV
            server.in_flight -= 1

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
        await self._check(context)
        if not request.prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        engine = self.server.engine
        ids = engine.tokenizer.encode(request.prompt)
        return pb.TokenizeResponse(ids=ids, max_model_len=engine.model.cfg.context_length)

    async def Models(self, request: pb.ModelsRequest, context: grpc.aio.ServicerContext):
        await self._check(context)
        ctx = self.server.engine.model.cfg.context_length
        return pb.ModelsResponse(models=[pb.Model(id=self.server.settings.model_name,
                                                  max_model_len=ctx)])  # fmt: skip

    async def Advise(self, request: pb.AdviseRequest, context: grpc.aio.ServicerContext):
        # Open without the key, like /health (whose body carries the same advice).
        view = self.server.health()
        return pb.AdviseResponse(
            status=view.status,
            reasons=list(view.reasons),
            advice=[pb.Advice(**a.as_dict()) for a in self.server.advice()],
        )

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        """The API key (when set) from the call metadata; the engine up."""
        key = self.server.settings.api_key
        if key is not None:
            sent = dict(context.invocation_metadata() or ()).get("authorization", "")
            token = sent.removeprefix("Bearer ").strip()
            if not hmac.compare_digest(token.encode(), key.encode()):
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong API key: send the metadata 'authorization: Bearer KEY'",
                )
        if self.server.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is starting")


def _body(request: pb.GenerateRequest) -> p._Sampling:
    """The request as the HTTP API's model (validated the same way); a 400 if it is not."""
    fields: dict = {name: getattr(request, name) for name in _OPTIONAL if request.HasField(name)}
    fields |= {"stop": list(request.stop) or None, "priority": request.priority,
               "stop_token_ids": list(request.stop_token_ids) or None,
               "ignore_eos": request.ignore_eos}  # fmt: skip
    which = request.WhichOneof("input")
    if which is None:
        raise p.APIError(400, "prompt or prompt_ids is required", param="prompt")
    prompt = request.prompt if which == "prompt" else list(request.prompt_ids.ids)
    try:
        if request.chat:
            if which != "prompt":
                raise p.APIError(400, "chat needs a text prompt", param="prompt")
            return p.ChatCompletionRequest(messages=[{"role": "user", "content": prompt}],
                                           **fields)  # fmt: skip
        return p.CompletionRequest(prompt=prompt, **fields)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


class GrpcServer:
    """The gRPC server of `unikv serve`: the Generation service, health and reflection. Made
    with its `Server` (`serve_grpc`), it starts once the engine is up and stops before it."""

    def __init__(self, server: Server, host: str, port: int) -> None:
        self.server, self.address = server, f"{host}:{port}"
        self.port = port  # the bound port once started (a free one for 0)
        self.grpc: grpc.aio.Server | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind and serve, on the running event loop (the HTTP server's)."""
        self.grpc = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(GenerationService(self.server), self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)  # fmt: skip
        reflection.enable_server_reflection(names, self.grpc)
        self.port = self.grpc.add_insecure_port(self.address)
        if not self.port:
            raise OSError(f"cannot bind the gRPC port {self.address}")
        await self.grpc.start()
        await self._follow_health()
        self._watch = asyncio.create_task(self._watch_health())
        log.info("gRPC on port %d (unikv.v1.Generation, grpc.health.v1.Health, reflection)",
                 self.port)  # fmt: skip

    async def stop(self, grace: float | None = None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.grpc is not None:
            await self.grpc.stop(grace)

    async def _follow_health(self) -> None:
        """SERVING unless the engine is down or the view is red (as /ready answers 503)."""
        up = self.server.engine is not None and self.server.health().status != "red"
        status = health_pb2.HealthCheckResponse.SERVING if up else (
            health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            try:
                await self._follow_health()
            except Exception as e:  # a reading failed: say so, keep following
                log.warning("gRPC health not updated: %s", e)


def serve_grpc(server: Server, host: str, port: int) -> GrpcServer:
    """Serve the gRPC API of `server` on `host:port` (0: any free port: `.port` once started)
    beside its HTTP app, from when its engine is up."""
    grpc_server = GrpcServer(server, host, port)
    server.services.append(grpc_server)
    return grpc_server
