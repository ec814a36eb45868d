"""`unikv serve`: its arguments and how it starts the server (one engine, or replicas on Ray
Serve), a command like the others in `cli.main`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .args import DECODE_STEPS_HELP, add_model_flags, decode_steps_arg, positive_int, strategy_arg

DESCRIPTION = (
    "Serve the model over an OpenAI-compatible HTTP API: /v1/completions, "
    "/v1/chat/completions (streamed or not), /v1/models, vLLM's /tokenize, /detokenize and "
    "/tokenizer_info, /version, plus /health (liveness), /ready (readiness: 503 when red), "
    "/metrics and /dashboard. Binds to 127.0.0.1 unless --host says otherwise."
)


def add_serve(sub: argparse._SubParsersAction, epilog: str) -> None:
    """The `serve` subcommand's arguments."""
    sp = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description=DESCRIPTION,
        epilog=epilog,
    )
    add_model_flags(sp, strategy_options=False)
    sp.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: --model)",
    )
    sp.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for the model's work (default: PyTorch's, one per core; give each "
        "of several processes on one machine its share)",
    )
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    sp.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the gRPC API on this port (unikv.v1.Generation, the standard health "
        "service, reflection; the same engine, fields and key as HTTP; default: HTTP only)",
    )
    sp.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $UNIKV_API_KEY, else no key)",
    )
    sp.add_argument(
        "--max-waiting",
        type=positive_int,
        default=64,
        help="requests queued before 429 (default: 64)",
    )
    sp.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=4096,
        help="the largest max_tokens a request may ask for (default: 4096)",
    )
    sp.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=1 << 20,
        help="largest request body (default: 1 MiB)",
    )
    rep = sp.add_argument_group(
        "replicas (Ray Serve; needs the 'replicas' extra: pip install 'unikv[replicas]')"
    )
    rep.add_argument(
        "--replicas",
        type=positive_int,
        default=None,
        help="serve N engine replicas as one Ray Serve deployment behind this HTTP API, routed "
        "by health, prefix affinity and queue length (default: one engine in this process)",
    )
    rep.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting a "
        "local Ray; every node needs unikv installed",
    )
    rep.add_argument(
        "--replica-threads",
        type=positive_int,
        default=1,
        help="compute threads (and Ray CPUs) per replica (default: 1)",
    )
    rep.add_argument(
        "--router",
        default="unikv",
        choices=("unikv", "power_of_two"),
        help="replica routing: unikv's (health, prefix affinity, queue) or Ray Serve's "
        "default power-of-two-choices, for comparison (default: unikv)",
    )
    rep.add_argument(
        "--sensor",
        default=None,
        help="temperature sensor of each replica (or, with --report-dir, of the one engine): "
        "auto, hwmon, nvml, command (the chip profile's), none, or scripted:PATH (default: the "
        "config's [thermal] sensor)",
    )
    reports = sp.add_argument_group("reports")
    reports.add_argument(
        "--report-dir",
        default=None,
        help="write a health report per period into this directory: a self-contained HTML page "
        "and a JSON file (requests by outcome, TTFT and latency p50/p99, tokens/s, pool usage "
        "and RSS with their slopes, temperatures, health transitions, advice given)",
    )
    reports.add_argument(
        "--report-every",
        default="1h",
        help="the report period: 90s, 15m, 1h, 1d (default: 1h); the last, partial period is "
        "written at shutdown",
    )
    sp.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names the server answers (default: any); e.g. "
        "localhost,127.0.0.1 stops a web page that rebinds its own name to this address",
    )
    sp.add_argument(
        "--public-metrics",
        action="store_true",
        help="with --api-key, leave /metrics and /dashboard open (default: behind the key)",
    )
    sp.add_argument(
        "--strict",
        action="store_true",
        help="refuse request fields this server does not know with a 400 (default: ignore them, "
        "log them and name them in the x-unikv-ignored-fields response header, as vLLM does)",
    )
    sp.add_argument(
        "--limit-concurrency",
        type=positive_int,
        default=256,
        help="open connections and requests at once; past it new ones get 503 (default: 256)",
    )
    sp.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a request's body may take to arrive (408 after; default: 30); idle "
        "keep-alive connections close after 5 s",
    )
    sp.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="while requests run, stream their new text at most this often (a request's first "
        "token and its end go at once; fewer wake-ups of the server's thread: about 0.1 ms less "
        "a decode step on a 2-core CPU at 20); default: 0, every token as it is sampled",
    )
    sp.add_argument(
        "--decode-steps",
        type=decode_steps_arg,
        default=1,
        help=f"{DECODE_STEPS_HELP}; default: 1, one step a turn (vLLM's default)",
    )
    sp.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM (default: 30)",
    )
    sp.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="answer as soon as the model is loaded (default: run one short request through "
        "the engine first, and each replica's, so the first user's TTFT is not a cold start's; "
        "nothing answers, /ready included, until it has run)",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Start the server and block until it is stopped (SIGINT or SIGTERM)."""
    from unikv.serving.app import ServeSettings
    from unikv.settings.config import load_config

    args.strategy = strategy_arg(args, load_config(args.config).strategy)
    key = args.api_key if args.api_key is not None else os.environ.get("UNIKV_API_KEY")
    for flag, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{flag} {port}: expected 0..65535")
    settings = ServeSettings(
        model_name=args.served_model_name or args.model,
        api_key=key or None,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        allowed_hosts=tuple(args.allowed_hosts.split(",")) if args.allowed_hosts else (),
        public_metrics=args.public_metrics,
        read_timeout_s=args.read_timeout,
        strict=args.strict,
        warm_up=args.warm_up,
    )
    if args.grace < 0:
        raise ValueError(f"--grace {args.grace}: expected seconds >= 0")
    if not 0 <= args.stream_interval_ms <= 1000:
        raise ValueError(f"--stream-interval-ms {args.stream_interval_ms}: expected 0 to 1000")

    from unikv.serving.reports import parse_period
    from unikv.settings.config import SENSOR_KINDS

    args.report_every_s = parse_period(args.report_every)
    if args.report_dir is not None:  # before the model loads: a bad directory fails at once
        Path(args.report_dir).mkdir(parents=True, exist_ok=True)
    kind = args.sensor
    if kind is not None and kind not in SENSOR_KINDS and not kind.startswith("scripted:"):
        raise ValueError(
            f"--sensor {kind!r}: expected one of {', '.join(SENSOR_KINDS)} or scripted:PATH"
        )
    if args.replicas is None:
        if args.ray_address is not None:
            raise ValueError("--ray-address needs --replicas")
        if args.sensor is not None and args.report_dir is None:
            raise ValueError("--sensor needs --replicas or --report-dir")
        return _run(args, settings)

    from unikv.serving.replicas import Replicas, ReplicaSpec

    spec = ReplicaSpec(model=args.model, dtype=args.dtype, weights=args.weights,
                       strategy=args.strategy, config=args.config, chip=args.chip,
                       threads=args.replica_threads,
                       sensor=args.sensor, max_waiting=args.max_waiting,
                       warm_up=args.warm_up,
                       stream_interval_ms=args.stream_interval_ms,
                       decode_steps=args.decode_steps)  # fmt: skip
    replicas = Replicas(spec, args.replicas, address=args.ray_address, router=args.router)
    client = replicas.start()
    try:
        return _run(args, settings, client)
    finally:
        replicas.stop()


def _run(args: argparse.Namespace, settings, client=None) -> int:
    """uvicorn around one engine built here, or around the replicas' `client`."""
    import uvicorn

    from unikv.engine.engine import Engine
    from unikv.serving.app import Server, create_app

    async def make_engine():
        if client is not None:
            return client
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        return await Engine.create(
            args.model,
            device=args.device,
            dtype=args.dtype,
            progress=True,
            strategy=args.strategy,
            config=args.config,
            chip=args.chip,
            weights=args.weights,
            stream_interval_ms=args.stream_interval_ms,
            decode_steps=args.decode_steps,
        )

    server = Server(make_engine, settings)
    if args.grpc_port is not None:
        from unikv.serving.grpc_api import serve_grpc

        serve_grpc(server, args.host, args.grpc_port)
    if args.report_dir is not None:
        from unikv.serving.reports import Reporter

        # One engine: the sensor named (or the config's); replicas report their own readings.
        server.services.append(Reporter(server, args.report_dir, args.report_every_s,
                                        sensor_kind=args.sensor))  # fmt: skip
    app = create_app(server)
    uvicorn.run(
        app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace,
        log_level=args.log_level.lower(), limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,  # request line + headers
    )  # fmt: skip
    return 0
