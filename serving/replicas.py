"""`unikv serve --replicas N`: N engine replicas as one Ray Serve deployment, one HTTP front.

Where things run:

- **The front** (the `unikv serve` process) runs the same OpenAI-compatible app as the plain
  server (`serving.app`), with a `ReplicaClient` where the engine would be: it tokenizes,
  computes the prompt's leading block hashes (the pool's chained content hashes) and calls the
  deployment through a Ray Serve handle, whose request router (`serving.ray_router`, policy in
  `serving.routing`) picks the replica.
- **Each replica** (`EngineReplica`, a Ray actor) holds one `Engine` with its own pool, a
  compute-thread budget (one by default), a temperature sensor (`serving.sensors`), the
  cooling rule (`serving.cooling`) and its own health view; it reports them to the router
  through Ray Serve's `record_routing_stats` hook every `stats_period_s`.

Failures: a replica that dies, or fails Ray Serve's health check (`check_health`: its engine
loop has stopped), is taken out of rotation and restarted by Ray Serve. A request that had sent
no text yet is retried on another replica (at most `MAX_RETRIES` times); a stream that had
started ends with an error event, never silence; the front counts both.

Ray is an optional extra (`pip install 'unikv[replicas]'`): only this module and
`serving.ray_router` import it, and only `unikv serve --replicas` imports them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from unikv.engine.engine import Completion, Piece, RequestHandle
from unikv.engine.gguf_loader import check_weights
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import RequestCounts
from unikv.memory.prefix import chain_hashes
from unikv.memory.stats import PrefixCounts

from . import routing
from .health import SHARES, HealthView, Indicator

log = logging.getLogger("unikv.replicas")
APP, DEPLOYMENT = "unikv", "unikv_engine"
MAX_RETRIES = 2  # a request that sent no text yet is retried on another replica this often
HASH_BYTES = 8  # block hashes are compared on their first 8 bytes (router and reports)
REPORTED_HASHES = 2048  # newest cached block hashes a replica reports
ROUTERS = {
    "unikv": "unikv.serving.ray_router:UnikvRouter",
    # Ray Serve's default, for comparison (benchmarks/replicas.py).
    "power_of_two": "unikv.serving.ray_router:PowerOfTwoRouter",
}


@dataclass(slots=True)
class ReplicaSpec:
    """How every replica builds its engine, and how often it reports."""

    model: str = "smollm2"
    dtype: str = "float32"
    weights: str = "native"  # engine.gguf_loader.WEIGHT_MODES
    strategy: str | None = None
    config: str | None = None
    chip: str | None = None
    threads: int = 1  # compute threads per replica
    sensor: str | None = None  # None: the config's [thermal] sensor
    max_waiting: int = 64
    stats_period_s: float = 1.0
    warm_up: bool = True  # one request through the engine before the replica answers
    stream_interval_ms: float = 0.0  # Engine.create's: 0 streams every token as sampled
    decode_steps: int = 1  # Engine.create's: greedy decode steps per native call
    # Simulation for benchmarks: while the sensor reads at or above the chip's limit, each
    # engine step takes this much longer (0.3: 30% slower, the throttling the field measured).
    simulate_throttle: float = 0.0

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        check_weights(self.weights)
        if not 0 < self.stats_period_s <= 60:
            raise ValueError(f"stats_period_s must be in (0, 60], got {self.stats_period_s}")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ValueError(f"stream_interval_ms must be in [0, 1000], got "
                             f"{self.stream_interval_ms}")  # fmt: skip
        if type(self.decode_steps) is not int or not 1 <= self.decode_steps <= 64:
            raise ValueError(f"decode_steps must be an integer in [1, 64], got "
                             f"{self.decode_steps!r}")  # fmt: skip
        if not 0 <= self.simulate_throttle <= 10:
            raise ValueError(f"simulate_throttle must be in [0, 10], got {self.simulate_throttle}")


# ---- the replica -------------------------------------------------------------------------------


class EngineReplica:
    """One engine in a Ray actor (made a Ray Serve deployment by `deploy`)."""

    async def __init__(self, spec: dict) -> None:
        import torch
        from ray import serve

        from unikv.engine.engine import Engine
        from unikv.engine.warmup import warm_up

        from .app import Server, ServeSettings
        from .cooling import Cooling
        from .sensors import open_sensor

        self.spec = ReplicaSpec(**spec)
        torch.set_num_threads(self.spec.threads)
        ctx = serve.get_replica_context()
        self.id = ctx.replica_id.unique_id
        rank = getattr(ctx.rank, "rank", ctx.rank)
        self.name = f"{rank}-{self.id[:8]}"
        self.rank = rank
        s = self.spec
        engine = await Engine.create(s.model, dtype=s.dtype, strategy=s.strategy,
                                     config=s.config, chip=s.chip, weights=s.weights,
                                     stream_interval_ms=s.stream_interval_ms,
                                     decode_steps=s.decode_steps)  # fmt: skip
        if s.warm_up:
            await warm_up(engine)
        # The same book-keeping as a single server: failures, preemptions, the health view.
        self.server = Server(None, ServeSettings(model_name=s.model, max_waiting=s.max_waiting))
        self.server.engine = self.engine = engine
        built = engine.built
        thermal = built.config.thermal
        profile = built.profile
        kind = s.sensor or thermal.sensor
        if kind.startswith("scripted:") and os.path.isdir(kind[len("scripted:") :]):
            # A directory of scripted readings: this replica reads the file named by its rank.
            kind = os.path.join(kind, str(rank))
        self.sensor = open_sensor(kind, profile, "cpu")
        limit = profile.tuned.thermal_throttle_c if profile is not None else 85.0
        self.cooling = Cooling.from_options(limit, thermal)
        self.cooling.name = self.name
        self.interval_s = thermal.interval_s
        self._seq = 0
        self._hot = False  # the last reading was at or above the limit
        if s.simulate_throttle:
            self._throttle_steps(s.simulate_throttle)
        self._watch = asyncio.get_running_loop().create_task(self._watch_sensor())
        log.info("replica %s up: %s; sensor %s", self.name, engine.kv_choice,
                 self.sensor.describe() if self.sensor else "none")  # fmt: skip

    def _throttle_steps(self, slowdown: float) -> None:
        """The benchmark's hot chip: while `_hot`, every engine step takes `slowdown` longer."""

        async def throttled(seconds: float) -> None:
            if self._hot:
                await asyncio.sleep(seconds * slowdown)

        self.engine.after_step = throttled

    async def _watch_sensor(self) -> None:
        """Read the sensor every `interval_s`; a cooling window halves the batch limit."""
        while True:
            temp = await asyncio.to_thread(self.sensor.read) if self.sensor else None
            if temp is not None:
                self._hot = temp >= self.cooling.limit_c
            change = self.cooling.observe(temp)
            if change == "enter":
                self.engine.limit_batch(max(1, self.engine.max_batch // 2))
            elif change == "leave":
                self.engine.limit_batch(None)
            await asyncio.sleep(self.interval_s)

    async def describe(self) -> dict:
        """What the front needs once: the hash parameters, context and batch."""
        digest = self.engine.prefix_digest(0)
        block_size, identity = (digest[0], digest[1]) if digest else (0, "")
        return {
            "block_size": block_size,
            "identity": identity,
            "context_length": self.engine.model.cfg.context_length,
            "max_batch": self.engine.max_batch,
            "kv_choice": self.engine.kv_choice,
        }

    async def generate(self, payload: dict) -> AsyncIterator[dict]:
        """Events of one request: {"replica"}, then {"text"} pieces, then {"done"}."""
        params = payload["params"]
        handle = self.engine.submit(payload["prompt_ids"], params,
                                    priority=payload.get("priority", 0))  # fmt: skip
        self.server.in_flight += 1
        try:
            yield {"replica": self.name}
            async for piece in handle.pieces():
                yield {"text": piece}  # a Piece: text and log-probabilities (pickled by Ray)
            c = handle.completion
            yield {"done": {"text": c.text, "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                            "prompt_tokens": c.prompt_tokens,
                            "cached_tokens": c.cached_tokens, "logprobs": c.logprobs,
                            "prompt_logprobs": c.prompt_logprobs}}  # fmt: skip
        except Exception as e:
            self.server.fault(e)
            raise
        finally:
            handle.cancel()  # the front went away (Ray cancels this generator): free the KV
            self.server.in_flight -= 1

    async def record_routing_stats(self) -> dict:
        """The report the router ranks this replica by (polled by Ray Serve)."""
        self._seq += 1
        view = self.server.health()
        forced = getattr(self.sensor, "health", None)
        mem = self.engine.memory_report()
        digest = self.engine.prefix_digest(REPORTED_HASHES)
        return {
            "seq": self._seq,
            "name": self.name,
            "rank": self.rank,
            "status": forced or view.status,
            "reasons": ["health forced by the scripted sensor"] if forced else list(view.reasons),
            "cooling": self.cooling.cooling,
            "temperature_c": self.cooling.temperature,
            "limit_c": self.cooling.limit_c,
            "cooling_entered": self.cooling.transitions["enter"],
            "cooling_left": self.cooling.transitions["leave"],
            "batch_limit": self.engine.batch_limit,
            "max_batch": self.engine.max_batch,
            "queue": mem.requests.running + mem.requests.waiting,
            "requests_running": mem.requests.running,
            "requests_waiting": mem.requests.waiting,
            "preemptions": mem.requests.preemptions,
            "kv_bytes_used": mem.kv_bytes_used,
            "ssd_writes_skipped": mem.ssd_writes_skipped,
            "prefix_queries": mem.prefix.queries,
            "prefix_hits": mem.prefix.hits,
            "hashes": [h[:HASH_BYTES].hex() for h in digest[2]] if digest else [],
        }

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped is restarted."""
        try:
            self.engine.check_running()
        except RuntimeError as e:
            raise RuntimeError(f"replica {self.name}: {e}") from None

    async def __del__(self) -> None:  # Ray Serve awaits an async __del__ on shutdown
        if hasattr(self, "_watch"):  # (a constructor that failed has nothing to stop)
            self._watch.cancel()
        if hasattr(self, "engine"):
            await self.engine.close(cancel=True)


# ---- the front ----------------------------------------------------------------------------------


class ReplicaLostError(RuntimeError):
    """A request's replica died after it had sent text (the stream ends with this error)."""


class ReplicaClient:
    """The engine side of `serving.app.Server` when replicas serve: the same calls, over Ray."""

    def __init__(self, handle, info: dict, tokenizer, replicas: int) -> None:
        self.handle, self.tokenizer, self.num_replicas = handle, tokenizer, replicas
        self.model = SimpleNamespace(cfg=SimpleNamespace(context_length=info["context_length"]))
        self.block_size, self.identity = info["block_size"], info["identity"]
        self._batch = info["max_batch"]
        self.kv_choice = info["kv_choice"]
        self.retried = 0  # requests retried on another replica before any text
        self.lost_streams = 0  # started streams ended by a dead replica (with an error event)

    # ---- readings ------------------------------------------------------------------------------

    def replicas(self) -> dict[str, dict]:
        """Each live replica's last report (empty before the router has one)."""
        router = routing.current()
        return router.replica_stats() if router is not None else {}

    @property
    def max_batch(self) -> int:
        reps = self.replicas()
        if not reps:
            return self._batch * self.num_replicas
        return sum(int(r.get("batch_limit", self._batch)) for r in reps.values())

    def memory_report(self) -> ReplicasReport:
        """Totals over the replicas, each replica's report, and the router's decisions."""
        reps = self.replicas()

        def total(key: str) -> int:
            return sum(int(r.get(key, 0)) for r in reps.values())

        router = routing.current()
        policy = getattr(router, "policy", None)
        return ReplicasReport(
            requests=RequestCounts(
                running=total("requests_running"),
                waiting=total("requests_waiting"),
                preemptions=total("preemptions"),
            ),  # fmt: skip
            kv_bytes_used=total("kv_bytes_used"),
            prefix=PrefixCounts(queries=total("prefix_queries"), hits=total("prefix_hits")),
            ssd_writes_skipped=total("ssd_writes_skipped"),
            kv_choice=self.kv_choice,
            replicas={r.get("name", uid): _public(r) for uid, r in reps.items()},
            router={
                "decisions": dict(policy.decisions) if policy is not None else {},
                "retried": self.retried,
                "lost_streams": self.lost_streams,
            },
        )

    def health_view(self) -> HealthView:
        """Green when every replica is green; red when none can take a request; else yellow.
        The load share is the mean of the replicas' (a cooling replica counts 0)."""
        reps = list(self.replicas().values())
        if not reps:
            return HealthView("red", SHARES["red"], ("no replica is up yet",), ())
        shares, reasons, inds = [], [], []
        for r in reps:
            status, name = r.get("status", "green"), r.get("name", "?")
            share = 0.0 if r.get("cooling") else SHARES.get(status, SHARES["red"])
            shares.append(share)
            why = [f"{name}: cooling at {r.get('temperature_c')} °C"] if r.get("cooling") else []
            why += [f"{name}: {x}" for x in r.get("reasons", ())]
            reasons += why
            state = "normal" if status == "green" and not r.get("cooling") else "near"
            inds.append(Indicator(f"replica {name}", state, "; ".join(why)))
        serving = [s for s in shares if s > 0]
        if not serving:
            status = "red"
        elif all(r.get("status") == "green" and not r.get("cooling") for r in reps):
            status = "green"
        else:
            status = "yellow"
        share = max(SHARES["red"], sum(shares) / len(shares))
        return HealthView(status, share, tuple(reasons), tuple(inds))

    # ---- requests ------------------------------------------------------------------------------

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> RemoteHandle:
        ids = list(prompt_ids)
        ctx = self.model.cfg.context_length
        if len(ids) >= ctx:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {ctx} tokens "
                             f"(at most {ctx - 1} for the prompt)")  # fmt: skip
        hashes = []
        if self.block_size:
            hashes = [h[:HASH_BYTES] for h in chain_hashes(ids[:-1], self.block_size,
                                                           self.identity)]  # fmt: skip
        payload = {"prompt_ids": ids, "params": params, "priority": priority,
                   "prefix_hashes": hashes}  # fmt: skip
        return RemoteHandle(self, payload)

    async def close(self, cancel: bool = False) -> None:
        """Nothing to close here: `Replicas.stop` shuts the deployment down."""


class RemoteHandle(RequestHandle):
    """One request on a replica: iterate it for text pieces, await `result()` or `cancel()`
    it, as a local engine's `RequestHandle`."""

    def __init__(self, client: ReplicaClient, payload: dict) -> None:  # not the engine's
        self.client, self.payload = client, payload
        self.completion: Completion | None = None
        self.replica: str | None = None
        self._gen = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.payload["prompt_ids"])

    async def pieces(self) -> AsyncIterator[Piece]:
        from ray.exceptions import RayActorError

        attempt = 0
        while True:
            started = False
            self._gen = self.client.handle.options(stream=True).generate.remote(self.payload)
            try:
                async for event in self._gen:
                    if "text" in event:
                        started = True
                        yield event["text"]
                    elif "replica" in event:
                        self.replica = event["replica"]
                    elif "done" in event:
                        self.completion = Completion(**event["done"])
                        return
                raise ReplicaLostError(f"replica {self.replica} ended the request unfinished")
            except RayActorError as e:
                if started:
                    self.client.lost_streams += 1
                    raise ReplicaLostError(
                        f"replica {self.replica} died mid-stream ({type(e).__name__})"
                    ) from None
                if attempt >= MAX_RETRIES:
                    raise ReplicaLostError(
                        f"no replica finished the request after {attempt + 1} tries: {e}"
                    ) from None
                attempt += 1
                self.client.retried += 1
                log.warning("replica %s failed before answering (%s); retrying on another",
                            self.replica, type(e).__name__)  # fmt: skip

    def cancel(self) -> None:
        """Cancel the request on its replica (no-op once finished)."""
        if self._gen is not None and self.completion is None:
            self._gen.cancel()


@dataclass(frozen=True)
class ReplicasReport:
    """`ReplicaClient.memory_report()`: the replicas' totals, each replica's last report (the
    dict it gave the router) and the router's decisions; read by the server as any engine's
    report (`engine.report.ServedReport`)."""

    requests: RequestCounts
    kv_bytes_used: int
    prefix: PrefixCounts
    ssd_writes_skipped: int
    kv_choice: str
    replicas: dict[str, dict]
    router: dict
    pool = None  # each replica has its own pool: no one report of it here
    operator_fallbacks: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        """JSON-serializable form."""
        return asdict(self)


def _public(report: dict) -> dict:
    """A replica's report without its hash list (for /health and /metrics)."""
    return {k: v for k, v in report.items() if k not in ("hashes", "seq")}


# ---- starting and stopping ----------------------------------------------------------------------


class Replicas:
    """A Ray Serve deployment of `replicas` engines and the client the front uses."""

    def __init__(self, spec: ReplicaSpec, replicas: int, address: str | None = None,
                 router: str = "unikv", router_kwargs: dict | None = None) -> None:  # fmt: skip
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        if router not in ROUTERS:
            raise ValueError(f"router {router!r}: expected one of {', '.join(ROUTERS)}")
        self.spec, self.num_replicas, self.address = spec, replicas, address
        self.router, self.router_kwargs = router, router_kwargs or {}
        self.client: ReplicaClient | None = None
        self._started_ray = False

    def start(self) -> ReplicaClient:
        """Start (or join) Ray, deploy the replicas, wait until they answer."""
        try:
            import ray
            from ray import serve
            from ray.serve.config import RequestRouterConfig
        except ImportError:
            raise RuntimeError(
                "--replicas needs Ray Serve: pip install 'unikv[replicas]' (ray[serve])"
            ) from None
        from unikv.engine.loading import load_tokenizer

        t0 = time.monotonic()
        threads = self.spec.threads
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, logging_level=logging.WARNING,
                         runtime_env={"env_vars": env})  # fmt: skip
            else:
                cpus = max(os.cpu_count() or 1, self.num_replicas * threads)
                ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING,
                         runtime_env={"env_vars": env})  # fmt: skip
            self._started_ray = True
        serve.start(proxy_location="Disabled")
        period = self.spec.stats_period_s
        router_config = RequestRouterConfig(
            request_router_class=ROUTERS[self.router],
            request_router_kwargs=self.router_kwargs,
            request_routing_stats_period_s=period,
            request_routing_stats_timeout_s=max(2 * period, 5.0),
        )
        deployment = serve.deployment(
            EngineReplica,
            name=DEPLOYMENT,
            num_replicas=self.num_replicas,
            max_ongoing_requests=1024,  # the replica's own scheduler queues; the front sheds
            ray_actor_options={"num_cpus": threads},
            request_router_config=router_config,
            health_check_period_s=2.0,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=5.0,
        )
        handle = serve.run(deployment.bind(asdict(self.spec)), name=APP, route_prefix=None)
        info = handle.describe.remote().result()
        self.client = ReplicaClient(handle, info, load_tokenizer(self.spec.model),
                                    self.num_replicas)  # fmt: skip
        log.info("%d replicas up in %.1f s (router %s)", self.num_replicas,
                 time.monotonic() - t0, self.router)  # fmt: skip
        return self.client

    def wait_reports(self, timeout_s: float = 60.0) -> None:
        """Block until the router has a report from every replica (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reps = self.client.replicas() if self.client else {}
            if len(reps) >= self.num_replicas and all("name" in r for r in reps.values()):
                return
            time.sleep(0.1)
        raise TimeoutError(f"replicas did not all report within {timeout_s:g} s")

    def stop(self) -> None:
        """Delete the deployment; shut Ray down if it was started here."""
        import ray
        from ray import serve

        try:
            serve.delete(APP)
            serve.shutdown()
        finally:
            if self._started_ray:
                ray.shutdown()
